"""The dense feed-forward block: gated (Llama: down(act(gate(x)) * up(x))) or plain (fc2(act(fc1(x)))).

Column-parallel in, row-parallel out, so each rank holds a slice of the intermediate features.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mii.layers.activation import gated, get_activation
from mii.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False, gated_mlp: bool = True):
        super().__init__()
        self.gated = gated_mlp
        if gated_mlp:
            self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias)
            self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        else:
            self.fc1 = ColumnParallelLinear(hidden, intermediate, bias=bias)
            self.fc2 = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act = get_activation(act)

    fused = False  # set by the model runner where mii's kernels are (CPU or GPU; silu only: mii::silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            if self.fused and self.act is F.silu:
                return self.down_proj(torch.ops.mii.silu_and_mul(self.gate_up_proj(x)))
            return self.down_proj(gated(self.act, self.gate_up_proj(x)))
        return self.fc2(self.act(self.fc1(x)))
