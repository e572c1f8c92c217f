"""Rotary position embeddings (GPT-NeoX "rotate half" layout) with Hugging Face's rope scaling types.

The cos/sin table is built once for every position; a forward indexes it with the step's positions.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from mii.errors import UnsupportedModelError


def _inv_freq(rot_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, rot_dim: int, theta: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_ctx = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (rot_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, mscale


def _longrope(rot_dim: int, theta: float, s: dict, max_pos: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Phi-3's LongRoPE ("su"): per-frequency divisors, short ones within the pretraining context, long ones
    beyond it; cos/sin scaled by sqrt(1 + ln(factor) / ln(original context))."""
    old_ctx = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / old_ctx
    mscale = s.get("attention_factor") or (math.sqrt(1 + math.log(factor) / math.log(old_ctx)) if factor > 1 else 1.0)
    base = theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)
    short = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * base)
    return short, long, mscale


class RotaryEmbedding(nn.Module):
    """cos/sin for every position. LongRoPE picks its table per position: the short factors below
    `original_max_position_embeddings`, the long ones from there on. (transformers recomputes a whole sequence
    with the long factors once it outgrows that length; a paged KV cache keeps the keys it has, so sequences
    that cross it can differ from transformers after the crossing. Sequences that stay below match exactly.)"""

    def __init__(self, head_dim: int, rot_dim: int, max_pos: int, theta: float, scaling: Optional[dict] = None):
        super().__init__()
        self.rot_dim = rot_dim
        inv_freq = _inv_freq(rot_dim, theta)
        mscale = 1.0
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, mscale = _yarn(inv_freq, rot_dim, theta, scaling, max_pos)
        elif kind in ("longrope", "su"):
            inv_freq, long_inv_freq, mscale = _longrope(rot_dim, theta, scaling, max_pos)
        elif kind != "default":
            raise UnsupportedModelError(f"unsupported rope scaling type {kind!r} "
                                        "(supported: default, linear, llama3, yarn, longrope)")
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_pos, rot_dim / 2]
        if kind in ("longrope", "su"):
            long = t >= scaling["original_max_position_embeddings"]
            freqs[long] = torch.outer(t[long], long_inv_freq)
        self.register_buffer("cos", (freqs.cos() * mscale), persistent=False)
        self.register_buffer("sin", (freqs.sin() * mscale), persistent=False)
        self._positions: Optional[torch.Tensor] = None

    fused = False  # set by the model runner where mii's kernels are (CPU or GPU): one in-place mii::rotary_ call

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, h, d], k: [T, kvh, d]; rotates the first rot_dim features of each head."""
        if self.fused:
            torch.ops.mii.rotary_(q, k, positions, self.cos, self.sin)
            return q, k
        if positions is not self._positions:  # the table lookup is done once per step, not once per layer
            self._positions = positions
            self._cos_sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, rot/2]
        cos, sin = self._cos_sin
        return _rotate(q, cos, sin, self.rot_dim), _rotate(k, cos, sin, self.rot_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    dtype = x.dtype
    full = rot_dim == x.shape[-1]
    rot = (x if full else x[..., :rot_dim]).float()
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
    return out if full else torch.cat((out, x[..., rot_dim:]), dim=-1)
