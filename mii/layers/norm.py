"""RMSNorm and LayerNorm, each able to fold the residual add into the same call."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + weight), computed in float32 as Hugging Face does. Gemma uses offset 1.
    With `fused` (set by the model runner where mii's kernels are: C++ on CPU, Triton on a GPU), one `mii::rms_norm`
    call."""

    fused = False

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.fused:
            shape = x.shape
            y, new_residual = torch.ops.mii.rms_norm(x.reshape(-1, shape[-1]), residual, self.weight, self.eps,
                                                     self.offset)
            return y.view(shape) if residual is None else (y.view(shape), new_residual)
        if residual is not None:
            x = residual = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float() + self.offset if self.offset else self.weight
        y = (h * w).to(dtype) if self.offset else h.to(dtype) * w
        return y if residual is None else (y, residual)


class LayerNorm(nn.LayerNorm):
    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__(dim, eps=eps, bias=bias)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = residual = x + residual
        y = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return y if residual is None else (y, residual)


def build_norm(kind: str, dim: int, eps: float, offset: float = 0.0) -> nn.Module:
    """"rms" → RMSNorm (scale offset + weight), "layer" → LayerNorm with bias."""
    if kind == "rms":
        return RMSNorm(dim, eps, offset)
    if kind == "layer":
        return LayerNorm(dim, eps)
    raise ValueError(f"unknown norm kind {kind!r} (expected 'rms' or 'layer')")
