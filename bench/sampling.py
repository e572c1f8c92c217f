"""What sampling costs next to greedy decoding, in one run: per row, `mii::sample_race` (the CPU kernel) against the
torch path (`sample_torch`) on logits captured from the model's own decode steps, for MII's default (top_p 0.9),
temperature alone, top_k and min_p; the penalties' work per step, mii::penalize_ against the dense form; and end
to end, decode tokens/s of sampled, penalized and logprobs requests as ratios of the same engine's greedy decode, at
1 and 64 rows, alternated round by round so the machine's drift hits all alike. Ratios are the result: absolute
numbers depend on the machine and its load.

    .venv/bin/python -m bench.sampling [--model PATH] [--tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import mii
import mii.engine.model_runner as model_runner
from mii.engine.sampler import SamplingBatch, _penalties_dense, apply_penalties, sample_torch

PROMPTS = ["Write a short story about a lighthouse keeper.", "What is the capital of France?",
           "def fibonacci(n):", "List three colors and what they mean."]
KERNEL_CASES = {"top_p 0.9 (MII's default)": dict(top_p=0.9), "temperature 1 alone": {}, "top_k 50": dict(top_k=50),
                "min_p 0.05": dict(min_p=0.05)}


def captured_logits(pipe) -> torch.Tensor:
    """[N, V] float32 logits of the model's own sampled decode steps."""
    rows, sample = [], model_runner.sample

    def spy(logits, sb):
        rows.append(logits.float().clone())
        return sample(logits, sb)

    model_runner.sample = spy
    try:
        pipe([pipe.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS], max_new_tokens=16,
             do_sample=True, seed=1)
    finally:
        model_runner.sample = sample
    return torch.cat(rows)


def batch_of(S: int, V: int, temperature=1.0, top_p=1.0, top_k=None, min_p=0.0) -> SamplingBatch:
    full = lambda v, dtype=torch.float32: torch.full((S,), v, dtype=dtype)  # noqa: E731
    top_k = V if top_k is None else top_k
    return SamplingBatch(greedy=torch.zeros(S, dtype=torch.bool), temperature=full(temperature), top_p=full(top_p),
                         top_k=full(top_k, torch.long), min_p=full(min_p), seeds=torch.arange(S),
                         steps=torch.zeros(S, dtype=torch.long), all_greedy=False,
                         needs_sort=top_p < 1 or top_k < V, any_min_p=min_p > 0)


def best_of(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def kernel_vs_torch(logits: torch.Tensor) -> None:
    N, V = logits.shape
    one = [logits[i:i + 1].contiguous() for i in range(N)]
    big = logits.repeat((64 + N - 1) // N, 1)[:64].contiguous()
    race = torch.ops.mii.sample_race
    print(f"sampler per row ({N} captured rows, V = {V}) and per 64-row step: the kernel against the torch path")
    for name, kw in KERNEL_CASES.items():
        sb1, sb64 = batch_of(1, V, **kw), batch_of(64, V, **kw)
        args = lambda sb: (sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seeds, sb.steps)  # noqa: E731
        k1 = best_of(lambda: [race(r, *args(sb1)) for r in one]) / N
        t1 = best_of(lambda: [sample_torch(r, sb1) for r in one]) / N
        k64 = best_of(lambda: race(big, *args(sb64)))
        t64 = best_of(lambda: sample_torch(big, sb64))
        print(f"  {name:28} row {1e6 * k1:6.0f} us against {1e6 * t1:6.0f} us ({t1 / k1:4.1f}x) | 64 rows "
              f"{1e3 * k64:6.2f} ms against {1e3 * t64:6.2f} ms ({t64 / k64:4.1f}x)")


def penalties(V: int) -> None:
    print("penalties per step (repetition on 128 prompt + 64 output ids, frequency and presence on the output's): "
          "mii::penalize_ against the dense form")
    g = torch.Generator().manual_seed(0)
    for S in (1, 64):
        pen = (torch.full((S,), 1.1), torch.full((S,), 0.5), torch.full((S,), 0.3),
               torch.randint(0, V, (S, 128), generator=g), torch.randint(0, V, (S, 64), generator=g))
        logits = torch.randn(S, V, generator=g)
        sparse = best_of(lambda: apply_penalties(logits, pen)) - best_of(lambda: logits.clone())
        dense = best_of(lambda: _penalties_dense(logits, pen))
        print(f"  {S:2} row(s): {1e3 * sparse:6.2f} ms against {1e3 * dense:6.2f} ms ({dense / sparse:5.1f}x)")


def end_to_end(pipe, rows: int, tokens: int, rounds: int) -> None:
    prompts = [pipe.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" ({i})"}])
               for i in range(rows)]
    kinds = {"greedy": dict(do_sample=False), "sampled, top_p 0.9": dict(do_sample=True, top_p=0.9, seed=1),
             "greedy + repetition_penalty 1.1": dict(do_sample=False, repetition_penalty=1.1),
             "greedy + frequency 0.5, presence 0.3": dict(do_sample=False, frequency_penalty=0.5,
                                                          presence_penalty=0.3),
             "greedy + logprobs 5": dict(do_sample=False, logprobs=5)}
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    pipe(prompts[:1], max_new_tokens=4)
    for _ in range(rounds):
        for name, kw in kinds.items():
            t = time.perf_counter()
            outs = pipe(prompts, max_new_tokens=tokens, ignore_eos=True, **kw)
            rates[name].append(sum(o.generated_length for o in outs) / (time.perf_counter() - t))
    base = statistics.median(rates["greedy"])
    print(f"end to end, {rows} row(s) x {tokens} tokens (median of {rounds} alternated rounds)")
    for name, r in rates.items():
        print(f"  {name:38} {statistics.median(r):7.1f} tok/s = {statistics.median(r) / base:.2f}x greedy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sequence end to end")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds end to end")
    args = ap.parse_args()
    pipe = mii.pipeline(args.model)
    logits = captured_logits(pipe)
    kernel_vs_torch(logits)
    penalties(logits.shape[1])
    for rows in (1, 64):
        end_to_end(pipe, rows, args.tokens, args.rounds)
    pipe.destroy()


if __name__ == "__main__":
    main()
