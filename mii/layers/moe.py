"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE): a router picks top-k gated experts per token.

Experts are stacked in two tensors so one layer holds them all: `w13` [E, 2I, H] (gate rows, then up rows) and
`w2` [E, H, I]. Tensor parallelism splits every expert's intermediate features I across ranks (like a dense
MLP), so the partial outputs are summed once at the end.

Hot path: tokens are grouped by expert with one sort; each expert then runs one matmul on its contiguous slice
(a loop over experts, never over tokens). Reading the per-expert counts is one host sync per MoE layer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mii.layers.activation import gated, get_activation
from mii.layers.linear import ReplicatedLinear, check_shape, divide
from mii.layers.mlp import MLP
from mii.parallel import all_reduce, tp_rank, tp_size

GATE, UP, DOWN = 0, 1, 2
"""Checkpoint part of an expert: `shard_id` is (expert, part)."""


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, act: str, renormalize: bool):
        super().__init__()
        self.tp_size = tp_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter = divide(intermediate, self.tp_size, "expert intermediate size")
        self.act = get_activation(act)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.inter), requires_grad=False)
        for p, parts in ((self.w13, (GATE, UP)), (self.w2, (DOWN,))):
            p.weight_loader = self.weight_loader
            p.shard_ids = {(e, part) for e in range(num_experts) for part in parts}  # what the loader expects

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, part = shard_id
        n = self.inter
        if part == DOWN:  # [H, I]: this rank's columns
            if self.tp_size > 1:
                loaded = loaded.narrow(1, tp_rank() * n, n)
            target = param.data[expert]
        else:  # [I, H]: this rank's rows, at the gate or the up offset
            if self.tp_size > 1:
                loaded = loaded.narrow(0, tp_rank() * n, n)
            target = param.data[expert].narrow(0, part * n, n)
        check_shape(target, loaded, f"expert {expert} part {part}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [T, H], router_logits: [T, E] → [T, H]."""
        T, k = x.shape[0], self.top_k
        probs = router_logits.float().softmax(dim=-1)
        weights, experts = probs.topk(k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.view(-1)                    # [T * k]
        order = flat.argsort(stable=True)          # assignments grouped by expert
        token = order // k                         # [T * k]: token of each grouped assignment
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync
        xs = x[token]                              # [T * k, H]
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = gated(self.act, F.linear(xs[start:start + n], self.w13[e]))  # [n, I]
                out[start:start + n] = F.linear(h, self.w2[e])                    # [n, H]
                start += n
        out = out * weights.view(-1)[order].unsqueeze(-1).to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, token, out)
        return all_reduce(y)


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + experts, and optionally Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, act: str, renormalize: bool,
                 shared_intermediate: int = 0):
        super().__init__()
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden, intermediate, act, renormalize)
        self.shared_expert: Optional[MLP] = None
        if shared_intermediate:
            self.shared_expert = MLP(hidden, shared_intermediate, act)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
