"""One request's state as the scheduler sees it: token ids, how many are in the KV cache, its block table, and
what the prefix cache knows of it (its full blocks' content hashes)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from mii.engine.params import GenerationParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    uid: int
    prompt_ids: list[int]
    max_total: int
    """Length (prompt + generated) at which the sequence ends with finish_reason "length"."""
    params: GenerationParams = field(default_factory=GenerationParams)
    seed: int = 0
    token_ids: list[int] = field(init=False)
    num_computed: int = 0
    """Tokens whose K/V are in the cache; the scheduler catches this up with len(token_ids)."""
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    constraint: Any = None
    """The `mii.engine.constraints.Matcher` of a constrained request (it outlives preemption), else None."""
    prompt_logprobs: Optional[list] = None
    """With params.prompt_logprobs: (token id, logprob, {top id: logprob}) of prompt tokens 1.. as they are
    computed (a preempted sequence recomputes its prompt; only the entries not yet here are added)."""
    cache_salt: bytes = b""
    """Whatever besides the token ids changes the K/V of its blocks (e.g. a LoRA adapter's id): the prefix cache
    shares blocks only between sequences with the same salt."""
    block_hashes: list = field(default_factory=list)
    """Content hash of each full block of `token_ids` so far (`mii.engine.kv_cache`), computed once: tokens never
    change, so they outlive preemption."""
    num_registered: int = 0
    """Leading blocks of `block_table` already offered to the prefix cache (attached ones included)."""
    num_cached_tokens: Optional[int] = None
    """Prompt tokens found in the prefix cache when the sequence first started (None before): `cached_tokens`."""

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def max_cached_tokens(self) -> int:
        """Most leading tokens that may come from the prefix cache: all but the last (its logits give the next token),
        and with prompt logprobs none of the prompt positions not scored yet (position j's logits score token j + 1)."""
        n = self.num_tokens - 1
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt - 1:
            n = min(n, len(self.prompt_logprobs))
        return n

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache (1 for a sequence in decode)."""
        return len(self.token_ids) - self.num_computed
