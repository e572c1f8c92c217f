"""The GPU check (run by scripts/gpu_check.sh on a machine with an NVIDIA GPU): tests on `cuda`, a served request
through the `openai` client, and benchmarks with absolute numbers. Every part runs in its own try; the results,
failures included, go to OUT/gpu_check.json after each part, and a summary table is printed at the end.

Stages (so the check can run in two calls when the embedded model's 98 MB GGUF must travel in two halves):
  1  no SmolLM2 weights needed: machine probes, kernel/graph/family tests on cuda (fp32, bf16, fp16), and
     benchmarks on a ~1B random Llama (batch-1 decode with and without CUDA graphs, where its step's time goes, and
     4,096-token prefill)
  2  SmolLM2-135M-Instruct (the real GGUF): pipeline tests on cuda, a served request through `openai`, W64 against
     `transformers` `generate` (static batches), batch-1 decode with/without graphs and prefill

    python -m bench.gpu_check --out DIR [--stage all|1|2]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

RESULTS: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}
OUT = Path(".")
WORK = Path(os.environ.get("MII_GPU_WORK", "/tmp/mii-gpu"))  # scripts/gpu_check.sh's scratch folder
KV_ALLOCATE = {"mode": "allocate", "size": 16384}  # 16k blocks: plenty for each benchmark, leaves the GPU to peers


def save() -> None:
    (OUT / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))


DEADLINE = float("inf")
ONLY: list[str] = []


def left() -> float:
    return DEADLINE - time.monotonic()


def part(name: str, fn, *args, need: float = 20, **kw):
    """Run one part; record its result or its failure. Skipped when less than `need` seconds are left."""
    t = time.perf_counter()
    print(f"\n=== {name} ({left():.0f} s left)", flush=True)
    if ONLY and not any(o in name for o in ONLY):
        RESULTS["parts"][name] = {"ok": False, "skipped": True, "error": f"not selected by --only {','.join(ONLY)}"}
        save()
        return RESULTS["parts"][name]
    if left() < need:
        RESULTS["parts"][name] = {"ok": False, "skipped": True, "error": f"{left():.0f} s left, needs {need:.0f}"}
        save()
        return RESULTS["parts"][name]
    try:
        value = fn(*args, **kw)
        RESULTS["parts"][name] = {"ok": True, "seconds": round(time.perf_counter() - t, 1), **(value or {})}
    except BaseException as e:  # noqa: BLE001  (a part's failure is a result; KeyboardInterrupt stops the rest)
        RESULTS["parts"][name] = {"ok": False, "seconds": round(time.perf_counter() - t, 1),
                                  "error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        traceback.print_exc()
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        torch.cuda.empty_cache()
    print(f"=== {name}: {json.dumps(RESULTS['parts'][name], default=str)[:1500]}", flush=True)
    save()
    return RESULTS["parts"][name]


# --- probes -------------------------------------------------------------------------------------------------------

def cuda_time(fn, repeat: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeat


def probe_machine() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tflops = 2 * n ** 3 / cuda_time(lambda: a @ b) / 1e12
    del a, b
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() / cuda_time(lambda: dst.copy_(src)) / 1e12  # bytes read + written
    del src, dst
    return {"gpu": props.name, "capability": f"sm{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "python": sys.version.split()[0],
            "bf16_matmul_tflops": round(tflops, 1), "copy_tb_per_s": round(copy_tbs, 2)}


# --- tests --------------------------------------------------------------------------------------------------------

def run_pytest(name: str, args: list, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.gpu_pytest_plugin", "-rfE",
           f"--junitxml={OUT / (name + '.xml')}", *args]
    print(" ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10, min(timeout, left() - 15)))
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    print(out[-6000:], flush=True)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", last)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    result = {"returncode": rc, **counts, "failed_tests": failed[:40]}
    if rc not in (0, 5):
        raise AssertionError(f"pytest {name}: rc={rc}, {counts}, failed: {failed[:10]}")
    return result


# --- models -------------------------------------------------------------------------------------------------------

def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer in Hugging Face format, read from the (possibly tokenizer-only) embedded GGUF."""
    import mii
    from transformers import AutoTokenizer

    out = WORK / "tokenizer"
    if not (out / "tokenizer.json").exists():
        path = Path(mii.default_model())
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    return out


def random_llama_1b() -> Path:
    """A Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, tied embeddings) with
    SmolLM2's 49,152-token vocabulary (so every id detokenizes): 1.07B parameters, random bf16 weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = WORK / "llama-1b-random"
    if (path / "config.json").exists():
        return path
    cfg = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=True, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    for f in tokenizer_dir().iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return path


def pipeline(model, **kw):
    import mii

    ie = {"state_manager": {"memory_config": KV_ALLOCATE, **kw.pop("state_manager", {})}}
    return mii.pipeline(model, dtype=kw.pop("dtype", "bfloat16"), inference_engine_config=ie, **kw)


def param_bytes(pipe) -> int:
    seen, total = set(), 0
    for p in pipe.engine.loaded.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_seconds(pipe, prompt: list, new_tokens: int, prof=None) -> float:
    """Seconds from the first streamed token to the last (the decode steps), `prof` (a torch profiler) running over
    exactly those."""
    first = None
    torch.cuda.synchronize()
    for _chunk in pipe.stream(prompt, max_new_tokens=new_tokens, ignore_eos=True, do_sample=False):
        if first is None:
            if prof is not None:
                torch.cuda.synchronize()
                prof.start()
            first = time.perf_counter()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - first
    if prof is not None:
        prof.stop()
    return seconds


def decode_b1(model, graphs: bool, prompt_len: int = 128, new_tokens: int = 256, profile: bool = False) -> dict:
    """Batch-1 greedy decode: tokens/s after the first token (a `prompt_len`-token prompt). With `profile`, then
    where a step's time goes: the GPU's kernels and copies over one more such decode (the profiler's CUDA activity,
    which records the kernels a graph replays) against the timed step (kernel_table)."""
    pipe = pipeline(model, cuda_graphs=graphs)
    try:
        prompt = np.random.default_rng(1).integers(1000, 40000, prompt_len).tolist()
        pipe(prompt, max_new_tokens=16, ignore_eos=True, do_sample=False)  # warm-up
        best = max((new_tokens - 1) / decode_seconds(pipe, prompt, new_tokens) for _ in range(2))
        res = {"decode_tok_per_s": round(best, 1), "ms_per_token": round(1000 / best, 3),
               "cuda_graphs": pipe.engine.plan.cuda_graphs, "attention": pipe.engine.plan.attention,
               "param_bytes": param_bytes(pipe)}
        bw = RESULTS["parts"].get("machine", {}).get("copy_tb_per_s")
        if bw:  # the HBM floor: every weight read once per token, at the measured copy bandwidth
            floor = bw * 1e12 / res["param_bytes"]
            res["hbm_floor_tok_per_s"] = round(floor, 1)
            res["fraction_of_hbm_floor"] = round(best / floor, 3)
        if profile:
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as profiler

            prof = profiler(activities=[ProfilerActivity.CUDA])
            decode_seconds(pipe, prompt, new_tokens, prof)
            acts = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
            res["profile"] = (kernel_table(acts, new_tokens - 1, 1e6 / best) if acts
                              else {"error": "the profiler recorded no CUDA activity"})
        return res
    finally:
        pipe.destroy()


def kernel_table(kernels, steps: int, step_us: float, top: int = 12) -> dict:
    """(name, microseconds) of every GPU activity the profiler saw over `steps` decode steps (kernels, copies) and
    the step's wall time measured without the profiler -> per step: the activities' count and time, the share of the
    step the GPU computed (the rest it waited on the host: scheduling, the metadata's copies, sampling's sync, the
    stream's detokenizing), and the `top` activities by time."""
    by: dict = {}
    for name, us in kernels:
        n, t = by.get(name, (0, 0.0))
        by[name] = (n + 1, t + us)
    busy = sum(t for _, t in by.values()) / steps
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return {"steps": steps, "wall_us_per_step": round(step_us, 1),
            "kernels_per_step": round(sum(n for n, _ in by.values()) / steps, 1),
            "kernel_us_per_step": round(busy, 1), "gpu_busy": round(busy / step_us, 3),
            "top": [{"kernel": k[:120], "per_step": round(n / steps, 2), "us_per_step": round(t / steps, 1)}
                    for k, (n, t) in rows]}


def prefill(model, prompt_len: int = 4096, n: int = 8, budget: int = 768) -> dict:
    """Prefill tokens/s: `n` prompts of `prompt_len` tokens, one output token each, token budget `budget`."""
    pipe = pipeline(model, state_manager={"max_ragged_batch_size": budget})
    try:
        rng = np.random.default_rng(2)
        prompts = [rng.integers(1000, 40000, prompt_len).tolist() for _ in range(n)]
        pipe(prompts[:2], max_new_tokens=1, ignore_eos=True, do_sample=False)  # warm-up: kernels compiled
        torch.cuda.synchronize()
        t = time.perf_counter()
        pipe(prompts, max_new_tokens=1, ignore_eos=True, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        return {"prefill_tok_per_s": round(n * prompt_len / wall, 0), "seconds": round(wall, 3), "budget": budget,
                "prompts": n, "prompt_len": prompt_len}
    finally:
        pipe.destroy()


DECODE_TILES = [dict(BLOCK_N=64, num_warps=4), dict(BLOCK_N=64, num_warps=8), dict(BLOCK_N=32, num_warps=4),
                dict(BLOCK_N=32, num_warps=8)]


def attention_tiles(device: str = "cuda", seqs=(1, 64), context: int = 2048, head_dims=(64, 128),
                    heads: int = 32, kv_heads: int = 8, block_size: int = 32, timer=None) -> dict:
    """The decode attention kernel's time for each of DECODE_TILES (the first is tile_config's), bf16, per head size
    and batch: the sm90 compile showed head size 128 spilling at BLOCK_N 64 / 4 warps (255 registers and 64 bytes
    of stack) where 8 warps or BLOCK_N 32 do not; the results say which to keep. Every config's output is checked
    against the first's."""
    from mii.kernels import paged_attention_cuda as pac

    timer = timer or cuda_time
    chosen, out = pac.tile_config, {}
    g = torch.Generator(device="cpu").manual_seed(3)
    try:
        for d in head_dims:
            for s in seqs:
                blocks_per_seq = context // block_size
                k_cache, v_cache = (torch.randn(s * blocks_per_seq, kv_heads, block_size, d, generator=g)
                                    .to(device, torch.bfloat16) for _ in range(2))
                q = torch.randn(s, heads, d, generator=g).to(device, torch.bfloat16)
                tables = torch.randperm(s * blocks_per_seq, generator=g).view(s, blocks_per_seq).to(device,
                                                                                                   torch.int32)
                lens = torch.full((s,), context, dtype=torch.int32, device=device)
                starts = torch.arange(s + 1, dtype=torch.int32, device=device)
                first, times = None, []
                for tiles in DECODE_TILES:
                    pac.tile_config = lambda group, decode, head_dim, tiles=tiles: (
                        dict(chosen(group, decode, head_dim), **tiles) if decode else chosen(group, decode, head_dim))
                    run = lambda: pac.paged_attention(q, k_cache, v_cache, tables, lens, starts, 1, s, s, d ** -0.5)
                    y = run()
                    if first is None:
                        first = y
                    torch.testing.assert_close(y.float(), first.float(), rtol=2e-2, atol=2e-2)
                    times.append(round(timer(run) * 1e6, 1))
                kv_bytes = 2 * s * context * kv_heads * d * 2
                out[f"d{d} seqs{s}"] = {"us": dict(zip([f"N{t['BLOCK_N']}w{t['num_warps']}" for t in DECODE_TILES],
                                                       times)),
                                        "kv_gb_per_s_best": round(kv_bytes / (min(times) * 1e-6) / 1e9, 1)}
    finally:
        pac.tile_config = chosen
    return {"decode_attention": out, "context": context}


# --- stage 2: SmolLM2 -----------------------------------------------------------------------------------------------

def w64_mii(budget: int = 768) -> dict:
    from bench.workloads import w64

    prompts, outputs = w64()
    pipe = pipeline(None, state_manager={"max_ragged_batch_size": budget})
    try:
        pipe(prompts[:8], max_new_tokens=8, ignore_eos=True, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = pipe(prompts, max_new_tokens=outputs, ignore_eos=True, do_sample=False)
        wall = time.perf_counter() - t
        assert [r.generated_length for r in res] == outputs
        return {"seconds": round(wall, 3), "output_tok_per_s": round(sum(outputs) / wall, 0),
                "total_tok_per_s": round((sum(map(len, prompts)) + sum(outputs)) / wall, 0), "budget": budget,
                "plan": pipe.engine.plan.describe()}
    finally:
        pipe.destroy()


def w64_transformers(batches=(64, 16)) -> dict:
    import mii
    from bench.workloads import w64
    from transformers import AutoModelForCausalLM

    prompts, outputs = w64()
    path = Path(mii.default_model())
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    model = model.cuda().eval()
    model.generation_config.eos_token_id = None

    def run(ps, os_):
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device="cuda")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_),
                       do_sample=False, pad_token_id=0)

    res = {}
    with torch.inference_mode():
        run(prompts[:8], [8] * 8)  # warm-up
        for batch in batches:
            if left() < 40:
                break
            torch.cuda.synchronize()
            t = time.perf_counter()
            for s in range(0, len(prompts), batch):
                run(prompts[s: s + batch], outputs[s: s + batch])
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            res[f"batch {batch}"] = {"seconds": round(wall, 3), "output_tok_per_s": round(sum(outputs) / wall, 0)}
    best = min(res.values(), key=lambda r: r["seconds"])
    return {**res, "seconds": best["seconds"], "output_tok_per_s": best["output_tok_per_s"]}


def served_openai() -> dict:
    import socket

    import mii
    import openai

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    http, grpc_port = free_port(), free_port()
    t = time.perf_counter()
    client = mii.serve(deployment_name="gpu-check", enable_restful_api=True, restful_api_port=http,
                       port_number=grpc_port, dtype="bfloat16",
                       inference_engine_config={"state_manager": {"memory_config": KV_ALLOCATE}})
    started = time.perf_counter() - t
    try:
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=120)
        model = oai.models.list().data[0].id
        chat = oai.chat.completions.create(model=model, max_tokens=30, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = chat.choices[0].message.content
        stream = oai.completions.create(model=model, prompt="Seattle is", max_tokens=16, stream=True, temperature=0)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        grpc_text = client.generate("DeepSpeed is", max_new_tokens=16, do_sample=False)[0].generated_text
        assert "Paris" in text, text
        return {"start_seconds": round(started, 1), "chat": text, "stream": streamed, "grpc": grpc_text}
    finally:
        client.terminate_server()


# --- summary --------------------------------------------------------------------------------------------------------

def summary() -> str:
    p = RESULTS["parts"]
    rows = []
    for name, r in p.items():
        if not r.get("ok"):
            rows.append((name, "skipped" if r.get("skipped") else "FAILED", r.get("error", "")[:90]))
            continue
        if "passed" in r or "failed" in r:
            v = f"{r.get('passed', 0)} passed, {r.get('failed', 0)} failed, {r.get('skipped', 0)} skipped"
        elif "decode_tok_per_s" in r:
            v = f"{r['decode_tok_per_s']} tok/s ({r['ms_per_token']} ms/token)"
            if "fraction_of_hbm_floor" in r:
                v += f", {r['fraction_of_hbm_floor']:.0%} of the HBM floor ({r['hbm_floor_tok_per_s']} tok/s)"
            if "kernel_us_per_step" in r.get("profile", {}):
                k = r["profile"]
                v += (f"; a step: {k['kernels_per_step']} kernels, {k['kernel_us_per_step']} us of them (GPU busy "
                      f"{k['gpu_busy']:.0%}), most " + ", ".join(f"{t['kernel'][:24]} {t['us_per_step']}"
                                                               for t in k["top"][:3]))
        elif "prefill_tok_per_s" in r:
            v = f"{r['prefill_tok_per_s']:.0f} tok/s (budget {r['budget']})"
        elif "output_tok_per_s" in r:
            v = f"{r['seconds']} s, {r['output_tok_per_s']:.0f} output tok/s"
        elif "gpu" in r:
            v = f"{r['gpu']} {r['capability']}, bf16 {r['bf16_matmul_tflops']} TFLOP/s, copy {r['copy_tb_per_s']} TB/s"
        else:
            v = json.dumps({k: x for k, x in r.items() if k not in ("ok", "seconds", "plan")}, default=str)[:90]
        rows.append((name, f"{r.get('seconds', '')} s", v))
    mii_w64 = p.get("w64 mii", {})
    best_peer = p.get("w64 transformers", {}).get("seconds")
    if mii_w64.get("ok") and best_peer:
        RESULTS["w64_speedup_vs_transformers"] = round(best_peer / mii_w64["seconds"], 2)
        ratio = best_peer / mii_w64["seconds"]
        rows.append(("W64 ratio", "", f"mii is {ratio:.1f}x transformers generate (its best batch size)"))
    width = max(len(r[0]) for r in rows) if rows else 10
    return "\n".join(f"{a:<{width}}  {b:>8}  {c}" for a, b, c in rows)


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", default="all", choices=["all", "1", "2"])
    ap.add_argument("--seconds", type=float, default=420, help="time for this run; parts that do not fit are skipped")
    ap.add_argument("--only", default="", help="comma-separated parts to run (substrings of their names); all if empty")
    args = ap.parse_args()
    global DEADLINE, ONLY
    ONLY = [o for o in args.only.split(",") if o]
    DEADLINE = time.monotonic() + args.seconds
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    prev = OUT / "gpu_check.json"
    if prev.exists():  # a later stage adds to the same file
        RESULTS.update(json.loads(prev.read_text()))
    RESULTS.setdefault("stages", []).append(args.stage)
    if not torch.cuda.is_available():
        RESULTS["error"] = "no GPU visible to torch"
        save()
        print("no GPU visible to torch")
        return 1
    full_model = os.environ.get("MII_GPU_TOKENIZER_ONLY") != "1"
    RESULTS["smollm2_weights"] = full_model
    if args.stage in ("all", "1"):
        part("machine", probe_machine)
        part("tests: kernels, graphs, plan on cuda", run_pytest, "kernels",
             ["tests/kernels/test_paged_attention_cuda.py", "tests/kernels/test_fused_cuda.py",
              "tests/engine/test_cuda_graphs.py", "tests/engine/test_gpu_plan.py"], 150, need=40)
        model = part("random 1B model", lambda: {"path": str(random_llama_1b())}, need=60)
        if model["ok"]:
            path = model["path"]
            part("1B decode b1 graphs", decode_b1, path, True, profile=True, need=30)
            part("1B decode b1 eager", decode_b1, path, False, need=30)
            part("1B prefill 4096 budget 768", prefill, path, need=25)
            part("1B prefill 4096 budget 8192", prefill, path, budget=8192, need=25)
        part("decode attention tiles", attention_tiles, need=20)
        part("tests: families fp32 on cuda", run_pytest, "families", ["tests/models"], 200, need=40)
        part("tests: families bf16/fp16 on cuda", run_pytest, "half", ["tests/gpu"], 120, need=30)
    if args.stage in ("all", "2"):
        if not full_model:
            RESULTS["parts"]["smollm2"] = {"ok": False, "error": "the SmolLM2 GGUF did not arrive (tokenizer only)"}
        else:
            part("served openai request", served_openai, need=60)
            part("w64 mii", w64_mii, need=30)
            part("w64 mii budget 2048", w64_mii, 2048, need=30)
            part("w64 transformers", w64_transformers, need=60)
            part("SmolLM2 decode b1 graphs", decode_b1, None, True, need=25)
            part("SmolLM2 decode b1 eager", decode_b1, None, False, need=25)
            part("SmolLM2 prefill 4096", prefill, None, need=25)
            part("tests: pipeline on cuda (SmolLM2 fp32)", run_pytest, "pipeline", ["tests/api/test_pipeline.py"], 200,
                 need=40)
    table = summary()
    RESULTS["summary"] = table
    save()
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
