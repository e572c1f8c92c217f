"""Weight-only quantized linears: int8 (symmetric) and int4 (scale + offset), group-wise, in the blocked layouts
that `mii::linear_quant` streams.

Both layouts keep a pair of output rows together, group after group, so that a matrix is one sequential stream
and one pass over the input row serves two output rows. A group is `G` consecutive input features of one row
(G a multiple of 32 that divides K; G = K is per-channel) with its own fp16 scale (and, for int4, offset):

- **int4** — `torch.uint8 [N/2, K/G, 8 + G]`: per row pair and group, 8 bytes of fp16 `[s_a, s_b, m_a, m_b]`
  then G/32 chunks of 32 bytes (16 for row a, 16 for row b). Weight = s * q + m with q in 0..15, so GGUF's
  Q4_1 (d, m) and Q4_0 (d, -8d) map exactly. A row's 16 bytes hold its chunk's 32 columns as GGUF does: byte b
  is column b (low nibble) and column b + 16 (high nibble).
- **int8** — `torch.int8 [N/2, K/G, 8 + 2G]`: per row pair and group, 8 bytes (fp16 `[s_a, s_b]`, 4 zero bytes)
  then row a's G values and row b's G values. Weight = s * q, so GGUF's Q8_0 (G = 32) maps exactly.

`quant_linear` runs the C++ kernel when mii's CPU kernels are built, else the reference (dequantize, then
`F.linear`), which is also what the tests compare the kernel with. With `act8` (`quantize_activations`), an int4
linear's input is first rounded to int8 per 32 columns (`round_activations_int8`, the kernel's arithmetic).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mii import kernels
from mii.errors import ModelLoadError

INT4, INT8 = "int4", "int8"


def scheme(w: torch.Tensor) -> Optional[str]:
    """"int4" / "int8" for a packed quantized weight, None for a plain one."""
    if w.dim() != 3:
        return None
    return INT4 if w.dtype == torch.uint8 else INT8 if w.dtype == torch.int8 else None


def group_size(w: torch.Tensor) -> int:
    return w.shape[2] - 8 if w.dtype == torch.uint8 else (w.shape[2] - 8) // 2


def out_features(w: torch.Tensor) -> int:
    return w.shape[0] * 2


def in_features(w: torch.Tensor) -> int:
    return w.shape[1] * group_size(w)


def check_layout(n: int, k: int, group: int) -> None:
    if n % 2 or group % 32 or k % group:
        raise ModelLoadError(f"cannot quantize a [{n}, {k}] weight in groups of {group}: the rows must be even in "
                             f"number and the group a multiple of 32 that divides {k}")


def _fp16(t: torch.Tensor) -> torch.Tensor:
    """fp16 scales/offsets as raw bytes [..., 2]."""
    return t.to(torch.float16).contiguous().view(torch.uint8).view(*t.shape, 2)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """q [N, K] (values 0..15), scale and offset [N, K/G] (weight = scale * q + offset) → the int4 layout."""
    n, k = q.shape
    groups = scale.shape[1]
    g = k // groups
    check_layout(n, k, g)
    if q.min() < 0 or q.max() > 15:
        raise ValueError("int4 values must be in 0..15")
    c = q.to(torch.uint8).view(n, k // 32, 2, 16)  # a chunk's columns 0-15 (low nibbles) and 16-31 (high)
    data = (c[:, :, 0] | (c[:, :, 1] << 4)).view(n // 2, 2, groups, g // 32, 16)
    data = data.permute(0, 2, 3, 1, 4).reshape(n // 2, groups, g)  # per chunk: row a's 16 bytes, row b's
    so = torch.stack([_fp16(scale).view(n // 2, 2, groups, 2), _fp16(offset).view(n // 2, 2, groups, 2)], 1)
    head = so.permute(0, 3, 1, 2, 4).reshape(n // 2, groups, 8)  # [s_a, s_b, m_a, m_b]
    return torch.cat([head, data], 2).contiguous()


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8, scale [N, K/G] (weight = scale * q) → the int8 layout."""
    n, k = q.shape
    groups = scale.shape[1]
    g = k // groups
    check_layout(n, k, g)
    head = torch.zeros(n // 2, groups, 8, dtype=torch.uint8)
    head[..., :4] = _fp16(scale).view(n // 2, 2, groups, 2).transpose(1, 2).reshape(n // 2, groups, 4)
    data = q.to(torch.int8).view(n // 2, 2, groups, g).transpose(1, 2).reshape(n // 2, groups, 2 * g)
    return torch.cat([head.view(torch.int8), data], 2).contiguous()


def unpack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The packed weight's (q [N, K], scale [N, K/G] fp32, offset [N, K/G] fp32 or None for int8)."""
    pairs, groups, _ = w.shape
    g, n = group_size(w), pairs * 2
    raw = w.view(torch.uint8)
    if scheme(w) == INT4:
        head = raw[..., :8].contiguous().view(torch.float16).float()  # [pairs, groups, 4]
        scale = head[..., :2].permute(0, 2, 1).reshape(n, groups)
        offset = head[..., 2:].permute(0, 2, 1).reshape(n, groups)
        data = raw[..., 8:].reshape(pairs, groups, g // 32, 2, 16)  # [.., row of the pair, byte]
        nib = torch.stack([data & 15, data >> 4], -2)  # [.., row, low/high, byte] = column 16 * high + byte
        q = nib.permute(0, 3, 1, 2, 4, 5).reshape(n, groups * g)
        return q, scale, offset
    head = raw[..., :4].contiguous().view(torch.float16).float()  # [pairs, groups, 2]
    scale = head.permute(0, 2, 1).reshape(n, groups)
    q = w[..., 8:].view(pairs, groups, 2, g).transpose(1, 2).reshape(n, groups * g)
    return q, scale, None


def dequantize(w: torch.Tensor) -> torch.Tensor:
    """The packed weight as float32 [N, K]."""
    q, scale, offset = unpack(w)
    g = group_size(w)
    out = q.float().view(q.shape[0], -1, g) * scale.unsqueeze(-1)
    if offset is not None:
        out = out + offset.unsqueeze(-1)
    return out.view(q.shape)


def rows_op(device: torch.device) -> Callable:
    """What `dequantize_rows` calls for a weight on `device`, (w, ids, dtype) → rows: `mii::quant_rows` on CPU once
    mii's CPU kernels are loaded (the same arithmetic and rounding), else the reference. Bound once by the embedding
    (`VocabParallelEmbedding.bound`), where each Python call of a decode step costs microseconds."""
    if device.type == "cpu" and kernels.cpu_op("quant_rows"):
        return torch.ops.mii.quant_rows.default
    return _rows_reference


def _rows_reference(w: torch.Tensor, ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    rows = dequantize_rows_reference(w, ids)
    return rows if dtype is None else rows.to(dtype)


def dequantize_rows(w: torch.Tensor, ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rows `ids` of a packed weight as float32 ([*ids.shape, K]), or cast to `dtype`: the embedding lookup of a tied
    LM head."""
    return rows_op(w.device)(w, ids, dtype)


def dequantize_rows_reference(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1)
    pairs = w[flat // 2]  # [T, groups, bytes]
    rows = dequantize(pairs).view(-1, 2, in_features(w))
    return rows[torch.arange(flat.numel()), flat % 2].view(*ids.shape, -1)


def quantize_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """Asymmetric int4 of a float [N, K] weight in groups of `group` columns: offset = the group's minimum,
    scale = its range / 15 (both rounded to fp16 first, so that q is chosen against the values kept)."""
    n, k = w.shape
    check_layout(n, k, group)
    x = w.float().view(n, k // group, group)
    lo, hi = x.amin(-1), x.amax(-1)
    scale = ((hi - lo) / 15).to(torch.float16).float()
    offset = lo.to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x - offset.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, 15)
    return pack_int4(q.view(n, k), scale, offset)


def quantize_int8(w: torch.Tensor, group: Optional[int] = None) -> torch.Tensor:
    """Symmetric int8 of a float [N, K] weight, per output channel (`group` None) or in groups of columns."""
    n, k = w.shape
    group = group or k
    check_layout(n, k, group)
    x = w.float().view(n, k // group, group)
    scale = (x.abs().amax(-1) / 127).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe.unsqueeze(-1)).clamp(-127, 127)
    return pack_int8(q.view(n, k), scale)


def round_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, last dim a multiple of 32) as `act8` multiplies it: each 32 columns rounded to int8 steps of
    their largest |value| / 127 (half to even), times that step; the same fp32 operations as the kernel's."""
    c = x.float().reshape(-1, 32)
    amax = c.abs().amax(-1, keepdim=True)
    step = torch.where(amax > 0, amax * torch.tensor(1 / 127, dtype=torch.float32), torch.ones_like(amax))
    return (torch.round(c * (1 / step)) * step).view(x.shape).to(x.dtype)


def quant_linear_reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                           act8: bool = False) -> torch.Tensor:
    if act8 and scheme(w) == INT4:
        x = round_activations_int8(x)
    return F.linear(x, dequantize(w).to(x.dtype), bias)


def quant_linear_op(device: torch.device) -> Callable:
    """What `quant_linear` calls on `device`, (x, w, bias, act8) → y: the C++ kernel (fp32 math) on CPU once mii's CPU
    kernels are loaded, else the reference. Bound once by `linear_op` for a decode step's LM head."""
    if device.type == "cpu" and kernels.cpu_op("linear_quant"):
        return torch.ops.mii.linear_quant.default
    return quant_linear_reference


def quant_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], act8: bool = False) -> torch.Tensor:
    """x @ dequantize(w).T + bias. `act8`: an int4 weight multiplies x rounded to int8 per 32 columns
    (`quantize_activations`)."""
    return quant_linear_op(x.device)(x, w, bias, act8)


def use_int8_activations(model: torch.nn.Module) -> int:
    """`quantize_activations`: every linear with an int4 weight rounds its input to int8 from now on; returns how
    many do."""
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and scheme(w) == INT4:
            m.act8 = True
            n += 1
    return n
