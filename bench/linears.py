"""A decode step's linears at a few rows of x: every linear of the model once (weights streamed from memory, as in a
step), then its LM head, at each row count, against the machine's copy and bf16 matmul rates measured in the same
run. It shows what a row costs in the few-rows kernels (`mii/kernels/quant_cpu.cpp`: the decode kernels and
`rows_tile`; `linear_cpu.cpp`: the k-pair tiles) and where one kernel hands over to the next.

    .venv/bin/python -m bench.linears                                  # the embedded model (int4), rows 1-32
    .venv/bin/python -m bench.linears --model /tmp/llama-1b.Q4_1.gguf --rows 1,4,8
    .venv/bin/python -m bench.linears --quantization none              # its bf16 weights (mii::linear_bf16w)
    MII_CPU_ISA=avx2 .venv/bin/python -m bench.linears                 # the kernels of an AVX2 CPU (fp32 x)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mii
from bench.workloads import copy_gbps, matmul_gflops
from mii.layers import quant
from mii.layers.linear import LinearBase, bf16w_rows, linear_op


def in_width(w: torch.Tensor) -> int:
    """A linear's input features from its weight as the kernels hold it: packed int8/int4, bf16 row-major, 8x8 tiles
    or k-pair tiles (mii/layers/quant.py, mii/layers/linear.py); 0 where the weight is elsewhere (oneDNN's copy)."""
    if quant.scheme(w) is not None:
        return quant.in_features(w)
    return w.numel() // bf16w_rows(w) if w.numel() else 0


def linears_and_inputs(pipe) -> tuple[list, dict, int]:
    """The model's linears in the order a step runs them with each one's input width, and the LM head's (the
    decoder stack runs the layers in C++, so the widths come from the weights)."""
    model = pipe.engine.runner.model
    mods = [m for m in model.modules() if isinstance(m, LinearBase) and in_width(m.weight)]
    width = {id(m): in_width(m.weight) for m in mods}
    seen = {}
    logits = model.compute_logits
    model.compute_logits = lambda h: (seen.setdefault("head", h.shape[-1]), logits(h))[1]
    try:
        pipe([list(range(1000, 1016))], max_new_tokens=2, do_sample=False)
    finally:
        del model.compute_logits
    width["head"] = seen["head"]
    return mods, width, seen["head"]


def time_rows(pipe, rows: list[int], rounds: int) -> dict:
    mods, width, hidden = linears_and_inputs(pipe)
    model = pipe.engine.runner.model
    dtype = pipe.engine.plan.torch_dtype
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in mods)
    sweep = torch.empty(64 << 20, dtype=torch.uint8)  # between passes: the weights come from memory, as in a step
    times: dict = {}
    ops = [(linear_op(m, m.bias), width[id(m)]) for m in mods]  # (each bound to its op once, as the layers are)
    with torch.inference_mode():
        xs = {m_: {k: torch.randn(m_, k).to(dtype) for k in set(width.values())} for m_ in rows}
        macs = sum(op(xs[rows[0]][k]).shape[-1] * k for op, k in ops)  # per row of x
        for _ in range(rounds):
            for m_ in rows:
                sweep.add_(1)
                t = time.perf_counter()
                for op, k in ops:
                    op(xs[m_][k])
                times.setdefault((m_, "linears"), []).append(time.perf_counter() - t)
                sweep.add_(1)
                t = time.perf_counter()
                model.compute_logits(xs[m_][hidden])
                times.setdefault((m_, "head"), []).append(time.perf_counter() - t)
    out = {"linears": len(mods), "weight_bytes": weight_bytes, "macs_per_row": macs, "rows": {}}
    for m_ in rows:
        lin, head = (statistics.median(times[m_, k]) for k in ("linears", "head"))
        out["rows"][m_] = {"linears_ms": round(lin * 1e3, 3), "per_row_ms": round(lin * 1e3 / m_, 3),
                           "weights_gb_s": round(weight_bytes / lin / 1e9, 1),
                           "gflop_s": round(2 * macs * m_ / lin / 1e9, 1), "head_ms": round(head * 1e3, 3)}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: the embedded model)")
    ap.add_argument("--rows", default="1,2,4,5,8,9,12,16,32", help="row counts of x, comma-separated")
    ap.add_argument("--rounds", type=int, default=8, help="passes per row count (the median is reported)")
    ap.add_argument("--quantization", default="auto", help="the pipeline's quantization (none: bf16 weights)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    pipe = mii.pipeline(args.model, quantization=args.quantization)
    try:
        probes = {"copy_gb_s": round(copy_gbps(), 1), "bf16_matmul_gflop_s": round(matmul_gflops(), 1)}
        res = {"probes": probes, **time_rows(pipe, rows, args.rounds)}
    finally:
        pipe.destroy()
    print(f"{res['linears']} linears, {res['weight_bytes'] / 1e6:.1f} MB of weights, "
          f"{res['macs_per_row'] / 1e6:.1f}M multiply-adds a row; probes: copy {probes['copy_gb_s']} GB/s, "
          f"bf16 matmul {probes['bf16_matmul_gflop_s']} GFLOP/s")
    print(f"{'rows':>5} {'linears ms':>11} {'ms a row':>9} {'GB/s':>6} {'of copy':>8} {'GFLOP/s':>8} {'of matmul':>10}"
          f" {'head ms':>8}")
    for m_, r in res["rows"].items():
        print(f"{m_:>5} {r['linears_ms']:>11.2f} {r['per_row_ms']:>9.2f} {r['weights_gb_s']:>6.1f} "
              f"{r['weights_gb_s'] / probes['copy_gb_s']:>8.0%} {r['gflop_s']:>8.1f} "
              f"{r['gflop_s'] / probes['bf16_matmul_gflop_s']:>10.0%} {r['head_ms']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
