"""`Response`: one prompt's generated text and counts (MII's fields), plus optional token ids and logprobs, and its
`FinishReason`."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class FinishReason(str, enum.Enum):
    """Why a sequence ended; a `str`, so it compares equal to (and serializes as) MII's strings. (Python 3.10 has
    no `enum.StrEnum`: `__str__` and `__format__` give the value, as StrEnum's do.)"""

    STOP = "stop"
    """EOS, a stop token id or a stop string."""
    LENGTH = "length"
    """max_new_tokens, max_length, or the end of the context / KV cache."""
    NONE = "none"
    """Not finished: an intermediate stream chunk."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass
class Response:
    generated_text: str
    prompt_length: int
    generated_length: int
    finish_reason: FinishReason
    """`stop`, `length`, or `none` on intermediate stream chunks (equal to those strings)."""
    token_ids: Optional[list[int]] = field(default=None, compare=False)
    logprobs: Optional[list[dict]] = field(default=None, compare=False)
    """Per generated token: {"token_id", "logprob", "top_logprobs": {token id: logprob}}."""
    prompt_logprobs: Optional[list] = field(default=None, compare=False)
    """With prompt_logprobs=k: per prompt token, the same dicts as `logprobs` (the prompt token's logprob given the
    tokens before it, and the k most likely there); the first token's logprob is None (nothing precedes it)."""
    cached_tokens: int = field(default=0, compare=False)
    """Prompt tokens found in the engine's prefix cache (not computed again) when the sequence started."""

    def __str__(self) -> str:
        return self.generated_text

    def to_msg_dict(self) -> dict:
        return {"generated_text": self.generated_text, "prompt_length": self.prompt_length,
                "generated_length": self.generated_length, "finish_reason": str(self.finish_reason),
                "token_ids": self.token_ids, "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs,
                "cached_tokens": self.cached_tokens}
