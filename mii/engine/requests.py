"""The input side of the one request path: prompts + generation keyword arguments → validated `EngineRequest`s.

Every front end goes through `InputProcessor.process` exactly once: `mii.pipeline` in its own process, and the
replica for every gRPC request (from `mii.client`, MII's own client, the MII REST route and the OpenAI API, which
only translate their fields to generation keyword arguments). Here prompts are checked and tokenized, parameters
validated (`GenerationParams.from_kwargs`, one per prompt), constraints compiled (`mii.engine.constraints`: a bad
schema or grammar is refused here), length limits resolved, the `return_full_text` prefix
made and `n` expanded into sequences (sample j of a seeded prompt gets `seed + j`); the engine trusts the result.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from mii.engine.constraints import CompiledGrammar, GrammarCompiler
from mii.engine.params import GenerationParams
from mii.errors import PromptTooLongError, ValidationError

Prompt = Union[str, list[int]]
_LIST_VALUED = {"stop", "stop_token_ids", "choice"}  # parameters whose single value is already a list


def _is_token_ids(p) -> bool:
    return isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def encode_prompt(tokenizer, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids: the one tokenization point of every request (and of the gateway's /tokenize).
    `add_special_tokens=False` for text that a chat template rendered (its special tokens are in it)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return list(prompt)


def chat_messages(messages) -> list[dict]:
    """Chat messages as a chat template takes them: {role, content} dicts whose content is a string, None or text
    parts (joined into one string; "" for None). A `ValidationError` naming the message for anything else, and for
    a chat with nothing to say (no message, or every content empty or whitespace). The pipeline's
    `apply_chat_template` and the chat routes check them here."""
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages", "a non-empty list of {role, content} objects is required")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValidationError(f"messages[{i}]", "must be an object with a role")
        if not m["role"].strip():  # (other roles than OpenAI's go to the template, as vLLM passes them)
            raise ValidationError(f"messages[{i}].role", "must not be empty")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("type") == "text" and not isinstance(p.get("text"), str):
                    got = type(p.get("text")).__name__ if "text" in p else "nothing"
                    raise ValidationError(f"messages[{i}].content[{j}].text", f"must be a string (got {got})")
                if not isinstance(p, dict) or p.get("type") != "text":
                    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                    raise ValidationError(f"messages[{i}].content",
                                          f"only text parts are supported (content[{j}] is {kind!r:.40})")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise ValidationError(f"messages[{i}].content", "must be a string or a list of text parts")
        check_text(f"messages[{i}].content", content or "")
        flat.append({**m, "content": content or ""})
    if not any(m["content"].strip() for m in flat):
        raise ValidationError("messages", "every message is empty (nothing to answer)")
    return flat


def check_text(field: str, text: str) -> None:
    """Text must be valid Unicode: JSON may carry a lone surrogate (an escaped \\ud800) that no tokenizer
    encodes and no wire format carries."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValidationError(field, f"is not valid Unicode: {text[e.start:e.end]!r} at character {e.start} (a lone "
                                     "surrogate)") from None


def normalize_prompts(prompts) -> tuple[list[Prompt], bool]:
    """(prompts as a list, whether a single prompt was given). A flat list of ints is one token-id prompt."""
    if isinstance(prompts, str):
        if not prompts:
            raise ValidationError("prompts", "the prompt is empty")
        check_text("prompts", prompts)
        return [prompts], True
    if isinstance(prompts, (list, tuple)) and prompts and _is_token_ids(prompts):
        return [list(prompts)], True
    if not isinstance(prompts, (list, tuple)):
        raise ValidationError("prompts", "must be a string, a list of strings or token-id lists, "
                                         f"got {type(prompts).__name__}")
    if not prompts:
        raise ValidationError("prompts", "the prompt list is empty")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or _is_token_ids(p)):
            raise ValidationError(f"prompts[{i}]", f"must be a string or a list of token ids, got {p!r:.60}")
        if len(p) == 0:
            raise ValidationError(f"prompts[{i}]", "the prompt is empty")
        if isinstance(p, str):
            check_text(f"prompts[{i}]", p)
    return [p if isinstance(p, str) else list(p) for p in prompts], False


def per_prompt_params(kwargs: dict, n: int, defaults: Optional[dict] = None) -> list[GenerationParams]:
    """One `GenerationParams` per prompt; a list value gives one value per prompt (vLLM-style). Unknown names are
    left whole, for `GenerationParams.from_kwargs` to refuse."""
    names = GenerationParams.names()
    split = {}
    for k, v in kwargs.items():
        per_prompt = k in names and isinstance(v, (list, tuple)) and (
            k not in _LIST_VALUED or (v and all(isinstance(x, (list, tuple)) or x is None for x in v)))
        if per_prompt:
            if len(v) != n:
                raise ValidationError(k, f"has {len(v)} values for {n} prompts")
            split[k] = list(v)
    return [GenerationParams.from_kwargs({k: (split[k][i] if k in split else v) for k, v in kwargs.items()}, defaults)
            for i in range(n)]


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can take: read once from it, applied to every request before it is admitted."""

    max_context: int
    """Longest sequence (prompt + generated) the engine runs."""
    default_max_length: int
    """Sequence length of a request that gives neither max_length nor max_new_tokens (MII's default, 1024)."""
    kv_capacity_tokens: int
    """Tokens the whole KV cache holds: a longer sequence could never run."""
    vocab_size: int
    max_sequences: Optional[int] = None
    """Most sequences the engine holds at once (`max_tracked_sequences`): a call with more could never run."""

    def length_limit(self, prompt_len: int, p: GenerationParams) -> int:
        """The sequence length at which the request ends with "length"; a typed error when it cannot run.

        An explicit `max_new_tokens` or `max_length` beyond the context is an error (OpenAI's and vLLM's rule),
        never a silently shorter answer; without either, the answer may use the rest of the context, up to the
        engine's default length."""
        ctx, kv = self.max_context, self.kv_capacity_tokens
        if prompt_len >= ctx:
            raise PromptTooLongError(prompt_len, ctx)
        if prompt_len >= kv:
            raise ValidationError("prompt", f"the prompt has {prompt_len} tokens, but the KV cache of this engine "
                                            f"holds only {kv}: it can never run here (give the engine more KV "
                                            "cache memory)")
        if p.max_length is not None and prompt_len >= p.max_length:
            raise ValidationError("max_length", f"{p.max_length} leaves no room after a {prompt_len}-token prompt")
        if p.max_new_tokens is not None or p.max_length is not None:
            asked = min(x for x in (p.max_length, None if p.max_new_tokens is None else prompt_len + p.max_new_tokens)
                        if x is not None)
            field = "max_new_tokens" if asked != p.max_length else "max_length"
            if asked > ctx:
                raise PromptTooLongError(prompt_len, ctx, asked - prompt_len)
            if asked > kv:
                raise ValidationError(field, f"the prompt ({prompt_len} tokens) and the completion "
                                             f"({asked - prompt_len}) need {asked} tokens, but the KV cache of this "
                                             f"engine holds only {kv}")
            limit = asked
        else:
            limit = min(max(self.default_max_length, prompt_len + 1), ctx, kv)
        if p.min_new_tokens > limit - prompt_len:  # (EOS and stop ids are banned until then: it would run to the end)
            raise ValidationError("min_new_tokens", f"{p.min_new_tokens} exceeds the {limit - prompt_len} tokens this "
                                                    f"request may generate after its {prompt_len}-token prompt")
        return limit


@dataclass(frozen=True)
class EngineRequest:
    """One sequence, validated: what `Engine.add_requests` admits and the output side assembles."""

    prompt_ids: list[int]
    params: GenerationParams
    max_total: int
    """Length (prompt + generated) at which the sequence ends with finish_reason "length"."""
    prefix: str = ""
    """Text put before the generated text (the prompt, with return_full_text=True)."""
    grammar: Optional[CompiledGrammar] = None
    """The compiled constraint of `params` (json_schema, regex, ...), if it has one."""


class InputProcessor:
    """Turns one call's prompts and generation keyword arguments into `EngineRequest`s, all validated before any is
    returned (so a bad prompt or value queues nothing)."""

    def __init__(self, tokenizer, limits: RequestLimits, grammars: Optional[GrammarCompiler] = None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammars = grammars or GrammarCompiler(tokenizer, limits.vocab_size)

    def process(self, prompts, kwargs: dict, add_special_tokens: bool = True) -> tuple[list[EngineRequest], bool]:
        """(one request per sequence, prompts × n in prompt order; whether a single prompt was given).
        `add_special_tokens=False` for text that a chat template rendered."""
        plist, single = normalize_prompts(prompts)
        params = per_prompt_params(kwargs, len(plist))
        total = sum(p.n for p in params)
        if self.limits.max_sequences is not None and total > self.limits.max_sequences:
            raise ValidationError("prompts", f"{len(plist)} prompt(s) × n make {total} sequences; this engine holds "
                                             f"at most {self.limits.max_sequences} at once (max_tracked_sequences)")
        out = []
        for i, (prompt, p) in enumerate(zip(plist, params)):
            ids = encode_prompt(self.tokenizer, prompt, add_special_tokens)
            if not ids:
                raise ValidationError(f"prompts[{i}]", "the prompt encodes to no tokens")
            vocab = self.limits.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValidationError("prompts" if single else f"prompts[{i}]",
                                      f"token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
            for name, tokens in (("stop_token_ids", p.stop_token_ids), ("logit_bias", [t for t, _ in p.logit_bias])):
                bad = next((t for t in tokens if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ValidationError(name, f"token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
            constraint = p.constraint
            grammar = self.grammars.compile(constraint) if constraint is not None else None
            max_total = self.limits.length_limit(len(ids), p)
            prefix = ""
            if p.return_full_text:
                prefix = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=True)
            for j in range(p.n):
                pj = p if p.n == 1 or p.seed is None else dataclasses.replace(p, seed=p.seed + j)
                out.append(EngineRequest(ids, pj, max_total, prefix, grammar))
        return out, single
