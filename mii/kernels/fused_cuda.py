"""`mii::rms_norm`, `mii::rotary_` and `mii::silu_and_mul` on NVIDIA GPUs: Triton kernels, one launch each.

Why: eager PyTorch runs 9 kernels for an RMSNorm with its residual add (the add, two casts, the square, the mean,
the epsilon, the rsqrt, two products), 18 for rotary (for q and for k: a cast, four products, a difference, a sum,
a concatenation, a cast) and 2 for SiLU·mul: 38 a decoder layer where these take 4. A batch-1 decode step on a GPU
is bound by how many kernels it runs, not by their arithmetic: the H200 run of `scripts/gpu_check.sh` (2026-12-04)
had a ~1B Llama's captured decode step at 2.26 ms, 22% of its weights' HBM time. Each kernel here rounds to the
model's dtype at the points the eager code does (mii/layers), as `fused_cpu.cpp` does on CPU, so bf16 results
match eager up to the last bit of an fp32 intermediate.

Like the attention kernels, they run in CI on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`,
tests/kernels/test_fused_cuda.py) against the eager layers; `paged_attention_cuda.load_cuda_kernels()` registers
them as the ops' CUDA implementations, and the model runner turns the layers' fused paths on where it has.
"""
from __future__ import annotations

from typing import Optional

import torch

from mii.kernels.paged_attention_cuda import _pow2, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, ro_ptr, w_ptr, y_ptr, stride_x, stride_r, stride_ro, stride_y, n, eps, offset,
                         HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        """One row: h = x (+ residual, rounded to the dtype and stored as the new residual), then
        y = (h * rsqrt(mean(h^2) + eps)) rounded, times w (offset 0); or h * rsqrt(...) * (w + offset), rounded."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            h = h + tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            rounded = h.to(ro_ptr.dtype.element_ty)
            tl.store(ro_ptr + row * stride_ro + cols, rounded, mask=ok)
            h = rounded.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        if HAS_OFFSET:
            y = h * inv * (w.to(tl.float32) + offset)
        else:
            y = (h * inv).to(w.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotate(ptr, heads, c, s, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HEAD_STRIDE):
        """Every head of one token's row at `ptr`: (x1, x2) of its first 2 * HALF features -> (x1 c - x2 s,
        x2 c + x1 s), in fp32, rounded to the dtype, in place."""
        h = tl.arange(0, BLOCK_H)
        i = tl.arange(0, BLOCK_HALF)
        ok = (h[:, None] < heads) & (i[None, :] < HALF)
        at = ptr + h[:, None] * HEAD_STRIDE + i[None, :]
        x1 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
        a, b = x1 * c[None, :], x2 * s[None, :]  # rounded products, then their sums: eager's order (the launch
        u, v = x2 * c[None, :], x1 * s[None, :]  # turns the compiler's contraction into FMAs off)
        tl.store(at, (a - b).to(ptr.dtype.element_ty), mask=ok)
        tl.store(at + HALF, (u + v).to(ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_kt, stride_qh, stride_kh,
                       q_heads, k_heads, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        """Token t's query and key heads, rotated by the table rows of its position."""
        t = tl.program_id(0).to(tl.int64)
        p = tl.load(pos_ptr + t).to(tl.int64)
        i = tl.arange(0, BLOCK_HALF)
        c = tl.load(cos_ptr + p * HALF + i, mask=i < HALF, other=0.0)
        s = tl.load(sin_ptr + p * HALF + i, mask=i < HALF, other=0.0)
        _rotate(q_ptr + t * stride_qt, q_heads, c, s, HALF, BLOCK_H, BLOCK_HALF, stride_qh)
        _rotate(k_ptr + t * stride_kt, k_heads, c, s, HALF, BLOCK_H, BLOCK_HALF, stride_kh)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, n, BLOCK: tl.constexpr):
        """A row's columns [BLOCK * j, BLOCK * (j + 1)): silu(gate) rounded to the dtype, times up, rounded."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
        act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
        tl.store(y_ptr + row * stride_y + cols, (act.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty),
                 mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
             offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`mii::rms_norm`: x [T, n] (+ residual [T, n]) -> (y, x + residual), or (y, an empty tensor) without one."""
    x = _rows(x)
    T, n = x.shape
    y = torch.empty_like(x)
    res = residual is not None
    r = _rows(residual) if res else x
    ro = torch.empty_like(x) if res else x.new_empty(0)
    block = _pow2(n, 1)
    if T:
        _rms_norm_kernel[(T,)](x, r, ro if res else y, weight.contiguous(), y, x.stride(0), r.stride(0),
                               ro.stride(0) if res else 0, y.stride(0), n, eps, offset, HAS_RES=res,
                               HAS_OFFSET=offset != 0, BLOCK=block, num_warps=_warps(block))
    return y, ro


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`mii::rotary_`: q [T, h, d] and k [T, kvh, d] (views of the qkv projection: rows may lie apart, each head's
    d features dense) rotated in place by the fp32 tables cos/sin [positions, half] (the first 2 * half features)."""
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("rotary_: q and k must have dense head rows (stride 1 over the head's features)")
    T = q.shape[0]
    half = cos.shape[1]
    if T:
        _rotary_kernel[(T,)](q, k, positions, cos, sin, q.stride(0), k.stride(0), q.stride(1), k.stride(1),
                             q.shape[1], k.shape[1], half, BLOCK_H=_pow2(max(q.shape[1], k.shape[1]), 1),
                             BLOCK_HALF=_pow2(half, 1), num_warps=4, enable_fp_fusion=False)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`mii::silu_and_mul`: [T, 2n] (gate | up) -> silu(gate) * up, [T, n]."""
    x = _rows(x)
    T, n = x.shape[0], x.shape[1] // 2
    y = x.new_empty(T, n)
    block = min(_pow2(n, 1), 1024)
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(n, block))](x, y, x.stride(0), y.stride(0), n, BLOCK=block,
                                                          num_warps=_warps(block))
    return y


def register(lib) -> None:
    """The CUDA implementations of the three ops, on `lib` (a `torch.library.Library("mii", "IMPL")`)."""
    lib.impl("rms_norm", rms_norm, "CUDA")
    lib.impl("rotary_", rotary_, "CUDA")
    lib.impl("silu_and_mul", silu_and_mul, "CUDA")
