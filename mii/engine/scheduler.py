"""Dynamic SplitFuse scheduling: which tokens of which sequences go into the next forward pass.

One rule drives everything: each sequence's computed tokens catch up with its tokens, under a per-step token
budget (`max_ragged_batch_size`) and sequence cap (`max_ragged_sequence_count`). Running sequences in decode
(one pending token) are scheduled first, then prompt chunks, first come first served; a long prompt is split
across steps, and a token is sampled only when a sequence's chunk reaches its last token. When KV blocks run
out, the newest running sequence is preempted: its blocks are freed and it is recomputed later from prompt +
generated tokens. With prefix caching, a sequence starts (or starts again) on the cached blocks of its prefix
(`KVCacheManager.cached_prefix`), and only the tokens it still computes count against the budget and the blocks.
With `itl_target_ms` the engine also caps the prompt tokens of a step that carries decode tokens (`prompt_cap`,
from `mii.engine.pacing`). Pure Python, tested without a model.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from mii.engine.kv_cache import KVCacheManager
from mii.engine.sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int
    """Position of the chunk's first token (== seq.num_computed when scheduled)."""
    length: int
    samples: bool
    """A token is sampled after this chunk only when it reaches the sequence's last token."""


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch_tokens: int, max_batch_seqs: int):
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def num_queued(self, new: Iterable[Sequence] = ()) -> int:
        """Sequences that would wait for room if the not yet added `new` arrived now: in arrival order, each
        waiting sequence (then each new one) takes a free running slot and the KV blocks it needs (those of its
        tokens less its cached prefix, `KVCacheManager.blocks_to_start`); from the first that finds no room on,
        they queue. What admission bounds: a burst into an idle engine is about to run, not waiting, even before
        the step that starts it."""
        slots = self.max_batch_seqs - len(self.running)
        free = self.kv.allocator.num_free
        queued = 0
        for seq in itertools.chain(self.waiting, new):
            need = self.kv.blocks_to_start(seq)
            if queued or slots == 0 or need > free:
                queued += 1
            else:
                slots, free = slots - 1, free - need
        return queued

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        if seq.block_table:
            self.kv.release(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def decoding(self) -> list[Sequence]:
        """Running sequences in decode (one pending token), in the order `schedule` takes them."""
        return [s for s in self.running if s.num_pending == 1]

    def has_prompts(self) -> bool:
        """Whether a sequence waits to start or is part-way through its prompt."""
        return bool(self.waiting) or any(s.num_pending > 1 for s in self.running)

    def schedule(self, prompt_cap: int | None = None) -> ScheduledBatch:
        """The next step's chunks; with `prompt_cap`, its prompt chunks carry at most that many tokens when the step
        has decode tokens (`mii.engine.pacing`)."""
        batch = ScheduledBatch()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()

        # 1. decode tokens first, one per running sequence; preempt the newest when blocks run out
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.num_pending != 1:
                continue
            if budget == 0 or len(batch.chunks) == self.max_batch_seqs:
                break
            while not self.kv.grow(seq, 1):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                batch.chunks.append(ScheduledChunk(seq, seq.num_computed, 1, True))
                scheduled.add(id(seq))
                budget -= 1

        # 2. prompt chunks: running sequences part-way through their prompt, then waiting ones in order
        # (a sequence preempted in this step waits for the next one, so it does not take back what it freed)
        if prompt_cap is not None and batch.chunks:
            budget = min(budget, prompt_cap)
        candidates = [s for s in self.running if s.num_pending > 1] + [
            s for s in self.waiting if not any(s is p for p in batch.preempted)]
        for seq in candidates:
            if budget == 0 or len(batch.chunks) == self.max_batch_seqs:
                break
            if seq.status is SeqStatus.WAITING:  # it starts on the cached blocks of its prefix, if any
                cached = self.kv.cached_prefix(seq)
                room = self.kv.room_after(cached)
                length = min(seq.num_tokens - len(cached) * self.kv.block_size, budget, room)
                if length <= 0:
                    break  # out of blocks: later sequences wait (first come, first served)
                self.kv.start(seq, cached)
            else:
                length = min(seq.num_pending, budget, self.kv.max_new_tokens_fitting(seq))
                if length <= 0:
                    break
            self.kv.grow(seq, length)
            if seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            batch.chunks.append(ScheduledChunk(seq, seq.num_computed, length, length == seq.num_pending))
            scheduled.add(id(seq))
            budget -= length

        # 3. nothing fits while sequences hold blocks mid-prompt: free the newest one so the rest can progress
        if not batch.chunks and self.running:
            self._preempt(self.running[-1], batch)
            retry = self.schedule(prompt_cap)
            retry.preempted[:0] = batch.preempted
            return retry
        return batch

    def update(self, batch: ScheduledBatch, sampled: dict[int, int]) -> None:
        """Advance computed counts after a forward pass and append each sampled token (keyed by seq uid)."""
        for chunk in batch.chunks:
            chunk.seq.num_computed += chunk.length
            self.kv.commit(chunk.seq)  # its blocks now complete join the prefix cache
            token = sampled.get(chunk.seq.uid)
            if token is not None:
                chunk.seq.token_ids.append(token)
