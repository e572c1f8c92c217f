"""Automatic prefix caching, on vs off in one run (issue 12), on the embedded SmolLM2 by default:

- shared prefixes: 64 requests, 8 system prompts of 1,024 tokens each followed by 8 different 64-token
  questions, 64 output tokens each (greedy, EOS ignored), all submitted at once: wall time, output tokens/s and
  mean time to first token; and one question alone on a system prompt never seen (uncached) vs on one already
  seen (cached): its time to first token;
- multi-turn chat: one conversation, each turn resending it whole (a 256-token system prompt, then per turn a
  64-token user message and the 32-token answer): time to first token per turn;
- W64 (SPEC §7, nothing shared): wall time.

Targets: >= 3x throughput on shared prefixes, a cached request's first token in < 1/5 of the uncached one's,
flat TTFT over the turns, W64 at most 2% slower. Ratios are the result (absolute times depend on the machine and
its load). `--quick` runs every part at a small scale.

    .venv/bin/python -m bench.prefix [--quick] [--dtype auto] [--threads N] [--json results.json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import mii
from bench.workloads import w64

GEN = dict(ignore_eos=True, do_sample=False)


def shared_prefix_workload(systems: int, questions: int, system_len: int, question_len: int, seed: int):
    """Prompts (token ids), system prompt by system prompt: each system prompt followed by its questions."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(1000, 40000, system_len).tolist() for _ in range(systems)]
    return [h + rng.integers(1000, 40000, question_len).tolist() for h in heads for _ in range(questions)]


def timed_stream(pipe, prompts, new_tokens) -> tuple[float, list[float]]:
    """(wall time, each request's time to first token) for `prompts` submitted at once."""
    t = time.perf_counter()
    first = [None] * len(prompts)
    for chunk in pipe.stream(prompts, max_new_tokens=new_tokens, **GEN):
        now = time.perf_counter() - t
        for i, r in enumerate(chunk):
            if first[i] is None and r.generated_length > 0:
                first[i] = now
    return time.perf_counter() - t, first


def ttft_alone(pipe, prompt, new_tokens: int = 2) -> float:
    t = time.perf_counter()
    for _ in pipe.stream(prompt, max_new_tokens=new_tokens, **GEN):
        return time.perf_counter() - t


def run_shared(pipe, args, seed: int) -> dict:
    prompts = shared_prefix_workload(args.systems, args.questions, args.system_len, args.question_len, seed)
    wall, first = timed_stream(pipe, prompts, args.output_len)
    # one question alone: on a new system prompt, then another on the same system prompt
    probe = shared_prefix_workload(1, 2, args.system_len, args.question_len, seed + 1000)
    uncached, cached = ttft_alone(pipe, probe[0]), ttft_alone(pipe, probe[1])
    return {"wall_s": wall, "tok_s": len(prompts) * args.output_len / wall, "ttft_mean_s": float(np.mean(first)),
            "ttft_alone_first_s": uncached, "ttft_alone_second_s": cached}


def run_chat(pipe, args, seed: int) -> list[float]:
    """Time to first token of each turn of one conversation, resent whole every turn."""
    rng = np.random.default_rng(seed)
    conversation = rng.integers(1000, 40000, args.chat_system_len).tolist()
    ttfts = []
    for _ in range(args.turns):
        conversation += rng.integers(1000, 40000, args.chat_user_len).tolist()
        t = time.perf_counter()
        first, answer = None, []
        for r in pipe.stream(conversation, max_new_tokens=args.chat_answer_len, **GEN):
            first = first or time.perf_counter() - t
            answer += r.token_ids or []
        ttfts.append(first)
        conversation += answer
    return ttfts


def run_w64(pipe, prompts, outputs) -> float:
    t = time.perf_counter()
    pipe(prompts, max_new_tokens=outputs, **GEN)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="every part at a small scale (a smoke test)")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--w64-repeats", type=int, default=2, help="W64 runs with caching on and off, in turns (best kept)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = ap.parse_args()
    scale = dict(systems=2, questions=4, system_len=256, question_len=32, output_len=16, turns=4, chat_system_len=128,
                 chat_user_len=32, chat_answer_len=16, w64=8) if args.quick else dict(
        systems=8, questions=8, system_len=1024, question_len=64, output_len=64, turns=8, chat_system_len=256,
        chat_user_len=64, chat_answer_len=32, w64=64)
    vars(args).update(scale)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    pipes = {mode: mii.pipeline(args.model, dtype=args.dtype, num_threads=threads,
                                enable_prefix_caching=mode == "on") for mode in ("on", "off")}
    plan = pipes["on"].engine_plan
    print(f"model {pipes['on'].engine.loaded.source.name}, {plan.dtype}, {threads} threads, token budget "
          f"{plan.max_batch_tokens}, KV blocks of {plan.kv_block_size}", flush=True)
    prompts, outputs = w64(args.w64)
    if args.quick:
        outputs = [min(o, 32) for o in outputs]
    for pipe in pipes.values():  # warm-up
        pipe(prompts[:4], max_new_tokens=4, **GEN)

    results = {}
    for mode, pipe in pipes.items():  # the same seeds: the same prompts, none cached before
        shared = run_shared(pipe, args, seed=1)
        chat = run_chat(pipe, args, seed=2)
        kv = pipe.engine.kv
        results[mode] = {"shared": shared, "chat_ttft_s": chat,
                         "prefix_cache": {"queried_tokens": kv.queried_tokens, "hit_tokens": kv.hit_tokens}}
        alone = shared["ttft_alone_first_s"] * 1000, shared["ttft_alone_second_s"] * 1000
        print(f"{mode:>3}: shared prefixes {shared['wall_s']:6.1f} s, {shared['tok_s']:6.1f} out tok/s, mean TTFT "
              f"{shared['ttft_mean_s'] * 1000:6.0f} ms; alone: new system prompt {alone[0]:5.0f} ms, seen "
              f"{alone[1]:5.0f} ms | chat TTFT per turn (ms) {' '.join(f'{x * 1000:.0f}' for x in chat)}", flush=True)
    # W64 on and off in turns (best of --w64-repeats each), so that a change in the machine's load hits both; each
    # run's prompts begin with a token of their own, so that no run finds the blocks an earlier one cached
    for i, mode in enumerate([m for _ in range(args.w64_repeats) for m in pipes]):
        wall = run_w64(pipes[mode], [[40001 + i] + p[1:] for p in prompts], outputs)
        results[mode]["w64_s"] = min(wall, results[mode].get("w64_s", wall))
        print(f"{mode:>3}: W64 {wall:6.1f} s", flush=True)
    for pipe in pipes.values():
        pipe.destroy()

    on, off = results["on"], results["off"]
    print("\nsummary (same-run ratios, caching on vs off)")
    print(f"  shared prefixes: throughput {on['shared']['tok_s'] / off['shared']['tok_s']:.2f}x (target >= 3x), mean "
          f"TTFT {off['shared']['ttft_mean_s'] / on['shared']['ttft_mean_s']:.2f}x lower")
    ratio = on["shared"]["ttft_alone_second_s"] / off["shared"]["ttft_alone_second_s"]
    print(f"  a cached request alone: TTFT {ratio:.2f} of the uncached one (target < 0.2)")
    print(f"  chat: last turn's TTFT / first turn's: on {on['chat_ttft_s'][-1] / on['chat_ttft_s'][0]:.2f}, "
          f"off {off['chat_ttft_s'][-1] / off['chat_ttft_s'][0]:.2f} (flat is ~1)")
    print(f"  W64: on / off wall time {on['w64_s'] / off['w64_s']:.3f} (target <= 1.02)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scale": scale, "threads": threads, "dtype": plan.dtype, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
