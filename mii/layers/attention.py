"""Paged attention over the blocked KV cache (torch backend: gather the blocks, then SDPA).

Hot path rules: the step's metadata (`AttentionContext`) is built once by the model runner with numpy and
passed in; a layer does one cache write and at most two SDPA calls (decode tokens batched together, prompt
chunks batched together), whatever the number of sequences. No host syncs, no per-sequence Python loops.

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

    token_idx: torch.Tensor    # [S, Q] long: index of each query in the flat batch (padding -> 0)
    valid: Optional[torch.Tensor]  # [S * Q] bool, or None when no padding
    block_table: torch.Tensor  # [S, max_blocks] long (padding -> block 0)
    q_pos: torch.Tensor        # [S, Q] long: position of each query (padding -> 0)
    ctx_len: torch.Tensor      # [S] long: tokens in the cache after this step
    flat_idx: torch.Tensor     # [n_valid] long: where the valid outputs go in the flat batch
    _masks: dict = field(default_factory=dict)

    def mask(self, window: Optional[int], block_size: int) -> torch.Tensor:
        """[S, 1, Q, L] bool: causal, inside the sequence's context, inside the sliding window if any."""
        m = self._masks.get(window)
        if m is None:
            L = self.block_table.shape[1] * block_size
            key = torch.arange(L, device=self.q_pos.device).view(1, 1, L)
            q = self.q_pos.unsqueeze(-1)  # [S, Q, 1]
            m = key <= q
            if window is not None:
                m &= key > q - window
            m = self._masks[window] = m.unsqueeze(1)
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
        kvh, d = self.n_kv_heads, self.head_dim
        self.k_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, k)
        self.v_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, v)
        out = q.new_empty(ctx.num_tokens, self.n_heads, d)
        for g in ctx.groups:
            S, Q = g.token_idx.shape
            qg = q[g.token_idx.view(-1)].view(S, Q, self.n_heads, d).transpose(1, 2)  # [S, h, Q, d]
            kg = self.k_cache[g.block_table].view(S, -1, kvh, d).transpose(1, 2)      # [S, kvh, L, d]
            vg = self.v_cache[g.block_table].view(S, -1, kvh, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask(self.window, ctx.block_size),
                                               scale=self.scale, enable_gqa=kvh != self.n_heads)
            o = o.transpose(1, 2).reshape(S * Q, self.n_heads, d)  # [S * Q, h, d]
            out[g.flat_idx] = o if g.valid is None else o[g.valid]
        return out.view(ctx.num_tokens, self.n_heads * d)
