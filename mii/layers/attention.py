"""Paged attention over the blocked KV cache (torch backend: gather the blocks, then SDPA).

Hot path rules: the step's metadata (`AttentionContext`) is built once by the model runner with numpy and
passed in; a layer does one cache write and at most two SDPA calls (decode tokens batched together, prompt
chunks batched together), whatever the number of sequences. No host syncs, no per-sequence Python loops.
Decode tokens lead the flat batch, so their queries and outputs are slices, not gathers.

KV cache layout, per layer: k and v each [num_blocks, block_size, kv_heads, head_dim].
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
    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each new token
    block_size: int
    num_tokens: int
    groups: list[AttentionGroup]


class PagedAttention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = scale
        self.window = sliding_window
        self.k_cache: Optional[torch.Tensor] = None  # bound by the model runner
        self.v_cache: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q: [T, h, d]; k, v: [T, kvh, d] → [T, h * d]."""
        h, kvh, d, T = self.n_heads, self.n_kv_heads, self.head_dim, ctx.num_tokens
        self.k_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, k)
        self.v_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, v)
        out = None if len(ctx.groups) == 1 and ctx.groups[0].span == (0, T) else q.new_empty(T, h, d)
        for g in ctx.groups:
            S, Q = g.num_seqs, g.q_len
            qg = q[g.span[0]: g.span[1]] if g.span else q.index_select(0, g.token_idx)
            qg = qg.view(S, Q, h, d).transpose(1, 2)                                        # [S, h, Q, d]
            kg = self.k_cache.index_select(0, g.blocks).view(S, -1, kvh, d).transpose(1, 2)  # [S, kvh, L, d]
            vg = self.v_cache.index_select(0, g.blocks).view(S, -1, kvh, d).transpose(1, 2)
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
