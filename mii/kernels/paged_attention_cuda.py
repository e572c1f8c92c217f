"""`mii::paged_attention` on NVIDIA GPUs: Triton kernels of our own over the blocked KV cache.

Why Triton kernels of our own (docs/architecture.md has the longer version): they read each sequence's block
table in place (no gather of the blocks into a padded copy), take a whole ragged step -- decode tokens and prompt
chunks of any length -- in one or two launches, run on any torch/triton pair that ships together (the H200 image
has torch 2.11 + triton 3.6), run in CI on CPU under `TRITON_INTERPRET=1`, and add no binary dependency tied to
one CUDA/torch version (FlashInfer's prebuilt kernels are); `flex_attention` with a paged block mask compiles
per shape and needs its block mask rebuilt whenever block tables change.

Design (after FlashAttention-2 and vLLM's unified Triton attention):
- One program per (sequence, tile of query tokens, KV head). Its rows are (query token, query head) pairs of
  one KV head's query group, so GQA/MQA loads each K/V tile once for all the heads that share it.
- Keys are walked in tiles of BLOCK_N tokens whatever the cache block size: each key's cache slot comes from
  the block table (`block_tables[seq, pos // block_size]`), so any block size works (8, 16, 32, ...).
- Online softmax in fp32 (exp2); causal and sliding-window masks from absolute positions: the queries of a
  sequence are its last `q_len` positions, `seq_len - q_len ... seq_len - 1`.
- Decode steps (every query length 1) get small tiles (one token x the query group); a step with prompt
  chunks gets large tiles for all its sequences (the op has no decode count to split the launch by).
- The K/V write is a Triton kernel too, one launch for K and V; a negative slot means "skip" (the padded rows
  of a CUDA graph write nothing).

Hot path: no host syncs; launch parameters come from host ints (`max_query_len`). `load_cuda_kernels()`
registers the CUDA implementation of the op defined in `mii.kernels`.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

log = logging.getLogger("mii")

try:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """True when kernels run in Triton's CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt,
                         ROW: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """Token t's K and V rows ([kv_heads * head_dim], contiguous) into cache slot `slot[t]` of the head-major
        cache [blocks, kv_heads, block_size, head_dim]: row slot % BLOCK_SIZE of each head's run; skip slot < 0."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK)
            ok = offs < ROW
            k = tl.load(k_ptr + t * stride_kt + offs, mask=ok)
            v = tl.load(v_ptr + t * stride_vt + offs, mask=ok)
            dst = ((slot // BLOCK_SIZE) * ROW * BLOCK_SIZE + (offs // HEAD_DIM) * (BLOCK_SIZE * HEAD_DIM)
                   + (slot % BLOCK_SIZE) * HEAD_DIM + offs % HEAD_DIM)
            tl.store(k_cache_ptr + dst, k, mask=ok)
            tl.store(v_cache_ptr + dst, v, mask=ok)

    @triton.jit
    def _paged_attention_kernel(
            out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
            seq_offset, scale_log2,
            stride_qt, stride_qh, stride_ot, stride_oh,
            stride_kb, stride_ks, stride_kh, stride_bt,
            WINDOW: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
            UPCAST: tl.constexpr):
        seq = tl.program_id(0) + seq_offset
        q_tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        if q_tile * BLOCK_Q < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            ctx_len = seq_len - q_len  # keys before this step's queries
            offs_m = tl.arange(0, BLOCK_M)
            q_idx = q_tile * BLOCK_Q + offs_m // GROUP       # [M] query token within the chunk
            head = kv_head * GROUP + offs_m % GROUP           # [M] query head
            row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
            q_pos = ctx_len + q_idx                           # [M] absolute position of each row's query
            offs_d = tl.arange(0, BLOCK_D)
            d_ok = offs_d < HEAD_DIM
            tok = (q_start + q_idx).to(tl.int64)
            q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)   # [M, D]
            if UPCAST:  # Triton's CPU interpreter computes bf16 dots wrongly: do them in fp32 there
                q = q.to(tl.float32)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            # keys this tile can see: up to its last query (causal), from its first query's window
            hi = tl.minimum(seq_len, ctx_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len))
            lo = 0
            if WINDOW > 0:
                lo = tl.maximum(ctx_len + q_tile * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            for start in range(lo, hi, BLOCK_N):
                k_pos = start + tl.arange(0, BLOCK_N)                         # [N]
                k_ok = k_pos < hi
                block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
                off = (block.to(tl.int64) * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks
                       + kv_head * stride_kh)                                 # [N] element offset of each key row
                k = tl.load(k_cache_ptr + off[None, :] + offs_d[:, None],
                            mask=k_ok[None, :] & d_ok[:, None], other=0.0)    # [D, N]
                if UPCAST:
                    k = k.to(tl.float32)
                if IEEE:
                    s = tl.dot(q, k, input_precision="ieee")
                else:
                    s = tl.dot(q, k)
                s = s * scale_log2                                            # [M, N], log2 units
                allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
                if WINDOW > 0:
                    allowed = allowed & (k_pos[None, :] > q_pos[:, None] - WINDOW)
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)         # rows with no key yet
                p = tl.math.exp2(s - m_safe[:, None])
                alpha = tl.math.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_cache_ptr + off[:, None] + offs_d[None, :],
                            mask=k_ok[:, None] & d_ok[None, :], other=0.0)    # [N, D]
                if UPCAST:
                    v = v.to(tl.float32)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row without keys (padding) stays 0
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, 1 << (max(n, 1) - 1).bit_length())


def tile_config(group: int, decode: bool, head_dim: int) -> dict:
    """Tile sizes of one launch: decode (one query token per sequence) or prompt chunks."""
    if decode:
        block_m = _pow2(group)
        return dict(BLOCK_Q=1, BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=2)
    block_m = 128 if head_dim <= 128 else 64
    block_m = max(block_m, _pow2(group))
    return dict(BLOCK_Q=max(1, block_m // group), BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 128 else 32,
                num_warps=8 if block_m >= 128 else 4, num_stages=2)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kvh, d] → cache slots `slot_mapping` [T] of k_cache/v_cache [blocks, kvh, block_size, d]."""
    T, kvh, d = k.shape
    k, v = k.reshape(T, kvh * d), v.reshape(T, kvh * d)  # a view when the heads are contiguous (they are)
    if k.stride(1) != 1:
        k = k.contiguous()
    if v.stride(1) != 1:
        v = v.contiguous()
    row = kvh * d
    _write_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                           ROW=row, BLOCK=_pow2(row, 1), HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[2])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int, num_decode: int,
                    num_seqs: int, scale: float, window: Optional[int] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged cache.

    q: [T, h, d]; k_cache, v_cache: [num_blocks, kvh, block_size, d]; block_tables: [S, max_blocks] (int32/64);
    seq_lens: [S] keys per sequence (this step's included); query_start: [S + 1] cumulative query lengths; the
    first `num_decode` sequences have one query each. Returns [T, h, d] (rows no sequence covers are untouched).
    """
    T, h, d = q.shape
    _, kvh, block_size, _ = k_cache.shape
    group = h // kvh
    if out is None:
        out = torch.empty_like(q)
    if q.stride(2) != 1:
        q = q.contiguous()
    common = dict(WINDOW=window or 0, BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=d, BLOCK_D=_pow2(d),
                  IEEE=q.dtype == torch.float32, UPCAST=q.dtype == torch.bfloat16 and interpreted())
    args = (out, q, k_cache, v_cache, block_tables, seq_lens, query_start)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), block_tables.stride(0))  # block, slot, head
    scale_log2 = scale * 1.4426950408889634
    launches = [(0, num_decode, True), (num_decode, num_seqs - num_decode, False)]
    for offset, count, decode in launches:
        if count <= 0:
            continue
        cfg = tile_config(group, decode, d)
        q_len = 1 if decode else max_query_len
        grid = (count, triton.cdiv(q_len, cfg["BLOCK_Q"]), kvh)
        _paged_attention_kernel[grid](*args, offset, scale_log2, *strides, **common, **cfg)
    return out


def _op_cuda(q, k, v, k_cache, v_cache, slot_mapping, query_start, seq_lens, block_tables, max_query_len: int,
             scale: float, window: int) -> torch.Tensor:
    """The CUDA kernel of `mii::paged_attention`: write this step's K/V, attend → [T, h * d]."""
    T = q.shape[0]
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    S = seq_lens.shape[0]
    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, max_query_len,
                          S if max_query_len == 1 else 0, S, scale, window or None)
    return out.view(T, -1)


_registered: list = []


def load_cuda_kernels() -> Optional[str]:
    """Register the CUDA implementations of `mii::paged_attention` and of the fused element-wise ops
    (`fused_cuda`); None when ready, else the reason they are not."""
    if triton is None:
        return "triton is not importable"
    if not _registered:
        import mii.kernels  # noqa: F401  (defines the ops)
        from mii.kernels import fused_cuda

        lib = torch.library.Library("mii", "IMPL")
        lib.impl("paged_attention", _op_cuda, "CUDA")
        fused_cuda.register(lib)
        _registered.append(lib)  # the registration lives as long as this Library object
    return None
