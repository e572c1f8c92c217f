"""The scheduler and `itl_target_ms` (`mii.engine.pacing`) on a modelled clock: `bench/serve.py`'s workload and SLA
without a server, a model or the noise of a shared machine, so that scheduling policies can be compared over many
arrival draws in seconds.

    .venv/bin/python -m bench.pacing_sim                       # no target, then 16 ms; rates 0.5,1,1.5; 8 draws each
    .venv/bin/python -m bench.pacing_sim --targets 14,16,18 --noise 0.25 --sla-decode 55

The real `Scheduler` and `Pacer` run on W64's requests (32 per rate, `bench.serve.arrivals`, prefix caching off);
each step takes the time a cost table gives for its rows (interpolated), plus `--per-sampled-ms` for each token it
samples (what streaming one token costs a server's other processes on the same cores), times 1 + `--noise` x a
standard normal clipped to [-1, 3]. The default table is the embedded model's served steps on the 2-core Zen 4
EPYC (session 46: a step of that many rows in the pipeline, a prompt chunk alone or 1-4 decode rows, plus 2.5 ms
of serving around each step): replace it with `--costs
ROWS:MS,...` measured on your machine. Every request is scored by `bench.serve.SLA` (first token within
`--sla-overhead-ms` + prompt / `--sla-prefill`, generation EMA at least `--sla-decode` tok/s). It prints the share of
requests within the SLA per target and rate and why the others missed it. A model, not a measurement: what it
ranks still has to hold in `bench/serve.py` against a real server.
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.serve import SLA, Result, arrivals
from bench.workloads import w64
from mii.engine.kv_cache import KVCacheManager
from mii.engine.pacing import Pacer
from mii.engine.scheduler import Scheduler
from mii.engine.sequence import Sequence

ZEN4_SERVED_MS = "1:7,2:8,4:9,8:13.4,16:22.5,32:33.1,48:42.8,64:50.2,128:95.8,256:186.1,512:372.5"


def simulate(rate: float, target_ms: float | None, costs: list[tuple[int, float]], *, requests: int = 32,
             seed: int = 0, budget: int = 256, per_sampled_s: float = 0.001, noise: float = 0.1) -> list[Result]:
    """One rate's requests through the scheduler (and a pacer when `target_ms` is set) on the modelled clock."""
    rng = np.random.default_rng(seed + 7)
    xs, ys = zip(*costs)
    prompts, outputs = w64()
    reqs = [(len(prompts[i % 64]), outputs[i % 64]) for i in range(requests)]
    at = arrivals(requests, rate, seed)
    sched = Scheduler(KVCacheManager(4096, 32, prefix_caching=False), budget, 512)
    pacer = Pacer(target_ms) if target_ms is not None else None
    now, added, seqs, times = 0.0, 0, {}, {}
    while added < requests or len(sched):
        while added < requests and at[added] <= now:
            p, o = reqs[added]
            seqs[added] = Sequence(added, list(range(1000 + added, 1000 + added + p)), p + o)
            sched.add(seqs[added])
            times[added] = [float(at[added])]
            added += 1
        if not len(sched):
            now = float(at[added])
            continue
        started = now
        batch = sched.schedule() if pacer is None else pacer.schedule(sched, started)
        sampled = {c.seq.uid: 7 for c in batch.chunks if c.samples}
        step = float(np.interp(batch.num_tokens, xs, ys)) + per_sampled_s * len(sampled)
        now += step * (1 + noise * min(max(rng.standard_normal(), -1.0), 3.0))
        sched.update(batch, sampled)
        for uid in sampled:
            times[uid].append(now)
            if seqs[uid].num_tokens >= seqs[uid].max_total:
                sched.finish(seqs[uid])
                if pacer is not None:
                    pacer.forget(uid)
        if pacer is not None:
            pacer.stepped(batch, started, now)
    return [Result(p, o, start=times[i][0], chunk_times=times[i][1:], end=times[i][-1], prompt_tokens=p,
                   completion_tokens=o) for i, (p, o) in enumerate(reqs)]


def parse_costs(text: str) -> list[tuple[int, float]]:
    pts = sorted((int(r), float(ms) / 1000) for r, ms in (item.split(":") for item in text.split(",")))
    if len(pts) < 2 or any(t <= 0 for _, t in pts):
        raise argparse.ArgumentTypeError("--costs needs at least two ROWS:MS pairs with positive times")
    return pts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.pacing_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="16", help="itl_target_ms values to compare with no target (comma list)")
    ap.add_argument("--rates", default="0.5,1,1.5")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--draws", type=int, default=8, help="arrival draws (seeds) per rate")
    ap.add_argument("--costs", type=parse_costs, default=parse_costs(ZEN4_SERVED_MS), metavar="ROWS:MS,...")
    ap.add_argument("--budget", type=int, default=256, help="the token budget (max_ragged_batch_size)")
    ap.add_argument("--per-sampled-ms", type=float, default=1.0)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--sla-overhead-ms", type=float, default=65.0)
    ap.add_argument("--sla-prefill", type=float, default=317.0)
    ap.add_argument("--sla-decode", type=float, default=55.0)
    args = ap.parse_args(argv)
    sla = SLA(args.sla_overhead_ms / 1000, args.sla_prefill, args.sla_decode, 16, "given")
    print(f"SLA: {sla.describe()}")
    report = {"sla": sla.describe(), "rows": []}
    for target in [None] + [float(t) for t in args.targets.split(",") if t]:
        cells = []
        for rate in (float(r) for r in args.rates.split(",")):
            misses = [sla.miss(r) for seed in range(args.draws)
                      for r in simulate(rate, target, args.costs, requests=args.requests, seed=seed,
                                        budget=args.budget, per_sampled_s=args.per_sampled_ms / 1000,
                                        noise=args.noise)]
            row = {"target_ms": target, "rate": rate, "met": misses.count(None) / len(misses),
                   "first_token": misses.count("first token"), "token_gap": misses.count("token gap")}
            report["rows"].append(row)
            cells.append(f"{rate:g} req/s {row['met']:4.0%} (first token {row['first_token']}, "
                         f"gap {row['token_gap']})")
        print(f"{'no target' if target is None else f'{target:g} ms':>10}: " + " | ".join(cells), flush=True)
    return report


if __name__ == "__main__":
    main()
