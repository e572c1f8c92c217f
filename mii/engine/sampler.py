"""Vectorized sampling: one set of tensor ops for the whole batch, per-row parameters.

Random draws come from a counter-based hash of (request seed, generated-token index, vocabulary id), so a
seeded request samples the same tokens whatever batch it shares, and after a preemption. Sampling uses the
exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p without a host sync.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mii import kernels

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors (values kept < 2**32, multipliers < 2**31: no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x346CA68B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 13)


@functools.lru_cache(maxsize=8)
def _vocab_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """The per-vocabulary-id half of the noise's hash ([V] int64): the same every step, so computed once."""
    return _mix32(torch.arange(vocab, device=device, dtype=torch.int64) + 0x61C88647)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] float32 draws of Exp(1), a pure function of (seed, step, vocabulary id)."""
    h = _mix32((seeds & _M32) ^ _mix32((seeds >> 32) & _M32) ^ _mix32(steps + 0x2545F491))  # [S]
    idx = _vocab_hash(vocab, seeds.device)                                                   # [V]
    x = _mix32(h.unsqueeze(1) ^ idx.unsqueeze(0))                                            # [S, V]
    u = ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))  # uniform in (0, 1): 23 bits, so 1 - u > 0 in float32
    return -torch.log(u)


def race_kernel(logits: torch.Tensor) -> bool:
    """Whether mii's CPU kernels pick this step's tokens: mii::sample_race the sampled rows', mii::argmax_rows the
    greedy ones' (from bf16 logits as they are, where nothing else needs them in fp32)."""
    return logits.device.type == "cpu" and kernels.cpu_op("sample_race")


@dataclass
class SamplingBatch:
    """Per-row parameters of one step, as tensors on the device (built once per step by the runner)."""

    greedy: torch.Tensor          # [S] bool
    temperature: torch.Tensor     # [S] float
    top_p: torch.Tensor           # [S] float
    top_k: torch.Tensor           # [S] long (vocab size when unset)
    min_p: torch.Tensor           # [S] float
    seeds: torch.Tensor           # [S] long
    steps: Optional[torch.Tensor]  # [S] long: tokens generated so far (None when every row is greedy)
    all_greedy: bool
    needs_sort: bool              # some sampled row uses top_p < 1 or top_k
    any_min_p: bool
    penalties: Optional[tuple] = None  # (rep [S], presence [S], frequency [S], prompt_ids [S, P], output_ids [S, O]) padded with -1
    banned: Optional[torch.Tensor] = None  # [S, n] long ids to mask (EOS before min_new_tokens), -1 padding
    logprobs: int = -1            # top-k logprobs to return (max over rows); -1: none
    has_min_tokens: bool = False  # some row has min_new_tokens (its EOS ban is rebuilt each step)
    logit_bias: Optional[tuple] = None  # (rows [N], token ids [N], biases [N]): logits[row, id] += bias
    constrained: tuple = ()       # rows with a constraint (mii.engine.constraints), on the host
    constrained_rows: Optional[torch.Tensor] = None  # [C] long: the same rows, on the device
    allowed: Optional[torch.Tensor] = None  # [C, V] bool: the tokens those rows' constraints allow next
    any_greedy: bool = True       # some row is greedy (False: the sampled tokens are the step's, no argmax)


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: Optional[list[float]] = None           # chosen token's logprob per row
    top_ids: Optional[list[list[int]]] = None
    top_logprobs: Optional[list[list[float]]] = None


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, L] ids padded with -1 → [S, V] occurrence counts."""
    counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)
    counts.scatter_add_(1, torch.where(ids < 0, vocab, ids), torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, pen: tuple, in_place: bool = False) -> torch.Tensor:
    """Repetition (vLLM's: on every token of the prompt and the output), frequency and presence (OpenAI's: on the
    output's) penalties. On the CPU `mii::penalize_` touches only the tokens that occur (O(ids) per row, not O(V)),
    in `logits` itself when `in_place`, else in a copy; elsewhere dense [S, V] ops (no host sync), a new tensor.
    Both compute each logit the same way."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and kernels.cpu_op("penalize_"):
        out = logits if in_place and logits.is_contiguous() else logits.clone(memory_format=torch.contiguous_format)
        torch.ops.mii.penalize_(out, *pen)
        return out
    return _penalties_dense(logits, pen)


def _penalties_dense(logits: torch.Tensor, pen: tuple) -> torch.Tensor:
    rep, presence, frequency, prompt_ids, output_ids = pen
    V = logits.shape[1]
    out_counts = _counts(output_ids, V)
    seen = (out_counts + _counts(prompt_ids, V)) > 0
    r = rep.unsqueeze(1)
    # a penalty near 0 would divide a positive logit into +inf (NaN after softmax): the largest finite value
    boosted = (logits / r).clamp(max=torch.finfo(logits.dtype).max)
    logits = torch.where(seen, torch.where(logits > 0, boosted, logits * r), logits)
    return logits - frequency.unsqueeze(1) * out_counts - presence.unsqueeze(1) * (out_counts > 0)


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[C, W] int32 (bit v % 32 of word v // 32 set where token v is allowed) → [C, vocab] bool, on bits' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(bits.shape[0], -1)[:, :vocab]


def apply_allowed(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """-inf at the tokens of `rows` that `allowed` ([C, V] bool) does not allow; other rows are untouched. Costs
    O(C * V), nothing for rows without a constraint."""
    ninf = torch.tensor(float("-inf"), device=logits.device)
    if allowed.shape[0] == logits.shape[0]:  # every row constrained (rows are 0..S-1, in order)
        return torch.where(allowed, logits, ninf)
    return logits.index_copy(0, rows, torch.where(allowed, logits.index_select(0, rows), ninf))


def sample_torch(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The sampled token of every row ([S] long) by tensor ops: temperature, top-p / top-k over a full sort,
    min-p, then the exponential race (argmax of p / E). `mii::sample_race` draws the same on CPU."""
    # as the kernel: +inf (a penalty near 0) counts as 1e30, NaN as masked
    scaled = (logits / sb.temperature.clamp(min=1e-5).unsqueeze(1)).clamp(max=1e30).nan_to_num(nan=float("-inf"))
    if sb.needs_sort:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # ties: lower id first, as the kernel
        probs = sorted_logits.softmax(dim=-1)
        rank = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
        # drop a token when the mass before it already reaches top_p, or it is past top_k
        drop = (probs.cumsum(dim=-1) - probs >= sb.top_p.unsqueeze(1)) | (rank >= sb.top_k.unsqueeze(1))
        drop[:, 0] = False
        scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(dim=-1)
    if sb.any_min_p:
        probs = probs.masked_fill(probs < sb.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
    return (probs / exponential_noise(sb.seeds, sb.steps, probs.shape[1])).argmax(dim=-1)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SamplerOutput:
    """logits: [S, V] (any float dtype) → one token per row. Logprobs are those of the model's distribution
    (before penalties, logit_bias and constraints)."""
    kernel = race_kernel(logits)
    plain = sb.penalties is None and sb.logit_bias is None and sb.banned is None and sb.allowed is None
    given = logits
    if not (kernel and plain):  # else mii's kernels read them as they are (bf16 too)
        logits = logits.float()
    raw = logits
    if sb.penalties is not None:  # in place where the float copy is ours and the raw logits are not needed after
        logits = apply_penalties(logits, sb.penalties, in_place=logits is not given and sb.logprobs < 0)
    if sb.logit_bias is not None:
        rows, ids, bias = sb.logit_bias
        logits = logits.index_put((rows, ids), bias, accumulate=True)
    if sb.banned is not None:
        mask = torch.zeros_like(logits, dtype=torch.bool)
        mask.scatter_(1, sb.banned.clamp(min=0), sb.banned >= 0)
        logits = logits.masked_fill(mask, float("-inf"))
    if sb.allowed is not None:
        logits = apply_allowed(logits, sb.constrained_rows, sb.allowed)
    if sb.any_greedy:
        tokens = torch.ops.mii.argmax_rows(logits) if kernel else logits.argmax(dim=-1)
    if not sb.all_greedy:
        if kernel:
            sampled = torch.ops.mii.sample_race(logits, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seeds,
                                                sb.steps)
        else:
            sampled = sample_torch(logits, sb)
        tokens = torch.where(sb.greedy, tokens, sampled) if sb.any_greedy else sampled
    out = SamplerOutput(tokens.tolist())
    if sb.logprobs >= 0:
        chosen, top_lp, top_ids = token_logprobs(raw, tokens, sb.logprobs)
        out.logprobs = chosen.tolist()
        if sb.logprobs > 0:
            out.top_ids, out.top_logprobs = top_ids.tolist(), top_lp.tolist()
    return out


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """Log-probabilities (log_softmax over the vocabulary) of each row's target ([N]) and its k largest with their
    ids ([N, k], descending): on the CPU by `mii::logprobs_rows` (no [N, V] log-softmax: ~4x faster a row, and its
    top-k ~10x), elsewhere by tensor ops."""
    if logits.device.type == "cpu" and kernels.cpu_op("logprobs_rows"):
        return torch.ops.mii.logprobs_rows(logits, targets, k)
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return chosen, top_lp, top_ids


def pad_ids(rows: list[list[int]], device) -> torch.Tensor:
    width = max(1, max((len(r) for r in rows), default=1))
    arr = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return torch.from_numpy(arr).to(device, non_blocking=True)
