"""Offline speed in one run (SPEC §7, issue "Fast on CPU"): W64 against this machine's compute floor (a matmul
probe run in this process, before and after the measurements: the floor uses the best) and against Hugging Face `transformers` `generate` (static batches of 16).
W64 runs twice, on other prompts of the same lengths first (reported as the first W64: its KV blocks' memory is
new to the process, and a first touch of memory is slow on some VMs), then on its own with that memory in place, a
server's steady state: the figure the ratios use.
The steps' thread pace at the end (a drop: other processes took the threads' cores, a busy machine's numbers).
Single-stream decode (128-token prompt, 256 new tokens) against the weight-bandwidth floor (a copy probe), and
from an empty context (1-token prompt, 128 new: llama-bench's tg128); prefill of a 512-token prompt (pp512); time to first token; cold and warm start-up. With `--compare-torch`,
the same W64 and single stream through the torch reference backends (MII_KERNELS=0) in the same run, so
the kernels' gain is a same-run ratio. With `--compare-quant`, the embedded model's weights three ways in the
same run — bf16 (quantization="none", dequantized), int8 (quantized at load) and int4 (its GGUF's own blocks,
the default), and int4 with int8 activations and with an int8 KV cache — each with its W64, single-stream decode
and the resident memory its load adds (in a fresh process). Ratios are the result: absolute numbers depend on the machine and its load. With `--llama-bench PATH` (or `$LLAMA_BENCH`),
llama.cpp's own pp512, tg128 and tg256 @ d128 (our single stream's work) on the same GGUF file and cores in the
same run, and on its BF16 re-quantization
when `llama-quantize` is next to the binary (`bench/peers.py` says how to build them); then our decode and its
tg256 @ d128 alternated pair by pair, three times for int4 and for bf16, whose median pair is the ratio to quote.

With `--model PATH`, a GGUF file other than the embedded model (`bench/random_gguf.py` makes a bigger one here),
read by mii and llama.cpp alike; its name stands where "the embedded model" does below.

    .venv/bin/python -m bench.throughput [--skip-hf] [--skip-startup] [--compare-torch] [--compare-quant]
                                         [--llama-bench PATH] [--model PATH] [--requests 64] [--json results.json]
                                         [--plot w64.png]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

import mii
from bench.workloads import copy_gbps, matmul_gflops, w64, workload_flops


def run_w64(pipe, prompts, outputs) -> float:
    t = time.perf_counter()
    res = pipe(prompts, max_new_tokens=outputs, ignore_eos=True, do_sample=False)
    wall = time.perf_counter() - t
    assert [r.generated_length for r in res] == outputs
    return wall


def run_hf(model_path: str, prompts, outputs, dtype: torch.dtype, batch: int = 16) -> float:
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
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


_fresh = itertools.count(1)


def fresh_prompt(n: int) -> list[int]:
    """n token ids no earlier request of this process began with: with prefix caching on (the default), a
    repeated prompt would be a cache hit, and its time to first token not a prefill."""
    return np.random.default_rng(next(_fresh)).integers(1000, 40000, n).tolist()


def single_stream(pipe, prompt_len: int = 128, new_tokens: int = 256) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it) for one request alone, on a prompt not seen before."""
    prompt = fresh_prompt(prompt_len)
    t = time.perf_counter()
    first = None
    for _ in pipe.stream(prompt, max_new_tokens=new_tokens, ignore_eos=True, do_sample=False):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - t, (new_tokens - 1) / (end - first)


def prefill_rate(pipe, n: int = 512, repeat: int = 3) -> float:
    """pp512: prompt tokens/s for one n-token prompt (its time to first token, best of `repeat`; a new prompt
    each time, so no prefix is cached)."""
    best = float("inf")
    for _ in range(repeat):
        prompt = fresh_prompt(n)
        t = time.perf_counter()
        pipe(prompt, max_new_tokens=1, do_sample=False)
        best = min(best, time.perf_counter() - t)
    return n / best


def startup_times(model: Optional[str], dtype: str, threads: int) -> tuple[float, float]:
    """(cold, warm) seconds from a new process to a ready pipeline: cold with an empty mii cache (the GGUF
    conversion, the CPU kernels' build, the packed weights written), warm with the cache the cold start left."""
    code = ("import time; t = time.perf_counter(); import mii; "
            f"mii.pipeline({model!r}, dtype={dtype!r}, num_threads={threads}); print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, MII_CACHE_DIR=cache)
        times = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            times.append(float(out.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def weight_bytes(pipe) -> int:
    """Bytes of weights a decode step reads: every parameter and prepacked weight once (tied ones once)."""
    seen, total = set(), 0
    for m in pipe.engine.runner.model.modules():
        for t in list(m.parameters(recurse=False)) + ([m.packed] if getattr(m, "packed", None) is not None else []):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


LOAD_RSS = """
import sys, mii
from bench.throughput import resident_bytes
before = resident_bytes()
pipe = mii.pipeline(sys.argv[6] or None, dtype=sys.argv[1], num_threads=int(sys.argv[2]), quantization=sys.argv[3],
                    quantize_activations=sys.argv[4] == "1", kv_cache_dtype=sys.argv[5])
print(resident_bytes() - before)
"""


def load_resident(model: Optional[str], dtype: str, threads: int, q: str, act8: bool, kv: str = "auto") -> int:
    """The resident bytes a load of the model adds, in a fresh process (in this one, what an earlier
    pipeline freed is handed back or reused during the next load, so that a delta here can even be negative)."""
    root = Path(__file__).resolve().parent.parent
    # (the packed weights' cache off: a copy read from it is the file's pages, resident only once a step reads them)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "MII_PACKED_CACHE": "0"}
    p = subprocess.run([sys.executable, "-c", LOAD_RSS, dtype, str(threads), q, "1" if act8 else "0", kv, model or ""],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"measuring the resident memory of quantization={q!r} failed:\n{p.stderr[-2000:]}")
    return int(p.stdout.strip().splitlines()[-1])


def compare_quant(model: Optional[str], dtype: str, threads: int, prompts, outputs) -> dict:
    """W64 and single stream of the model as int4 (its GGUF's blocks), int4 with int8 activations
    (quantize_activations), int4 with an int8 KV cache (kv_cache_dtype, where this CPU's kernel reads one), int4
    with MII_QUANT_TILES=bf16 (where this CPU has AMX), int8 and bf16, one after the other in this process; the
    resident memory each load adds, each in a fresh process."""
    from mii.envs import cpu_flags
    from mii.errors import ValidationError

    out = {}
    for q, act8, kv, label in (("auto", False, "auto", "int4"), ("auto", True, "auto", "int4 a8"),
                               ("auto", False, "int8", "int4 kv8"), ("auto", False, "auto", "int4 bf16t"),
                               ("int8", False, "auto", "int8"), ("none", False, "auto", "bf16")):
        os.environ.pop("MII_QUANT_TILES", None)  # (set for its own row only)
        if label == "int4 bf16t":
            if "amx_bf16" not in cpu_flags():
                print(f"{'':<14} mii {label}: not on this machine (MII_QUANT_TILES=bf16 needs AMX)", flush=True)
                continue
            os.environ["MII_QUANT_TILES"] = "bf16"
        try:
            pipe = mii.pipeline(model, dtype=dtype, num_threads=threads, quantization=q, quantize_activations=act8,
                                kv_cache_dtype=kv)
        except ValidationError as e:
            print(f"{'':<14} mii {label}: not on this machine ({e})", flush=True)
            continue
        grown = load_resident(model, dtype, threads, q, act8, kv)
        r = measure(pipe, prompts, outputs, f"mii {label}")
        r.update(rss_mb=grown / 1e6, weights_mb={k: v / 1e6 for k, v in pipe.engine_plan.weight_bytes.items()},
                 plan=pipe.engine_plan.quantization)
        print(f"{'':<14} load added {r['rss_mb']:.0f} MB resident; weights "
              + ", ".join(f"{k} {v:.1f} MB" for k, v in r["weights_mb"].items()), flush=True)
        out[label] = r
        pipe.destroy()
        del pipe
    os.environ.pop("MII_QUANT_TILES", None)
    return out


def decode_duel(model: Optional[str], binary: Path, files: dict, dtype: str, threads: int, rounds: int = 3) -> dict:
    """Single-stream decode (128-token prompt, 256 new) alternated with llama-bench's tg256 @ d128 on the same
    weights, pair by pair, so that the machine's drift over the run (up to 30% between minutes on a shared one)
    does not fall between the two sides: {label: {"mii": [tok/s], "llama.cpp": [tok/s]}}. `files`: label ->
    (quantization, the GGUF llama.cpp reads)."""
    from bench.peers import llama_decode

    pipes = {label: mii.pipeline(model, dtype=dtype, num_threads=threads, quantization=q)
             for label, (q, _) in files.items()}
    out = {label: {"mii": [], "llama.cpp": []} for label in files}
    try:
        for p in pipes.values():
            single_stream(p, new_tokens=32)  # warm-up
        for _ in range(rounds):
            for label, (_, gguf) in files.items():
                out[label]["mii"].append(single_stream(pipes[label])[1])
                out[label]["llama.cpp"].append(llama_decode(binary, gguf, threads))
    finally:
        for p in pipes.values():
            p.destroy()
    return out


def measure(pipe, prompts, outputs, label: str) -> dict:
    # warm-up: W64's lengths on other prompts, so that the measured W64 finds its KV memory in place, as a server's
    # steady state does. A first touch of memory is slow on this project's VMs (70-80 MB/s, kv_memory.py): the
    # warm-up's own time, with its ~500 MB of new KV blocks faulted in as it ran, is reported beside
    r = {"w64_first": run_w64(pipe, [fresh_prompt(len(p)) for p in prompts], outputs)}
    r["w64"] = run_w64(pipe, prompts, outputs)
    r["ttft"], r["decode"] = single_stream(pipe)
    r["tg128"] = single_stream(pipe, prompt_len=1, new_tokens=129)[1]  # llama-bench's tg128: from an empty context
    r["pp512"] = prefill_rate(pipe)
    print(f"{label:<14} W64 {r['w64']:6.1f} s (first {r['w64_first']:.1f} s) | single stream: first token "
          f"{r['ttft'] * 1000:4.0f} ms, "
          f"decode {r['decode']:6.1f} tok/s (from an empty context {r['tg128']:6.1f}) | pp512 {r['pp512']:6.0f} tok/s",
          flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--compare-torch", action="store_true",
                    help="also run the torch reference backends (MII_KERNELS=0) in the same run")
    ap.add_argument("--compare-dtype", default=None,
                    help="also run mii with this dtype in the same run (float32: fp32 weights where the plan keeps bf16)")
    ap.add_argument("--compare-quant", action="store_true",
                    help="also run the model as int4 (its GGUF's blocks), int8 and bf16 in the same run: W64, decode, "
                         "resident memory")
    ap.add_argument("--llama-bench", nargs="?", const="", default=None, metavar="PATH",
                    help="also run llama.cpp's llama-bench (pp512, tg128) on the same GGUF and cores; PATH defaults "
                         "to $LLAMA_BENCH or llama-bench on PATH")
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="a GGUF file for every system (default: the embedded model; bench/random_gguf.py makes others)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="auto (the engine plan's choice), bfloat16 or float32")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for every system (default: all cores); 1 keeps ratios stable on a busy machine")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also draw W64 against the floor and the peers, and decode against its floor (bench.plots)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    prompts, outputs = w64(args.requests)
    n_in, n_out = sum(map(len, prompts)), sum(outputs)
    print(f"W64: {len(prompts)} requests, {n_in} prompt tokens, {n_out} output tokens, greedy, EOS ignored")
    model = args.model
    pipe = mii.pipeline(model, dtype=args.dtype, num_threads=threads)
    plan = pipe.engine_plan
    dtype = plan.torch_dtype
    # the machine's own rates, probed again after the measurements: a shared machine has slow minutes (one run's
    # first matmul probe read 212 GFLOP/s where the plan's, a minute later, read 390), and a floor from a slow
    # probe flatters every ratio; the floors use the best probe of the run
    probes = [(matmul_gflops(dtype), copy_gbps())]
    print(f"machine: {plan.dtype} matmul {probes[0][0]:.0f} GFLOP/s, copy {probes[0][1]:.0f} GB/s, {threads} threads; "
          f"plan: attention {plan.attention}, weights {plan.weight_dtype} ({plan.linear_backend} linears), "
          f"token budget {plan.max_batch_tokens}", flush=True)
    flops, wbytes = workload_flops(pipe.engine.loaded.cfg, prompts, outputs), weight_bytes(pipe)

    results = {"mii": measure(pipe, prompts, outputs, "mii")}
    # the steps' thread pace: a drop means other processes took the threads' cores during the run
    pace = torch.ops.mii.stack_pace(pipe.engine.runner.paced) if pipe.engine.runner.paced is not None else None
    results["mii"]["pace"] = pace
    pipe.destroy()
    probes.append((matmul_gflops(dtype), copy_gbps()))
    if args.compare_torch:
        os.environ["MII_KERNELS"] = "0"
        torch_pipe = mii.pipeline(model, dtype=args.dtype, num_threads=threads)
        del os.environ["MII_KERNELS"]
        results["torch"] = measure(torch_pipe, prompts, outputs, "mii (torch)")
        torch_pipe.destroy()
    if args.compare_dtype:
        other = mii.pipeline(model, dtype=args.compare_dtype, num_threads=threads)
        results["dtype"] = measure(other, prompts, outputs, f"mii {args.compare_dtype}")
        other.destroy()
    if args.compare_quant:
        results["quant"] = compare_quant(model, args.dtype, threads, prompts, outputs)
        probes.append((matmul_gflops(dtype), copy_gbps()))
    gflops, gbps = max(p[0] for p in probes), max(p[1] for p in probes)
    floor, bw_floor = flops / (gflops * 1e9), gbps * 1e9 / wbytes
    print(f"machine probes: matmul {', '.join(f'{p[0]:.0f}' for p in probes)} GFLOP/s, copy "
          f"{', '.join(f'{p[1]:.0f}' for p in probes)} GB/s; the floors use the best", flush=True)
    llama = duel = None
    if args.llama_bench is not None:
        from bench.peers import find_llama_bench, llama_bench

        binary = find_llama_bench(args.llama_bench or None)
        if binary is None:
            raise SystemExit("--llama-bench: no llama-bench binary found (give its path or set $LLAMA_BENCH)")
        llama = llama_bench(binary, Path(model or mii.default_model()), threads, types=("BF16",))
        for ftype, row in llama.items():
            print(f"{'llama.cpp':<14} {ftype if ftype != 'file' else 'GGUF as shipped'}: pp512 {row['pp512']:6.0f} "
                  f"tok/s, tg128 {row['tg128']:6.1f} tok/s, tg256 @ d128 {row['tg256@d128']:6.1f} tok/s", flush=True)
        files = {"int4": ("auto", Path(llama["file"]["file"]))}
        if "BF16" in llama:
            files["bf16"] = ("none", Path(llama["BF16"]["file"]))
        duel = decode_duel(model, binary, files, args.dtype, threads)
        for label, d in duel.items():
            print(f"{'alternated':<14} {label}: mii {' '.join(f'{x:.1f}' for x in d['mii'])} / llama.cpp "
                  f"{' '.join(f'{x:.1f}' for x in d['llama.cpp'])} tok/s (128 + 256 tokens, pair by pair)", flush=True)
    hf = None
    if not args.skip_hf:
        hf = run_hf(model or mii.default_model(), prompts, outputs, dtype)
        print(f"{'transformers':<14} W64 {hf:6.1f} s (generate, static batches of 16)", flush=True)
    cold = warm = None
    if not args.skip_startup:
        cold, warm = startup_times(model, args.dtype, threads)

    r = results["mii"]
    print("\nsummary (same-run ratios)")
    print(f"  W64 wall time             {r['w64']:7.1f} s = {r['w64'] / floor:5.1f}x the compute floor ({floor:.1f} s); "
          f"the first W64 of the process (its KV memory faulted in as it ran) {r['w64_first']:.1f} s")
    if hf:
        print(f"  W64 vs transformers       {hf / r['w64']:7.2f}x faster")
    if "torch" in results:
        t = results["torch"]
        print(f"  kernels vs torch backends W64 {t['w64'] / r['w64']:.2f}x, decode {r['decode'] / t['decode']:.2f}x, "
              f"pp512 {r['pp512'] / t['pp512']:.2f}x")
    if "dtype" in results:
        t = results["dtype"]
        print(f"  plan vs dtype={args.compare_dtype}     W64 {t['w64'] / r['w64']:.2f}x, decode {r['decode'] / t['decode']:.2f}x, "
              f"pp512 {r['pp512'] / t['pp512']:.2f}x")
    if "quant" in results:
        qr = results["quant"]
        b = qr["bf16"]
        for label in ("int8", "int4", "int4 a8"):
            x = qr[label]
            print(f"  {label} vs bf16 weights     decode {x['decode'] / b['decode']:.2f}x ({x['decode']:.1f} vs "
                  f"{b['decode']:.1f} tok/s), W64 {b['w64'] / x['w64']:.2f}x, resident {x['rss_mb']:.0f} vs "
                  f"{b['rss_mb']:.0f} MB, weights {sum(x['weights_mb'].values()):.0f} vs "
                  f"{sum(b['weights_mb'].values()):.0f} MB")
        if "int4 kv8" in qr:
            x, i4 = qr["int4 kv8"], qr["int4"]
            print(f"  int4 kv8 vs int4 (int8 KV cache) W64 {i4['w64'] / x['w64']:.2f}x ({x['w64']:.1f} vs "
                  f"{i4['w64']:.1f} s), decode {x['decode'] / i4['decode']:.2f}x, "
                  f"pp512 {x['pp512'] / i4['pp512']:.2f}x")
        if "int4 bf16t" in qr:
            x, i4 = qr["int4 bf16t"], qr["int4"]
            print(f"  int4 bf16t vs int4 (MII_QUANT_TILES=bf16) W64 {i4['w64'] / x['w64']:.2f}x ({x['w64']:.1f} vs "
                  f"{i4['w64']:.1f} s), pp512 {x['pp512'] / i4['pp512']:.2f}x, time to first token "
                  f"{x['ttft'] * 1e3:.0f} vs {i4['ttft'] * 1e3:.0f} ms, decode {x['decode'] / i4['decode']:.2f}x")
    print(f"  single-stream decode      {r['decode']:7.1f} tok/s = {r['decode'] / bw_floor:5.1%} of the weight-bandwidth "
          f"floor ({bw_floor:.0f} tok/s)")
    if llama:
        f = llama["file"]
        same = "tg256@d128"  # our single stream's workload: 256 tokens after a 128-token context
        def versus(label, ours, theirs):
            print(f"  {label:<25} decode {ours['decode'] / theirs[same]:.2f}x its {same} ({ours['decode']:.1f} vs "
                  f"{theirs[same]:.1f} tok/s), from an empty context {ours['tg128'] / theirs['tg128']:.2f}x its tg128 "
                  f"({ours['tg128']:.1f} vs {theirs['tg128']:.1f}); pp512 {ours['pp512'] / theirs['pp512']:.2f}x "
                  f"({theirs['pp512']:.0f} tok/s)", flush=True)

        versus("vs llama.cpp, same GGUF", r, f)
        if "quant" in results:
            versus("int4 a8 vs llama.cpp", results["quant"]["int4 a8"], f)
            print("  (int4 a8: quantize_activations, int8-rounded inputs as llama.cpp's Q8 activations)")
        if "BF16" in llama and "quant" in results:
            versus("vs llama.cpp, bf16", results["quant"]["bf16"], llama["BF16"])
        for label, d in duel.items():
            pairs = sorted(m / l for m, l in zip(d["mii"], d["llama.cpp"]))
            print(f"  decode vs llama.cpp, {label:<4} {pairs[len(pairs) // 2]:.2f}x, alternated pair by pair (each pair: "
                  f"{', '.join(f'{x:.2f}x' for x in pairs)}; median mii {np.median(d['mii']):.1f} vs "
                  f"{np.median(d['llama.cpp']):.1f} tok/s)")
    print(f"  time to first token       {r['ttft'] * 1000:7.0f} ms (128-token prompt)")
    if r.get("pace") is not None:
        print(f"  thread pace               [threads, drops, tries, kept] {r['pace']}"
              + (": other processes took the threads' cores, a busy machine's numbers" if r["pace"][1] else ""))
    print(f"  pp512                     {r['pp512']:7.0f} tok/s")
    if cold is not None:
        print(f"  start-up                  cold {cold:.1f} s (empty cache: GGUF conversion, kernel build, packed weights written), warm {warm:.1f} s")

    labels = {"mii": "mii", "torch": "mii, torch backends", "dtype": f"mii, dtype={args.compare_dtype}"}
    systems = {labels[k]: v for k, v in results.items() if k != "quant"}
    systems.update({f"mii, {k} weights": v for k, v in results.get("quant", {}).items()})
    if hf:
        systems["transformers"] = {"w64": hf}
    report = {"workload": {"requests": len(prompts), "prompt_tokens": n_in, "output_tokens": n_out},
              "threads": threads, "plan": {"dtype": plan.dtype, "weights": plan.weight_dtype,
                                           "attention": plan.attention, "linears": plan.linear_backend},
              "floors": {"w64_s": floor, "decode_tok_s": bw_floor}, "probes": probes, "systems": systems,
              "startup_s": {"cold": cold, "warm": warm}, "llama.cpp": llama,
              "decode_alternated": duel}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        from bench.plots import plot_throughput

        plot_throughput(report, args.plot)


if __name__ == "__main__":
    main()
