"""Generation parameters of one request: MII's, plus ours (seed, penalties, min_p, stop ids, logprobs, n,
prompt_logprobs, logit_bias, and the output constraints of `mii.engine.constraints`).

`GenerationParams.from_kwargs` is the single place where user values are checked; the engine trusts the result.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from mii.engine.constraints import Constraint, normalize_json_schema
from mii.engine.constraints import check_fields as check_constraint_fields
from mii.errors import UnknownArgument, ValidationError

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


@dataclass(frozen=True)
class RequestBounds:
    """The most one request may ask for: every front end's limits come from here (README, "Running in
    production" → Limits). OpenAI's where it has one (n ≤ 128, logprobs ≤ 20); stop strings are matched on every
    token on the engine thread, so their number and length are bounded too (TGI allows 4 stop sequences)."""

    max_n: int = 128
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_length: int = 256
    """Characters per stop string."""
    max_stop_token_ids: int = 64
    max_constraint_chars: int = 256 * 1024
    """Characters of a json_schema, regex or grammar (or of all choice strings together)."""
    max_logit_bias: int = 1024
    """Entries of logit_bias."""


BOUNDS = RequestBounds()


@dataclass(frozen=True)
class GenerationParams:
    max_length: Optional[int] = None
    """Prompt + generated tokens (MII); the engine's default when neither this nor max_new_tokens is given."""
    max_new_tokens: Optional[int] = None
    min_new_tokens: int = 0
    """Generated tokens before EOS, stop ids or stop strings may end the sequence."""
    ignore_eos: bool = False
    return_full_text: bool = False
    do_sample: bool = True
    top_p: float = 0.9
    top_k: Optional[int] = None
    temperature: Optional[float] = None
    stop: tuple[str, ...] = ()
    seed: Optional[int] = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    """A stop string that ends the sequence is kept at the end of its text (vLLM's name), not cut from it."""
    skip_special_tokens: bool = True
    """Special tokens the model generates are left out of the text (the EOS or stop id that ends it always is)."""
    logprobs: Optional[int] = None
    """Number of top log-probabilities to return per generated token (0: only the chosen token's)."""
    n: int = 1
    prompt_logprobs: Optional[int] = None
    """Top log-probabilities to return per prompt token (0: only the prompt token's own); the first prompt token
    has none (None in its place). What scoring needs (OpenAI's echo with logprobs, lm-eval)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling; given as a dict {token id: bias in [-100, 100]}
    (OpenAI's logit_bias; ids may be strings of digits, as JSON keys are)."""
    # constraints (mii.engine.constraints): at most one
    json_schema: Optional[str] = None
    """The output is JSON valid under this schema (properties in its order); given as a dict or JSON text, kept as
    JSON text."""
    json_object: bool = False
    """The output is a JSON object (any)."""
    regex: Optional[str] = None
    """The whole output matches this regular expression (Rust regex syntax)."""
    choice: Optional[tuple[str, ...]] = None
    """The output is exactly one of these strings."""
    grammar: Optional[str] = None
    """The output follows this grammar: llama.cpp's GBNF (`root ::= ...`) or Lark (`start: ...`, llguidance's
    dialect)."""

    @property
    def constraint(self):
        """The `mii.engine.constraints.Constraint` this request carries, or None."""
        return Constraint.of(self)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, kwargs: dict, defaults: Optional[dict] = None) -> "GenerationParams":
        unknown = set(kwargs) - cls.names()
        if unknown:
            raise UnknownArgument(f"unknown generation argument(s): {', '.join(sorted(unknown))}")
        values = {**(defaults or {}), **{k: v for k, v in kwargs.items() if v is not None or k == "top_k"}}
        if "stop" in values:
            values["stop"] = _stop_strings(values["stop"])
        if "stop_token_ids" in values:
            values["stop_token_ids"] = _int_tuple("stop_token_ids", values["stop_token_ids"])
        if "logit_bias" in values:
            values["logit_bias"] = _logit_bias(values["logit_bias"])
        if "json_schema" in values:
            values["json_schema"] = normalize_json_schema(values["json_schema"])
        if isinstance(values.get("choice"), list):
            values["choice"] = tuple(values["choice"])
        if values.get("choice") is not None and not isinstance(values["choice"], tuple):
            raise ValidationError("choice", f"must be a list of strings, got {values['choice']!r:.60}")
        params = cls(**values)
        params._validate()
        return params

    def _validate(self) -> None:
        _int_field("max_new_tokens", self.max_new_tokens, low=1, optional=True)
        _int_field("max_length", self.max_length, low=1, optional=True)
        _int_field("min_new_tokens", self.min_new_tokens, low=0)
        _int_field("top_k", self.top_k, low=0, high=INT64_MAX, optional=True)
        _int_field("logprobs", self.logprobs, low=0, high=BOUNDS.max_logprobs, optional=True)
        _int_field("n", self.n, low=1, high=BOUNDS.max_n)
        _int_field("prompt_logprobs", self.prompt_logprobs, low=0, high=BOUNDS.max_logprobs, optional=True)
        check_constraint_fields(self, BOUNDS.max_constraint_chars)
        # sample j of n draws with seed + j, an int64 in the sampler
        _int_field("seed", self.seed, low=INT64_MIN, high=INT64_MAX - (self.n - 1), optional=True,
                   why=f" (sample j of n={self.n} uses seed + j, a 64-bit signed integer)" if self.n > 1 else
                   " (a 64-bit signed integer)")
        if len(self.stop) > BOUNDS.max_stop_strings:
            raise ValidationError("stop", f"at most {BOUNDS.max_stop_strings} stop strings, got {len(self.stop)}")
        long_stop = next((s for s in self.stop if len(s) > BOUNDS.max_stop_length), None)
        if long_stop is not None:
            raise ValidationError("stop", f"a stop string may have at most {BOUNDS.max_stop_length} characters, "
                                          f"got {len(long_stop)}")
        if len(self.stop_token_ids) > BOUNDS.max_stop_token_ids:
            raise ValidationError("stop_token_ids", f"at most {BOUNDS.max_stop_token_ids} ids, "
                                                    f"got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValidationError("stop_token_ids", f"token ids are >= 0, got {min(self.stop_token_ids)}")
        for name in ("ignore_eos", "return_full_text", "do_sample", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(name, f"must be a boolean, got {getattr(self, name)!r}")
        top_p = _number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValidationError("top_p", f"must be in (0, 1], got {top_p}")
        if self.temperature is not None and _number("temperature", self.temperature) < 0:
            raise ValidationError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 <= _number("min_p", self.min_p) <= 1.0:
            raise ValidationError("min_p", f"must be in [0, 1], got {self.min_p}")
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValidationError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _number(name, getattr(self, name)) <= 2.0:
                raise ValidationError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValidationError("min_new_tokens", f"{self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}")


def _int_field(name, value, low=None, high=None, optional=False, why=""):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(name, f"must be an integer, got {value!r:.60}")
    if low is not None and value < low:
        raise ValidationError(name, f"must be >= {low}, got {value}{why}")
    if high is not None and value > high:
        raise ValidationError(name, f"must be <= {high}, got {value}{why}")


def _number(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(name, f"must be a number, got {value!r:.60}")
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float
        raise ValidationError(name, f"must be a finite number, got {value}") from None
    if not math.isfinite(x):
        raise ValidationError(name, f"must be a finite number, got {x}")
    return x


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValidationError("stop", f"must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValidationError("stop", "stop strings must not be empty")
    for s in stop:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationError("stop", f"{s!r:.60} is not valid Unicode (a lone surrogate)") from None
    return tuple(stop)


def _int_tuple(name, values) -> tuple[int, ...]:
    if values is None:
        return ()
    if isinstance(values, int):
        values = [values]
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValidationError(name, f"must be a list of integers, got {values!r}")
    return tuple(values)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or strings of digits, as JSON keys are) → sorted (id, bias) pairs."""
    if bias is None:
        return ()
    if isinstance(bias, tuple):  # the stored form
        try:
            bias = dict(bias)
        except (TypeError, ValueError):
            raise ValidationError("logit_bias", f"must be an object mapping token ids to biases (per prompt: a list "
                                                f"of them), got {bias!r:.60}") from None
    if not isinstance(bias, dict):
        raise ValidationError("logit_bias", f"must be an object mapping token ids to biases, got {bias!r:.60}")
    if len(bias) > BOUNDS.max_logit_bias:
        raise ValidationError("logit_bias", f"at most {BOUNDS.max_logit_bias} entries, got {len(bias)}")
    pairs = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str):
            if not key.isascii() or not key.isdigit():
                raise ValidationError("logit_bias", f"keys are token ids, got {key!r:.60}")
            if len(key.lstrip("0")) > 18:  # (no vocabulary is that large; int() refuses 4,300+ digits)
                raise ValidationError("logit_bias", f"token id {key:.20}... ({len(key)} digits) is outside the "
                                      "vocabulary")
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValidationError("logit_bias", f"keys are token ids (integers >= 0), got {key!r:.60}")
        x = _number("logit_bias", value)
        if not -100.0 <= x <= 100.0:
            raise ValidationError("logit_bias", f"biases are in [-100, 100], got {value} for token {token}")
        pairs[token] = x
    return tuple(sorted(pairs.items()))
