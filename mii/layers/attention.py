"""Paged attention over the blocked KV cache, with two backends behind one layer:

- "kernel": `mii::paged_attention` (mii/kernels), which writes the step's K/V into their slots and reads every
  sequence's blocks in place through its block table, decode tokens and prompt chunks in one call;
- "torch": the reference: gather each group's blocks, then one SDPA per group with an additive mask.

Hot path rules: the step's metadata (`AttentionContext`) is built once by the model runner with numpy and
passed in; a layer does one kernel call (or one cache write and at most two SDPA calls), whatever the number of
sequences. No host syncs, no per-sequence Python loops.

KV cache layout, per layer: k and v each [num_blocks, kv_heads, block_size, head_dim] — head-major, so one kv
head's keys of a block are one contiguous run for the kernels to stream; slot s is row s % block_size of block
s // block_size. In the compute dtype or (on CPU, under fp32 math) bf16/fp16: keys and values are rounded as
they are written, widened as they are read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionGroup:
    """Sequences whose queries are padded to the same length (decode: 1) and attended together."""

    num_seqs: int
    q_len: int
    span: Optional[tuple]      # (start, end) in the flat batch when the group's queries are contiguous, unpadded
    token_idx: Optional[torch.Tensor]  # [S * Q] long: each query's index in the flat batch (padding -> 0), or None
    valid: Optional[torch.Tensor]      # [S * Q] bool: real (not padding) queries, or None when all are
    flat_idx: Optional[torch.Tensor]   # [n_valid] long: where the valid outputs go in the flat batch
    blocks: torch.Tensor       # [S * max_blocks] long: each sequence's block table, padded with block 0
    q_pos: torch.Tensor        # [S, Q] long: position of each query (padding -> 0)
    _masks: dict = field(default_factory=dict)

    def mask(self, window: Optional[int], block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[S, 1, Q, L] additive mask (0 / -inf): causal, inside the sliding window if any. Built once per step."""
        m = self._masks.get((window, dtype))
        if m is None:
            L = self.blocks.shape[0] // self.num_seqs * block_size
            key = torch.arange(L, device=self.q_pos.device).view(1, 1, L)
            q = self.q_pos.unsqueeze(-1)  # [S, Q, 1]
            allowed = key <= q
            if window is not None:
                allowed &= key > q - window
            m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
            m = self._masks[(window, dtype)] = m.unsqueeze(1)
        return m


@dataclass
class AttentionContext:
    """One step's attention metadata, built once by the model runner. Two views of the same batch: `groups`
    (the torch backend: padded per-group tensors) and the varlen view that kernels reading the KV blocks in
    place take (sequences in batch order, decode tokens first)."""

    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each new token
    block_size: int
    num_tokens: int
    groups: list[AttentionGroup]
    query_start: Optional[torch.Tensor] = None   # [S + 1] int32: cumulative query lengths (flat batch offsets)
    seq_lens: Optional[torch.Tensor] = None      # [S] int32: keys per sequence once this step's tokens are written
    block_tables: Optional[torch.Tensor] = None  # [S, max_blocks] int32, padded with 0
    max_query_len: int = 0
    max_seq_len: int = 0
    num_decode: int = 0                          # leading sequences with exactly one query token


def _gather(cache: torch.Tensor, blocks: torch.Tensor, S: int, dtype: torch.dtype) -> torch.Tensor:
    """Each of S sequences' blocks ([S * max_blocks] ids) as [S, kvh, max_blocks * block_size, d] in `dtype`."""
    _, kvh, bs, d = cache.shape
    g = cache.index_select(0, blocks).to(dtype)                       # [S * nb, kvh, bs, d]
    return g.view(S, -1, kvh, bs, d).transpose(1, 2).reshape(S, kvh, -1, d)


class PagedAttention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = scale
        self.window = sliding_window
        self.k_cache: Optional[torch.Tensor] = None  # bound by the model runner
        self.v_cache: Optional[torch.Tensor] = None
        self.backend = "torch"  # set by the model runner from the engine plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q: [T, h, d]; k, v: [T, kvh, d] → [T, h * d]."""
        if self.backend == "kernel":
            return torch.ops.mii.paged_attention(q, k, v, self.k_cache, self.v_cache, ctx.slot_mapping,
                                                 ctx.query_start, ctx.seq_lens, ctx.block_tables,
                                                 ctx.max_query_len, self.scale, self.window or 0)
        return self._torch(q, k, v, ctx)

    def _torch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        h, kvh, d, T = self.n_heads, self.n_kv_heads, self.head_dim, ctx.num_tokens
        cdt, bs = self.k_cache.dtype, ctx.block_size
        block, row = ctx.slot_mapping // bs, ctx.slot_mapping % bs
        self.k_cache[block, :, row] = k.to(cdt)  # [T, kvh, d]
        self.v_cache[block, :, row] = v.to(cdt)
        out = None if len(ctx.groups) == 1 and ctx.groups[0].span == (0, T) else q.new_empty(T, h, d)
        for g in ctx.groups:
            S, Q = g.num_seqs, g.q_len
            qg = q[g.span[0]: g.span[1]] if g.span else q.index_select(0, g.token_idx)
            qg = qg.view(S, Q, h, d).transpose(1, 2)                                        # [S, h, Q, d]
            kg = _gather(self.k_cache, g.blocks, S, q.dtype)  # [S, kvh, L, d]
            vg = _gather(self.v_cache, g.blocks, S, q.dtype)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask(self.window, ctx.block_size, q.dtype),
                                               scale=self.scale, enable_gqa=kvh != h)
            o = o.transpose(1, 2).reshape(S * Q, h, d)                                      # [S * Q, h, d]
            if out is None:
                return o.view(T, h * d)
            if g.span:
                out[g.span[0]: g.span[1]] = o
            else:
                out[g.flat_idx] = o if g.valid is None else o[g.valid]
        return out.view(T, h * d)
