"""The blocked KV cache's bookkeeping: fixed-size blocks, each sequence's block table, and the prefix cache.

Pure Python (no tensors): the model runner owns the K/V tensors and only reads the block tables built here.
Every operation validates before it mutates, so a failed call leaves the state unchanged.

Automatic prefix caching: each full block of a sequence is named by a hash chained from its parent block's hash
and its token ids (the first block's parent is the sequence's `cache_salt`, for whatever else would change the
K/V, e.g. a LoRA adapter). Once a full block's K/V are computed it is registered under that hash. A sequence that
starts (or starts again after preemption) attaches the longest run of its leading full blocks found in the cache,
reference counted and shared, and computes only the rest: at least one token, so that its next token has logits.
Only full blocks are shared and a sequence writes only at positions >= its `num_computed`, past every full block
it holds, so a shared block is never written. A block that nobody references keeps its content and its hash: it
joins an LRU pool that the allocator takes from (forgetting the hash) when the free list is empty, or when the
free list's next block has never been used and its memory is not yet faulted in (CPU caches; see BlockAllocator).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable, Optional

from mii.engine.sequence import Sequence
from mii.errors import KVCacheError


def block_hash(parent: bytes, tokens) -> bytes:
    """The content hash of a full block: sha256 of its parent's hash and its token ids (collision-resistant, so
    one request cannot craft a prompt that reads another's cached K/V)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_hash(salt: bytes) -> bytes:
    """The parent of a sequence's first block."""
    return hashlib.sha256(b"mii-prefix-cache\0" + salt).digest()


class BlockAllocator:
    """Hands out block ids and counts who references each. A block is in exactly one of three states: free (on
    the free list, no content), referenced (ref count > 0, by running sequences) or idle (ref count 0, its content
    cached under its hash, in the LRU pool). Detects double frees and foreign ids.

    `resident`: where the cache's memory is faulted in lazily (a CPU cache, `kv_memory`), a function giving the
    number of low blocks whose pages are in place; then an idle block is reused before a free block whose memory
    was never used, since a first touch costs page faults inside a step (about 150 MB/s on some virtual machines)
    and prefix caching would otherwise keep moving to new memory. The cache's full capacity comes as its memory
    is faulted in (in the engine's idle time). None: all memory in place, idle blocks only when the list is empty."""

    def __init__(self, num_blocks: int, resident: Optional[Callable[[], int]] = None):
        if num_blocks < 1:
            raise KVCacheError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._ref = [0] * num_blocks
        self._hash: list[Optional[bytes]] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # content hash -> block (referenced or idle)
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references, least recent first
        self.num_evictions = 0
        """Idle cached blocks taken back for new content."""
        self._resident = resident
        self._used = 0  # blocks below this id have been handed out before (the free list gives low ids first)

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: the free list and the idle cached blocks."""
        return len(self._free) + len(self._idle)

    def num_reusable(self) -> int:
        """Blocks `allocate` can hand out without touching memory never used: the idle cached blocks, the free
        blocks used before, and those whose pages `resident` says are in place (KVPrefault's `spare`)."""
        in_place = self.num_blocks if self._resident is None else max(self._used, min(self.num_blocks, self._resident()))
        return len(self._idle) + len(self._free) - (self.num_blocks - in_place)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is registered (referenced or idle)."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def state(self) -> tuple[list[int], list[int], list[int], dict[bytes, int]]:
        """(ref counts, free list, idle pool from least recently used, hash -> block): copies, for tests."""
        return list(self._ref), list(self._free), list(self._idle), dict(self._cached)

    def allocate(self, n: int) -> list[int]:
        """`n` blocks, each referenced once: from the free list, then by evicting the least recently used idle
        cached blocks (before the free list where its next block's memory is untouched: see `resident`)."""
        if n > self.num_free:
            raise KVCacheError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free and not (self._idle and self._untouched(self._free[-1])):
                b = self._free.pop()
            else:
                b, _ = self._idle.popitem(last=False)
                del self._cached[self._hash[b]]
                self._hash[b] = None
                self.num_evictions += 1
            self._ref[b] = 1
            self._used = max(self._used, b + 1)
            blocks.append(b)
        return blocks

    def _untouched(self, block: int) -> bool:
        return self._resident is not None and block >= max(self._used, self._resident())

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks` (a sequence's table, in order). A block nobody references goes
        back to the free list, or, if its content is cached, to the idle pool: the last blocks of the table first,
        so that a chain's tail is evicted before its head."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or not self._ref[b]:
                raise KVCacheError(f"block {b} is not allocated")
        if len(set(blocks)) != len(blocks):
            raise KVCacheError("the same block was freed twice")
        for b in reversed(blocks):
            self._ref[b] -= 1
            if not self._ref[b]:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._idle[b] = None

    def lookup(self, h: bytes) -> Optional[int]:
        """The block cached under content hash `h`, if any."""
        return self._cached.get(h)

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def share(self, blocks: list[int]) -> None:
        """Add a reference to each of `blocks` (cached ones, from `lookup`); idle ones leave the pool."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._hash[b] is None:
                raise KVCacheError(f"block {b} is not in the prefix cache")
        for b in blocks:
            if not self._ref[b]:
                del self._idle[b]
            self._ref[b] += 1

    def register(self, block: int, h: bytes) -> bool:
        """Cache a referenced block's (now complete) content under `h`. False, and the block stays private, when
        another block already holds that content (two sequences computed the same prefix at once)."""
        if not 0 <= block < self.num_blocks or not self._ref[block]:
            raise KVCacheError(f"block {block} is not allocated")
        if self._hash[block] is not None:
            raise KVCacheError(f"block {block} is already in the prefix cache")
        if h in self._cached:
            return False
        self._hash[block] = h
        self._cached[h] = block
        return True


class KVCacheManager:
    """Grows and releases sequences' block tables on top of a `BlockAllocator`; with `prefix_caching`, starts
    sequences on the cached blocks of their prefix and registers the blocks they complete."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 resident: Optional[Callable[[], int]] = None):
        if block_size < 1:
            raise KVCacheError(f"kv_block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, resident)
        self.prefix_caching = prefix_caching
        self.queried_tokens = 0
        """Tokens of the sequences that looked up their prefix (each start, restarts after preemption too)."""
        self.hit_tokens = 0
        """Of those, the tokens found in the cache (not computed)."""

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of the blocks referenced by sequences (idle cached blocks count as free)."""
        return 1.0 - self.allocator.num_free / self.allocator.num_blocks

    def blocks_for(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` must still get to hold `num_new` more computed tokens."""
        need = -(-(seq.num_computed + num_new) // self.block_size)
        return max(0, need - len(seq.block_table))

    def max_new_tokens_fitting(self, seq: Sequence) -> int:
        """How many more tokens `seq` could compute with the blocks it holds plus every free one."""
        return (len(seq.block_table) + self.allocator.num_free) * self.block_size - seq.num_computed

    def grow(self, seq: Sequence, num_new: int) -> bool:
        """Give `seq` room for `num_new` more tokens; False (and nothing changed) when the pool is short."""
        n = self.blocks_for(seq, num_new)
        if n > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate(n))
        return True

    def release(self, seq: Sequence) -> None:
        """A sequence finishes or is preempted: its references go (its cached blocks stay cached)."""
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_registered = 0

    # --- prefix caching ------------------------------------------------------------------------------------------

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """The content hashes of `seq`'s first `n` full blocks (extending `seq.block_hashes`)."""
        hashes, bs = seq.block_hashes, self.block_size
        parent = hashes[-1] if hashes else root_hash(seq.cache_salt)
        for i in range(len(hashes), n):
            parent = block_hash(parent, seq.token_ids[i * bs: (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of the longest run of a not yet started `seq`'s leading full blocks (up to
        `seq.max_cached_tokens`); nothing changes until `start` takes them."""
        if not self.prefix_caching or seq.block_table:
            return []
        hashes = self._hashes(seq, max(0, seq.max_cached_tokens) // self.block_size)
        blocks = []
        for h in hashes:
            b = self.allocator.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def room_after(self, cached: list[int]) -> int:
        """Tokens a sequence starting on `cached` (from `cached_prefix`) could compute past them: idle ones among
        them leave the free pool."""
        return (self.allocator.num_free - sum(map(self.allocator.is_idle, cached))) * self.block_size

    def blocks_to_start(self, seq: Sequence) -> int:
        """Blocks of the free pool a not yet started `seq` takes to hold all its tokens: new ones past its cached
        prefix, and the idle ones of that prefix."""
        cached = self.cached_prefix(seq)
        total = -(-seq.num_tokens // self.block_size)
        return total - len(cached) + sum(map(self.allocator.is_idle, cached))

    def start(self, seq: Sequence, cached: list[int]) -> None:
        """Start `seq` (no blocks, nothing computed) on `cached` (from `cached_prefix`): shared, read-only; its
        computing starts after them."""
        if seq.block_table or seq.num_computed:
            raise KVCacheError(f"sequence {seq.uid} has already started")
        self.allocator.share(cached)
        seq.block_table = list(cached)
        seq.num_registered = len(cached)
        seq.num_computed = len(cached) * self.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(seq.num_computed, seq.num_prompt)
        if self.prefix_caching:
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """After a forward pass: register the full blocks of `seq` whose K/V are now all computed."""
        full = seq.num_computed // self.block_size
        if not self.prefix_caching or full <= seq.num_registered:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered, full):
            self.allocator.register(seq.block_table[i], hashes[i])
        seq.num_registered = full
