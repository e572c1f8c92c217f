"""Online serving (SPEC §7): W64-like requests with Poisson arrivals, streamed from any OpenAI-compatible server
(`mii serve`, llama.cpp's `llama-server`, vLLM, ...), at a sweep of request rates. Per rate it reports time to
first token (TTFT) and time per output token after the first (TPOT), p50 and p99, throughput, the share of
requests that meet a latency SLA and why the others missed it (a late first token, a token gap); then DeepSpeed-FastGen's *effective throughput*: the highest rate swept at
which 99% of the requests meet it.

    .venv/bin/python -m bench.serve --spawn-mii                  # starts `mii serve`, sweeps 0.5,1,2,4 req/s, stops it
    .venv/bin/python -m bench.serve --spawn-mii ./model --serve-args="--num-threads 2" --rates 1,2,inf
    .venv/bin/python -m bench.serve --base-url http://127.0.0.1:8080   # any running server (llama-server, vLLM, ...)

Each request is one POST /v1/completions with `prompt` (W64's token ids; or, with --prompt-format text, their text
decoded by --tokenizer, for servers that take only strings or whose vocabulary is smaller than 40,000 ids),
`max_tokens` (its W64 output length), `temperature: 0`, `stream: true`, `stream_options: {"include_usage": true}`
and, unless --no-ignore-eos, vLLM's extras `ignore_eos: true` and `min_tokens` (= max_tokens), so that every
request generates exactly its output length (mii and vLLM honour both; llama-server honours `ignore_eos`). Token
counts come from the final `usage`; requests that end short are counted in the report.

The SLA follows FastGen's blog (a first-token deadline proportional to the prompt length, |prompt| / 512 s, and a
generation speed whose exponential moving average, span 16, stays at or above 2-6 tokens/s at every token), scaled
to the server under test: before the sweep, probe requests sent one at a time measure the unloaded first-token
time as `a + b * prompt_tokens` and the unloaded decode speed; the SLA allows `--sla-slack` (4) times both:
first token within `slack * (a + b * prompt_tokens)`, generation EMA at least `decode speed / slack`. Give
--sla-prefill and --sla-decode (and --sla-overhead-ms) to fix it instead; FastGen's own numbers are
`--sla-prefill 512 --sla-decode 4 --sla-overhead-ms 0`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.workloads import w64


@dataclass
class Result:
    """One streamed request, as the client saw it (times from `time.perf_counter()`)."""
    prompt_len: int                   # tokens asked (ids mode) or sent as text
    max_tokens: int                   # output tokens asked
    start: float = 0.0
    chunk_times: list = field(default_factory=list)  # arrival of each chunk that carried a choice
    end: float = 0.0
    prompt_tokens: int | None = None  # from `usage`
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1) if self.tokens > 1 else None

    def token_gaps(self) -> tuple[list[float], bool]:
        """(gap before each token after the first, exact?). vLLM and llama-server stream one chunk per token, mii
        at most one per `stream_interval_ms` (by default 20 ms: several tokens where steps are faster; --spawn-mii
        sets 0, one a step); where chunks and tokens differ in number, tokens are spread evenly over the chunks."""
        t, n = self.chunk_times, self.tokens
        exact = len(t) == n
        times = t if exact else [t[min(len(t) - 1, j * len(t) // max(n, 1))] for j in range(n)]
        return [b - a for a, b in zip(times, times[1:])], exact


@dataclass
class SLA:
    """First token within `overhead_s + prompt_tokens / prefill_tps`; the EMA (span `ema_span`) of the gaps between
    tokens at most 1 / `decode_tps` at every token."""
    overhead_s: float
    prefill_tps: float
    decode_tps: float
    ema_span: int = 16
    source: str = ""

    def describe(self) -> str:
        prompt = "" if math.isinf(self.prefill_tps) else f" + prompt tokens / {self.prefill_tps:,.0f} tok/s"
        return (f"first token within {self.overhead_s * 1000:.0f} ms{prompt}; "
                f"generation >= {self.decode_tps:.1f} tok/s (EMA over {self.ema_span} tokens, at every token)"
                f" [{self.source}]")

    def met(self, r: Result) -> bool:
        return self.miss(r) is None

    def miss(self, r: Result) -> str | None:
        """Why `r` missed the SLA ("error", "short", "first token", "token gap": the first that applies), or None."""
        if not r.ok:
            return "error"
        if r.tokens < r.max_tokens:
            return "short"
        prompt = r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
        if r.ttft > self.overhead_s + prompt / self.prefill_tps:
            return "first token"
        alpha, num, den, limit = 2 / (self.ema_span + 1), 0.0, 0.0, 1 / self.decode_tps
        for gap in r.token_gaps()[0]:  # pandas' ewm(span).mean(), adjust=True, as FastGen's scripts compute it
            num, den = gap + (1 - alpha) * num, 1 + (1 - alpha) * den
            if num / den > limit:
                return "token gap"
        return None


class Server:
    """Where requests go and what each one carries."""

    def __init__(self, base_url: str, model: str | None, prompt_format: str, ignore_eos: bool,
                 api_key: str | None, tokenizer=None, timeout: float = 900.0):
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/v1/completions"
        self.model, self.prompt_format, self.ignore_eos, self.tokenizer = model, prompt_format, ignore_eos, tokenizer
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=30.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def resolve_model(self) -> str:
        if self.model is None:
            r = await self.client.get(self.base_url + "/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    def fields(self) -> dict:
        """What every request carries besides `model`, `prompt` and `max_tokens`."""
        fields = {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        return {**fields, "ignore_eos": True, "min_tokens": "max_tokens"} if self.ignore_eos else fields

    def body(self, prompt: list[int], max_tokens: int) -> dict:
        body = {**self.fields(), "model": self.model, "max_tokens": max_tokens,
                "prompt": prompt if self.prompt_format == "ids" else self.tokenizer.decode(prompt)}
        if self.ignore_eos:
            body["min_tokens"] = max_tokens
        return body

    async def send(self, prompt: list[int], max_tokens: int) -> Result:
        r = Result(len(prompt), max_tokens)
        body = self.body(prompt, max_tokens)
        r.start = time.perf_counter()
        try:
            async with self.client.stream("POST", self.url, json=body) as resp:
                if resp.status_code != 200:
                    r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                    return r
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    data = json.loads(line[5:])
                    if "error" in data:
                        r.error = f"stream error: {json.dumps(data['error'])[:200]}"
                    if data.get("choices"):
                        r.chunk_times.append(now)
                    if data.get("usage"):
                        r.prompt_tokens = data["usage"].get("prompt_tokens")
                        r.completion_tokens = data["usage"].get("completion_tokens")
        except httpx.HTTPError as e:
            r.error = f"{type(e).__name__}: {e}"
        r.end = time.perf_counter()
        if r.error is None and not r.chunk_times:
            r.error = "no tokens streamed"
        return r

    async def aclose(self):
        await self.client.aclose()


def w64_requests(n: int, run: int) -> list[tuple[list[int], int]]:
    """n W64 requests (cycled past 64). The first prompt token is made unique per request and rate, so that a
    server's prefix cache cannot answer a prompt it saw at an earlier rate; the rest are W64's ids."""
    prompts, outputs = w64()
    out = []
    for i in range(n):
        ids = list(prompts[i % 64])
        ids[0] = 1000 + (run * n + i) % 39000
        out.append((ids, outputs[i % 64]))
    return out


def arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Poisson arrival offsets in seconds; the same draws at every rate, scaled (inf: all at once)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0, n)
    gaps[0] = 0.0
    return np.cumsum(gaps) / rate


async def run_rate(server: Server, reqs, offsets) -> tuple[list[Result], float]:
    t0 = time.perf_counter()

    async def one(req, at):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        return await server.send(*req)

    results = await asyncio.gather(*(one(q, at) for q, at in zip(reqs, offsets)))
    return list(results), time.perf_counter() - t0


async def probe(server: Server, rng: np.random.Generator, slack: float, span: int) -> tuple[SLA, dict]:
    """Requests one at a time on the idle server: first-token time against prompt length (two lengths, best of
    three each after a warm-up, fresh prompts so that no cache helps), and decode speed."""
    best = {}
    for length in (32, 512):
        runs = [await server.send(rng.integers(1000, 40000, length).tolist(), 32) for _ in range(4)][1:]
        bad = [r.error for r in runs if not r.ok]
        if bad:
            raise SystemExit(f"probe request failed: {bad[0]}")
        best[length] = (min(r.ttft for r in runs), min(r.tpot for r in runs if r.tpot))
    per_token = max((best[512][0] - best[32][0]) / (512 - 32), 0.0)  # 0: too small to measure (tiny models)
    overhead = max(best[32][0] - 32 * per_token, 0.0)
    tpot = min(best[32][1], best[512][1])
    prefill_tps = 1 / per_token if per_token else math.inf
    measured = {"ttft_32_ms": best[32][0] * 1000, "ttft_512_ms": best[512][0] * 1000,
                "overhead_ms": overhead * 1000, "prefill_tps": prefill_tps, "decode_tps": 1 / tpot}
    sla = SLA(slack * overhead, prefill_tps / slack, 1 / (slack * tpot), span, f"{slack:g}x the unloaded probe")
    return sla, measured


def pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(rate: float, results: list[Result], wall: float, sla: SLA) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    misses = [sla.miss(r) for r in results]
    met = misses.count(None)
    span = (max(r.end for r in ok) - min(r.start for r in ok)) if ok else wall
    out_tokens = sum(r.tokens for r in ok)
    return {
        "rate": rate, "requests": len(results), "errors": len(results) - len(ok),
        "errors_sample": [r.error for r in results if not r.ok][:3],
        "short": sum(r.tokens < r.max_tokens for r in ok),
        "asked_prompt_tokens": sum(r.prompt_len for r in results),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "asked_output_tokens": sum(r.max_tokens for r in results),
        "completion_tokens": out_tokens,
        "approximate_token_times": sum(not r.token_gaps()[1] for r in ok),
        "duration_s": span,
        "request_throughput": len(ok) / span if span > 0 else None,
        "output_throughput": out_tokens / span if span > 0 else None,
        "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_ms": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "sla_met": met / len(results),
        "sla_misses": {why: misses.count(why) for why in ("first token", "token gap", "short", "error")
                       if why in misses},
        "goodput": met / span if span > 0 else None,  # FastGen's scripts: throughput x share within the SLA
    }


def _fmt(v, spec=".0f") -> str:
    return "-" if v is None else format(v, spec)


def print_row(s: dict, header: bool = False) -> None:
    if header:
        print(f"{'rate':>6} {'req/s':>6} {'out tok/s':>9} {'TTFT ms p50':>12} {'p99':>6} {'TPOT ms p50':>12}"
              f" {'p99':>6} {'SLA met':>8} {'good req/s':>10} {'errors':>6}")
    rate = "inf" if math.isinf(s["rate"]) else f"{s['rate']:g}"
    missed = [f"{why} {n}" for why, n in s["sla_misses"].items() if why != "error"]  # (errors: their own column)
    print(f"{rate:>6} {_fmt(s['request_throughput'], '.2f'):>6} {_fmt(s['output_throughput']):>9}"
          f" {_fmt(s['ttft_ms']['p50']):>12} {_fmt(s['ttft_ms']['p99']):>6}"
          f" {_fmt(s['tpot_ms']['p50'], '.1f'):>12} {_fmt(s['tpot_ms']['p99'], '.1f'):>6}"
          f" {s['sla_met']:>8.0%} {_fmt(s['goodput'], '.2f'):>10} {s['errors']:>6}"
          + (f"   ({s['short']} ended short)" if s["short"] else "")
          + ("   missed: " + ", ".join(missed) if missed else ""),
          flush=True)


def effective_throughput(rows: list[dict], share: float) -> dict:
    """FastGen's effective throughput: the highest rate swept at which `share` of the requests met the SLA."""
    good = [s for s in rows if s["sla_met"] >= share]
    best = max(good, key=lambda s: s["rate"]) if good else None
    return {"share": share, "rate": best["rate"] if best else None,
            "request_throughput": best["request_throughput"] if best else None}


async def bench(args, base_url: str) -> dict:
    tokenizer = _tokenizer(args.tokenizer) if args.prompt_format == "text" else None
    server = Server(base_url, args.model, args.prompt_format, not args.no_ignore_eos, args.api_key, tokenizer)
    try:
        model = await server.resolve_model()
        sent = server.fields()
        print(f"server: {base_url}, model {model}; POST /v1/completions with prompt as "
              f"{'token ids' if args.prompt_format == 'ids' else 'text'}, max_tokens = output length, "
              f"{json.dumps(sent)}")
        reqs = w64_requests(args.requests, 0)
        print(f"workload: W64-like, {args.requests} requests per rate ({sum(len(p) for p, _ in reqs):,} prompt, "
              f"{sum(o for _, o in reqs):,} output tokens), Poisson arrivals (seed {args.seed})", flush=True)
        rng = np.random.default_rng(args.seed + 1)
        measured = None
        if args.sla_prefill is not None:
            sla = SLA(args.sla_overhead_ms / 1000, args.sla_prefill, args.sla_decode, args.sla_ema_span, "given")
        else:
            sla, measured = await probe(server, rng, args.sla_slack, args.sla_ema_span)
            print(f"probe (one request at a time): first token {measured['ttft_32_ms']:.0f} ms for 32 prompt tokens, "
                  f"{measured['ttft_512_ms']:.0f} ms for 512 (prefill {measured['prefill_tps']:,.0f} tok/s), "
                  f"decode {measured['decode_tps']:.1f} tok/s")
        print(f"SLA: {sla.describe()}", flush=True)
        rows, per_request = [], []
        for run, rate in enumerate(args.rates):
            reqs = w64_requests(args.requests, run)
            results, wall = await run_rate(server, reqs, arrivals(args.requests, rate, args.seed))
            rows.append(summarize(rate, results, wall, sla))
            print_row(rows[-1], header=run == 0)
            per_request.append([{**asdict(r), "sla_met": sla.met(r)} for r in results])
        eff = effective_throughput(rows, args.sla_share)
        if eff["rate"] is None:
            print(f"effective throughput: below the lowest rate swept (no rate had {eff['share']:.0%} of its "
                  "requests within the SLA)")
        else:
            print(f"effective throughput: {eff['rate']:g} req/s offered ({eff['request_throughput']:.2f} req/s "
                  f"served), the highest rate swept with >= {eff['share']:.0%} of requests within the SLA")
        report = {"server": base_url, "model": model, "prompt_format": args.prompt_format, "sent": sent,
                  "requests_per_rate": args.requests, "seed": args.seed, "probe": measured,
                  "sla": {**asdict(sla), "description": sla.describe()}, "rates": rows, "effective_throughput": eff}
        if args.json:
            Path(args.json).write_text(json.dumps({**report, "per_request": per_request}, indent=1))
        return report
    finally:
        await server.aclose()


def _tokenizer(name: str | None):
    """For --prompt-format text: W64's ids are decoded with this tokenizer (default: mii's embedded SmolLM2)."""
    from transformers import AutoTokenizer

    if name is None:
        import mii

        name = mii.default_model()
    path = Path(name)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SpawnedMii:
    """`mii serve` on free loopback ports, in its own session; stopped by its PID (SIGTERM, which takes its
    engine processes with it; SIGKILL to its process group if it is still there after 30 s). It streams a chunk
    every engine step (`--stream-interval-ms 0`, unless `extra` says otherwise), as the peers stream a chunk a
    token: every token's time is then measured, not spread over a chunk."""

    def __init__(self, model: str | None, extra: list[str], timeout: float):
        exe = Path(sys.executable).parent / "mii"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mii.cli"]
        self.port = _free_port()
        cmd += ["serve", *([model] if model else []), "--host", "127.0.0.1", "--port", str(self.port),
                "--grpc-port", str(_free_port()), "--deployment-name", f"bench-serve-{uuid.uuid4().hex[:8]}",
                "--quiet", *([] if any(a.startswith("--stream-interval-ms") for a in extra) else
                             ["--stream-interval-ms", "0"]), *extra]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mii-serve-", suffix=".log", delete=False)
        print(f"starting: {shlex.join(cmd)}  (log: {self.log.name})", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        t, deadline = time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"mii serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    print(f"mii serve ready in {time.monotonic() - t:.1f} s (pid {self.proc.pid})", flush=True)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise SystemExit(f"mii serve not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        if self.proc.returncode == 0:
            os.unlink(self.log.name)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    target.add_argument("--spawn-mii", nargs="?", const="", metavar="MODEL",
                        help="start `mii serve [MODEL]` on a free loopback port for the run "
                             "(default: the embedded model)")
    ap.add_argument("--serve-args", default="", help='more `mii serve` arguments, e.g. --serve-args="--num-threads 2"')
    ap.add_argument("--spawn-timeout", type=float, default=600.0, help="seconds to wait for /health")
    ap.add_argument("--rates", default="0.5,1,2,4", help="request rates to sweep, per second; 'inf' sends all at once")
    ap.add_argument("--requests", type=int, default=64, help="requests per rate (W64's, cycled past 64)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times and the probe prompts")
    ap.add_argument("--model", default=None, help="the `model` field (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                    help="send W64's token ids (default), or their text for servers that take only strings")
    ap.add_argument("--tokenizer", default=None,
                    help="for text prompts: HF folder, hub id or .gguf (default: mii's model)")
    ap.add_argument("--no-ignore-eos", action="store_true",
                    help="do not send ignore_eos / min_tokens (for servers that reject unknown fields); "
                         "requests may then end short")
    ap.add_argument("--sla-slack", type=float, default=4.0,
                    help="the probed SLA allows this many times the unloaded first-token time and time per token")
    ap.add_argument("--sla-prefill", type=float, default=None,
                    help="fixed SLA: prompt tokens/s for the first-token deadline")
    ap.add_argument("--sla-decode", type=float, default=None, help="fixed SLA: minimum generation tokens/s (EMA)")
    ap.add_argument("--sla-overhead-ms", type=float, default=0.0,
                    help="fixed SLA: constant part of the first-token deadline")
    ap.add_argument("--sla-ema-span", type=int, default=16)
    ap.add_argument("--sla-share", type=float, default=0.99, help="share of requests that must meet the SLA")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the report and every request's timings here")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also draw TTFT and TPOT (p50, p99) against the rate (bench.plots), one line per system")
    ap.add_argument("--plot-with", action="append", default=[], metavar="LABEL=PATH",
                    help="with --plot: another system's --json report on the same picture (repeatable)")
    ap.add_argument("--label", default=None, help="this run's name on the plot (default: mii with --spawn-mii, "
                                                   "else the model)")
    args = ap.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    if (args.sla_prefill is None) != (args.sla_decode is None):
        ap.error("--sla-prefill and --sla-decode go together (or neither, to probe the server)")
    if args.plot_with and not args.plot:
        ap.error("--plot-with goes with --plot")
    for spec in args.plot_with:  # before the sweep, not after it
        if not Path(spec.rpartition("=")[2]).is_file():
            ap.error(f"--plot-with {spec}: no such file")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    spawned = None
    if args.spawn_mii is not None:
        spawned = SpawnedMii(args.spawn_mii or None, shlex.split(args.serve_args), args.spawn_timeout)
    try:
        report = asyncio.run(bench(args, spawned.base_url if spawned else args.base_url))
    finally:
        if spawned:
            spawned.stop()
    if args.plot:
        from bench.plots import load_labelled, plot_serving

        label = args.label or ("mii" if spawned else report["model"])
        plot_serving({label: report, **load_labelled(args.plot_with)}, args.plot)
        print(f"plot: {args.plot}")
    return report


if __name__ == "__main__":
    main()
