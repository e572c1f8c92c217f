"""`Response`: one prompt's generated text and counts (MII's fields), plus optional token ids and logprobs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Response:
    generated_text: str
    prompt_length: int
    generated_length: int
    finish_reason: str
    """"stop" (EOS, a stop id or a stop string), "length", or "none" on intermediate stream chunks."""
    token_ids: Optional[list[int]] = field(default=None, compare=False)
    logprobs: Optional[list[dict]] = field(default=None, compare=False)
    """Per generated token: {"token_id", "logprob", "top_logprobs": {token id: logprob}}."""

    def __str__(self) -> str:
        return self.generated_text

    def to_msg_dict(self) -> dict:
        return {"generated_text": self.generated_text, "prompt_length": self.prompt_length,
                "generated_length": self.generated_length, "finish_reason": self.finish_reason,
                "token_ids": self.token_ids, "logprobs": self.logprobs}
