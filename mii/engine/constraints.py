"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regular expression, a choice
among strings, or a grammar (Lark, or llama.cpp's GBNF), with llguidance (a Rust grammar engine made for LLM serving,
https://github.com/guidance-ai/llguidance) computing the allowed tokens on the CPU.

How to ask for one (the same keyword arguments in `mii.pipeline`, `mii.client`, MII's REST route and, through
`response_format` / vLLM's `guided_*` fields, the OpenAI API):

    pipe(prompt, json_schema={"type": "object", "properties": {...}, "required": [...]})  # dict or JSON text
    pipe(prompt, json_object=True)                 # any JSON object
    pipe(prompt, regex=r"\\d{3}-\\d{4}")            # the whole output matches
    pipe(prompt, choice=["yes", "no"])              # exactly one of the strings
    pipe(prompt, grammar='root ::= "a" | "b"')      # GBNF, or Lark: 'start: "a" | "b"'

At most one per request; each may be a per-prompt list like every generation parameter. Code that builds
requests itself (e.g. tool calling) passes the same keys in the generation keyword arguments: a JSON schema as a
`dict` (or its JSON text) under `json_schema`. `Constraint.of(params)` names the one a `GenerationParams` carries.

The pieces, in request order:
- `GrammarCompiler.compile(constraint)` at admission (`InputProcessor`, the tokenizer thread): compiled once per
  (tokenizer, constraint) and cached; a bad schema, regex or grammar, or one that no text matches, is a
  `ValidationError` naming its field.
- `CompiledGrammar.matcher()` when the engine admits a sequence: its own `Matcher` (a copy of the compiled one).
- every step, `fill_bitmask` for the rows that have a matcher (one bit per vocabulary id, batched across rows on
  llguidance's threads); the sampler sets the other logits of those rows to -inf. Rows without one cost nothing.
- after sampling, `Matcher.advance(token)`; when the grammar is complete the request ends (finish reason "stop").
  EOS is in the mask only where the grammar accepts. A complete grammar ends the request even before
  `min_new_tokens` (where the grammar allows nothing but what their ban takes away, the ban yields); a
  `stop_token_ids` token can come only where the grammar allows it as text; stop strings cut the constrained text
  as any other (the answer is then a prefix).

A preempted sequence keeps its matcher: preemption frees only KV blocks, and the recomputed tokens are not sampled
again, so the matcher, which has consumed exactly the generated tokens, stays right (`Matcher.replay` rebuilds one
from them where a fresh one is needed). The engine drops the matcher when the sequence finishes or is aborted.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mii.errors import ValidationError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""The generation parameters that carry a constraint (at most one per request)."""

JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}
"""llguidance's JSON options unless the schema's own "x-guidance" says otherwise: whitespace between tokens is
allowed (models write `{"a": 1}` and indented JSON) but bounded, so a model cannot wander in blanks forever."""

_CACHE_SIZE = 64


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: `kind` (one of `KINDS`) and its text (JSON text for json_schema and
    choice)."""

    kind: str
    text: str

    @classmethod
    def of(cls, params) -> Optional["Constraint"]:
        """The constraint a `GenerationParams` carries, if any (its fields were validated by `check_fields`)."""
        if params.json_schema is not None:
            return cls("json_schema", params.json_schema)
        if params.json_object:
            return cls("json_object", '{"type": "object"}')
        if params.regex is not None:
            return cls("regex", params.regex)
        if params.choice is not None:
            return cls("choice", json.dumps(list(params.choice)))
        if params.grammar is not None:
            return cls("grammar", params.grammar)
        return None


def normalize_json_schema(value) -> Optional[str]:
    """A `json_schema` argument (a dict, True/False, or JSON text) → compact JSON text; errors name the field."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValidationError("json_schema", f"is not valid JSON: {e}") from None
        except RecursionError:
            raise ValidationError("json_schema", "is nested too deeply") from None
    if not isinstance(value, (dict, bool)):
        raise ValidationError("json_schema", f"must be a JSON schema (an object), got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)  # key order kept: properties come in it
    except (TypeError, ValueError) as e:
        raise ValidationError("json_schema", f"cannot be written as JSON: {e}") from None
    except RecursionError:
        raise ValidationError("json_schema", "is nested too deeply") from None


def check_fields(params, max_chars: int) -> None:
    """At most one constraint, each of the right type and size (the grammar itself is checked when compiled)."""
    given = [k for k in KINDS if (getattr(params, k) not in (None, False))]
    if len(given) > 1:
        raise ValidationError(given[1], f"only one constraint per request; {', '.join(given)} were given")
    if not isinstance(params.json_object, bool):
        raise ValidationError("json_object", f"must be a boolean, got {params.json_object!r:.60}")
    for name in ("regex", "grammar"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValidationError(name, f"must be a non-empty string, got {value!r:.60}")
    if params.choice is not None:
        if not params.choice or not all(isinstance(c, str) and c for c in params.choice):
            raise ValidationError("choice", "must be a non-empty list of non-empty strings")
    for name in ("json_schema", "regex", "grammar"):
        value = getattr(params, name)
        if value is not None and len(value) > max_chars:
            raise ValidationError(name, f"at most {max_chars} characters, got {len(value)}")
    if params.choice is not None and sum(len(c) for c in params.choice) > max_chars:
        raise ValidationError("choice", f"at most {max_chars} characters in all")


class Matcher:
    """One sequence's position in its grammar (`field`: the parameter that carries it, for errors)."""

    def __init__(self, matcher, field: str):
        self._m = matcher
        self.field = field

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True when the grammar is complete (nothing but EOS may follow). A refused token
        is a `ValidationError` naming the field: the sampler keeps to the mask, but where the constraint needs a
        byte that no token of this vocabulary writes (SmolLM2's has no 0xf1, the lead byte of U+40000-U+7FFFF),
        llguidance's mask still lets through a token it then refuses. The request alone ends."""
        if not self._m.consume_token(token):
            why = self._m.get_error().strip().splitlines()[0]
            raise ValidationError(self.field, f"the output cannot go on within the constraint with this model's "
                                              f"tokens (token {token} refused: {_short(why, 200)}); e.g. it needs a "
                                              "character that this tokenizer cannot write")
        return self._m.is_stopped()

    def replay(self, tokens: list[int]) -> None:
        """Consume a sequence's generated tokens (a matcher rebuilt for a sequence that already has output)."""
        for t in tokens:
            self.advance(t)

    @property
    def done(self) -> bool:
        return self._m.is_stopped()


class CompiledGrammar:
    """A constraint compiled for one tokenizer; `matcher()` starts a sequence on it."""

    def __init__(self, constraint: Constraint, template):
        self.constraint = constraint
        self.field = _field(constraint)
        self._template = template

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.field)


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching the last `_CACHE_SIZE` (thread-safe: the replica compiles on
    its tokenizer thread while the engine thread copies matchers). The llguidance tokenizer (about a second to
    build from a Hugging Face fast tokenizer) is made at the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self, field: str):
        if self._ll_tokenizer is None:
            import llguidance.hf

            eos = self.eos_token_ids or getattr(self.tokenizer, "eos_token_id", None)
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=eos)
            except ValueError as e:  # a slow (Python) tokenizer
                raise ValidationError(field, f"constrained decoding needs a fast (Rust) tokenizer; this model's "
                                             f"{type(self.tokenizer).__name__} is not one ({e})") from None
        return self._ll_tokenizer

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
            compiled = self._compile(constraint)
            self._cache[constraint] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, c: Constraint) -> CompiledGrammar:
        import llguidance as llg

        field = _field(c)
        tok = self._llg_tokenizer(field)
        try:
            if c.kind in ("json_schema", "json_object"):
                grammar = llg.LLMatcher.grammar_from_json_schema(c.text, defaults=JSON_DEFAULTS)
            elif c.kind == "regex":  # \d, \w, \s are ASCII (as in JSON schema patterns), the rest Rust's syntax
                grammar = llg.LLMatcher.grammar_from_lark(f"start: /{llg.regex_to_lark(c.text, 'd')}/")
            elif c.kind == "choice":
                grammar = llg.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(x, ensure_ascii=False) for x in json.loads(c.text)))
            else:
                grammar = llg.grammar_from("grammar", c.text)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise ValidationError(field, _short(str(e))) from None
        matcher = llg.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValidationError(field, _short(matcher.get_error()))
        probe = matcher.deep_copy()
        probe.compute_bitmask()  # (what may come first: nothing but the end, where no text matches)
        if probe.is_stopped() and not probe.is_accepting():
            raise ValidationError(field, "no output can match it (its language is empty)")
        return CompiledGrammar(c, matcher)


def _field(c: Constraint) -> str:
    """The generation parameter that errors about `c` name (json_object's text is a JSON schema)."""
    return "json_schema" if c.kind == "json_object" else c.kind


def _short(message: str, limit: int = 500) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + "..."


_executor = None


def fill_bitmask(matchers: list[Matcher], vocab_size: int) -> np.ndarray:
    """[len(matchers), ceil(V / 32)] int32: bit v of row i (word v // 32, bit v % 32) is set where token v may come
    next for matcher i. Several rows are computed in parallel on llguidance's threads (it drops the GIL)."""
    global _executor
    bits = np.zeros((len(matchers), (vocab_size + 31) // 32), dtype=np.int32)
    row_bytes = bits.shape[1] * 4
    if len(matchers) == 1:
        matchers[0]._m.unsafe_compute_mask_ptr(bits.ctypes.data, row_bytes)
        return bits
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)], bits.ctypes.data, row_bytes,
                                      len(matchers))
    return bits
