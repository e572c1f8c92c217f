"""Shared benchmark workloads (SPEC §7) and the machine probes that give each result its scale."""
from __future__ import annotations

import time

import numpy as np
import torch


def w64(n: int = 64):
    """W64 exactly as SPEC §7 defines it: (prompt token ids, output lengths); EOS ignored, greedy."""
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(32, 512, 64, endpoint=True)
    output_lens = rng.integers(32, 256, 64, endpoint=True)
    prompts = [rng.integers(1000, 40000, int(p)).tolist() for p in prompt_lens]
    return prompts[:n], [int(o) for o in output_lens[:n]]


def matmul_gflops(dtype=torch.bfloat16, n: int = 2048, repeat: int = 5) -> float:
    """Best-of-`repeat` square matmul rate on this machine, measured now."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def copy_gbps(mb: int = 256, repeat: int = 5) -> float:
    src = torch.ones(mb * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def workload_flops(cfg, prompts, outputs) -> float:
    """Matmul FLOPs of a greedy run: every token through the layers, the LM head for every sampled token,
    attention (QK^T and PV) over each token's context."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * L * (h * (q + 2 * kv) + q * h + 3 * h * i)
    tokens = sum(len(p) + o for p, o in zip(prompts, outputs))
    head = 2 * h * cfg.vocab_size * sum(outputs)
    attn = 0
    for p, o in zip(prompts, outputs):
        n = len(p) + o
        attn += 4 * L * q * n * (n + 1) / 2  # token t attends to t keys: 2 * (QK^T + PV) * q features
    return per_token * tokens + head + attn
