"""The blocked KV cache's bookkeeping: a free list of fixed-size blocks and each sequence's block table.

Pure Python (no tensors): the model runner owns the K/V tensors and only reads the block tables built here.
Every operation validates before it mutates, so a failed call leaves the state unchanged.
"""
from __future__ import annotations

from mii.engine.sequence import Sequence
from mii.errors import KVCacheError


class BlockAllocator:
    """Hands out block ids from a free list; detects double frees and foreign ids."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise KVCacheError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._used[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks or not self._used[b]:
                raise KVCacheError(f"block {b} is not allocated")
        if len(set(blocks)) != len(blocks):
            raise KVCacheError("the same block was freed twice")
        for b in blocks:
            self._used[b] = 0
            self._free.append(b)


class KVCacheManager:
    """Grows and releases sequences' block tables on top of a `BlockAllocator`."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise KVCacheError(f"kv_block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    @property
    def usage(self) -> float:
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
        self.allocator.free(seq.block_table)
        seq.block_table = []
