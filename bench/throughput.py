"""W64 offline throughput (SPEC §7): mii vs Hugging Face `transformers` `generate` (static batches of 16), in
the same run, against this machine's compute floor (a bf16 matmul probe run in this process); plus
single-stream decode. Ratios are the result; absolute numbers depend on the machine and its load.

    .venv/bin/python -m bench.throughput [--skip-hf] [--requests 64]
"""
from __future__ import annotations

import argparse
import time

import torch

import mii
from bench.workloads import copy_gbps, matmul_gflops, w64, workload_flops


def run_mii(pipe, prompts, outputs) -> float:
    t = time.perf_counter()
    res = pipe(prompts, max_new_tokens=outputs, ignore_eos=True, do_sample=False)
    wall = time.perf_counter() - t
    assert [r.generated_length for r in res] == outputs
    return wall


def run_hf(model_path: str, prompts, outputs, batch: int = 16) -> float:
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    t = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(prompts), batch):
            ps, os_ = prompts[s: s + batch], outputs[s: s + batch]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(os_), do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


def single_stream(pipe, new_tokens: int = 128) -> tuple[float, float]:
    """(time to first token for a 128-token prompt, decode tokens/s after it)."""
    prompt = list(range(1000, 1128))
    t = time.perf_counter()
    first = None
    for chunk in pipe.stream(prompt, max_new_tokens=new_tokens, ignore_eos=True, do_sample=False):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - t, (new_tokens - 1) / (end - first)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both systems (default: all cores); 1 keeps ratios stable on a busy machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts, outputs = w64(args.requests)
    n_in, n_out = sum(map(len, prompts)), sum(outputs)
    print(f"W64: {len(prompts)} requests, {n_in} prompt tokens, {n_out} output tokens, greedy, EOS ignored")
    gflops = matmul_gflops(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    print(f"machine: {args.dtype} matmul {gflops:.0f} GFLOP/s, copy {copy_gbps():.0f} GB/s, {torch.get_num_threads()} threads")

    pipe = mii.pipeline(dtype=args.dtype, num_threads=torch.get_num_threads())
    run_mii(pipe, prompts[:4], [8] * min(4, len(prompts)))  # warm-up
    floor = workload_flops(pipe.engine.loaded.cfg, prompts, outputs) / (gflops * 1e9)
    wall = run_mii(pipe, prompts, outputs)
    print(f"mii:           {wall:7.1f} s  {n_out / wall:7.1f} output tok/s  "
          f"{(n_in + n_out) / wall:7.1f} total tok/s  = {floor / wall:5.1%} of the compute floor ({floor:.1f} s)")
    ttft, decode = single_stream(pipe)
    print(f"mii single stream: first token {ttft * 1000:.0f} ms after a 128-token prompt, decode {decode:.1f} tok/s")
    pipe.destroy()

    if not args.skip_hf:
        hf = run_hf(mii.default_model(), prompts, outputs)
        print(f"transformers:  {hf:7.1f} s  {n_out / hf:7.1f} output tok/s  (static batches of 16)")
        print(f"ratio: mii is {hf / wall:.2f}x transformers generate on W64")


if __name__ == "__main__":
    main()
