"""Speed on a CPU that other processes keep busy: the embedded model's single stream (128-token prompt, 128 new
tokens, three requests after a warm-up) and a batch (32 prompts of 64 tokens, 64 new tokens each) with CPU-bound
processes beside it (one per core less one, at least one), each configuration in a fresh process, configurations
alternated round after round. Three of them: the default (the steps' thread pace takes fewer threads while the
steps' calling thread loses too much of its time), `MII_THREAD_PACE=0` (always the plan's threads) and
`num_threads=1`; then the default and `MII_THREAD_PACE=0` on the idle machine, where the pace must cost nothing.
Prints each process's decode tokens/s (after the first token), time to first token and the batch's wall time, and
the pace's ratios to the others within each round: only same-round ratios count on a shared machine.

    .venv/bin/python -m bench.shared_cpu [--rounds 2] [--busy N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
import mii, torch
from bench.throughput import fresh_prompt
threads = int(sys.argv[1])
pipe = mii.pipeline(**({"num_threads": threads} if threads else {}))
held = pipe.engine.loaded.model.model.stack
held = held["held"] if held else None
pipe(fresh_prompt(128), max_new_tokens=64, ignore_eos=True, do_sample=False)  # warm-up: the pace settles too
rates, ttfts = [], []
for _ in range(3):
    start, n = time.perf_counter(), 0
    for _ in pipe.stream(fresh_prompt(128), max_new_tokens=128, ignore_eos=True, do_sample=False):
        n += 1
        if n == 1:
            first = time.perf_counter()
    rates.append((n - 1) / (time.perf_counter() - first))
    ttfts.append((first - start) * 1e3)
pace = torch.ops.mii.stack_pace(held) if held is not None else None
start = time.perf_counter()
pipe([fresh_prompt(64) for _ in range(32)], max_new_tokens=64, ignore_eos=True, do_sample=False)
batch = time.perf_counter() - start
batch_pace = torch.ops.mii.stack_pace(held) if held is not None else None
print(json.dumps({"decode": rates, "ttft": ttfts, "pace": pace, "batch": batch, "batch_pace": batch_pace}))
pipe.destroy()
"""

CONFIGS = {  # name: (env additions, num_threads; 0 = the plan's)
    "pace": ({}, 0),
    "no pace": ({"MII_THREAD_PACE": "0"}, 0),
    "1 thread": ({}, 1),
}


def measure(name: str) -> dict:
    env_add, threads = CONFIGS[name]
    env = dict(os.environ, PYTHONPATH=REPO, **env_add)
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads)], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def line(name: str, r: dict) -> str:
    return (f"  {name:9s} decode {' '.join(f'{x:6.1f}' for x in r['decode'])} tok/s (median "
            f"{statistics.median(r['decode']):6.1f}), first token {statistics.median(r['ttft']):5.0f} ms, pace "
            f"[threads, drops, tries, kept] {r['pace']}; batch {r['batch']:5.2f} s, pace {r['batch_pace']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                    help="CPU-bound processes beside the busy rounds (default: one per core less one)")
    args = ap.parse_args()
    print(f"{args.busy} CPU-bound process(es) beside the busy rounds; {len(os.sched_getaffinity(0))} cores")
    for rnd in range(1, args.rounds + 1):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            time.sleep(0.5)
            got = {name: measure(name) for name in CONFIGS}
        finally:
            for p in busy:
                p.kill()
                p.wait()
        med = {k: statistics.median(v["decode"]) for k, v in got.items()}
        ttft = {k: statistics.median(v["ttft"]) for k, v in got.items()}
        wall = {k: v["batch"] for k, v in got.items()}
        print(f"round {rnd}, busy:")
        for name, r in got.items():
            print(line(name, r))
        print(f"  pace / no pace: decode {med['pace'] / med['no pace']:.2f}x, first token "
              f"{ttft['no pace'] / ttft['pace']:.2f}x sooner, batch {wall['no pace'] / wall['pace']:.2f}x sooner; "
              f"pace / 1 thread: decode {med['pace'] / med['1 thread']:.2f}x, batch "
              f"{wall['1 thread'] / wall['pace']:.2f}x")
        idle = {name: measure(name) for name in ("pace", "no pace")}
        med = {k: statistics.median(v["decode"]) for k, v in idle.items()}
        print(f"round {rnd}, idle:")
        for name, r in idle.items():
            print(line(name, r))
        print(f"  pace / no pace: decode {med['pace'] / med['no pace']:.3f}x, "
              f"batch {idle['no pace']['batch'] / idle['pace']['batch']:.3f}x sooner")


if __name__ == "__main__":
    main()
