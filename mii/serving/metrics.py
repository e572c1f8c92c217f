"""Prometheus metrics of a deployment, kept by the load balancer (which sees every request, and every streamed
chunk or unary reply, whichever API it came from) and served by the gateway at `GET /metrics`. Engine gauges
(running and waiting requests, KV cache usage) are read from the replicas at scrape time."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("mii_num_requests_running", "Sequences in the engine's running batch.", ["replica"], registry=r)
        self.waiting = Gauge("mii_num_requests_waiting", "Sequences waiting for a slot in the engine.", ["replica"], registry=r)
        self.kv_usage = Gauge("mii_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", ["replica"], registry=r)
        self.kv_used = Gauge("mii_kv_cache_blocks_used", "KV cache blocks held by sequences.", ["replica"], registry=r)
        self.kv_total = Gauge("mii_kv_cache_blocks_total", "KV cache blocks of the engine.", ["replica"], registry=r)
        self.preemptions = Counter("mii_num_preemptions", "Sequences preempted (blocks freed, recomputed later) "
                                   "because the KV cache ran out.", ["replica"], registry=r)
        self.prefix_queries = Counter("mii_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (each "
                                      "time a sequence starts, again after preemption).", ["replica"], registry=r)
        self.prefix_hits = Counter("mii_prefix_cache_hits", "Looked-up tokens found in the prefix cache (their KV "
                                   "reused, not computed).", ["replica"], registry=r)
        self.threads = Gauge("mii_engine_threads", "CPU threads the engine's steps take now: fewer than the plan's "
                             "when other processes took their cores (the thread pace).", ["replica"], registry=r)
        self.thread_drops = Counter("mii_engine_thread_drops", "Times the engine's thread pace took one thread fewer "
                                    "(other processes were taking the steps' cores).", ["replica"], registry=r)
        self.restarts = Counter("mii_replica_restarts", "Times the replica's process died and was started again.",
                                ["replica"], registry=r)
        self.errors = Counter("mii_request_errors", "Requests that ended with an error, by kind (overloaded, "
                              "timeout, unavailable, invalid, internal).", ["kind"], registry=r)
        self.up = Gauge("mii_replica_up", "1 while the replica is in the load balancer's rotation.", ["replica"], registry=r)
        self.node = Gauge("mii_replica_node", "1 for the node each replica runs on (\"local\", or a Ray node's "
                          "address/id); the replica's series moves with it when it is placed again.",
                          ["replica", "node"], registry=r)
        self.outstanding = Gauge("mii_replica_outstanding_requests", "Sequences the load balancer has in flight on "
                                 "the replica.", ["replica"], registry=r)
        self.prompt_tokens = Counter("mii_prompt_tokens", "Prompt tokens of finished requests.", ["replica"], registry=r)
        self.generation_tokens = Counter("mii_generation_tokens", "Generated tokens.", ["replica"], registry=r)
        self.requests = Counter("mii_requests", "Finished sequences, by finish reason.", ["replica", "finish_reason"],
                                registry=r)
        self.ttft = Histogram("mii_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("mii_inter_token_latency_seconds", "Time between generated tokens of a sequence.",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("mii_e2e_request_latency_seconds", "Time from arrival to the last token of a request.",
                             buckets=_E2E, registry=r)
        self._seen: dict[tuple[str, int, str], int] = {}  # (replica, pid, engine counter) -> last value read

    def render(self, stats) -> bytes:
        """Prometheus text, with the engine gauges set from `stats` (a list of `ReplicaStats`)."""
        self.node.clear()  # only where each replica is now
        for s in stats:
            label = str(s.replica)
            self.up.labels(label).set(1 if s.alive else 0)
            self.node.labels(label, s.node or "local").set(1)
            self.outstanding.labels(label).set(s.outstanding)
            if s.alive:
                self.running.labels(label).set(s.num_running)
                self.waiting.labels(label).set(s.num_waiting)
                self.kv_usage.labels(label).set(s.kv_cache_usage)
                self.kv_used.labels(label).set(s.kv_blocks_used)
                self.kv_total.labels(label).set(s.kv_blocks_total)
                self.threads.labels(label).set(s.threads)
                # the engine's counts since its process started (a restarted replica has a new pid)
                for counter, name in ((self.preemptions, "num_preemptions"), (self.prefix_queries,
                                      "prefix_cache_queries"), (self.prefix_hits, "prefix_cache_hits"),
                                      (self.thread_drops, "thread_drops")):
                    value, last = getattr(s, name), self._seen.get((label, s.pid, name), 0)
                    counter.labels(label).inc(max(0, value - last))
                    self._seen[(label, s.pid, name)] = value
        return generate_latest(self.registry)

    def track(self, replica: int) -> "RequestTracker":
        return RequestTracker(self, str(replica))


class RequestTracker:
    """Follows one request: the chunks of a stream (`chunk`), or a unary call's one reply (`whole`): time to first
    token, inter-token latency, tokens."""

    def __init__(self, metrics: Metrics, replica: str):
        self.m = metrics
        self.replica = replica
        self.start = time.perf_counter()
        self.last: list[float] = []
        self.generated: list[int] = []
        self.done: list[bool] = []

    def chunk(self, reply) -> None:
        now = time.perf_counter()
        if not self.last:
            n = len(reply.response)
            self.last, self.generated, self.done = [self.start] * n, [0] * n, [False] * n
        for i, r in enumerate(reply.response):
            if self.done[i]:
                continue
            new = r.generated_tokens - self.generated[i]
            if new > 0:
                if self.generated[i] == 0:
                    self.m.ttft.observe(now - self.start)
                else:
                    for _ in range(new):
                        self.m.itl.observe((now - self.last[i]) / new)
                self.m.generation_tokens.labels(self.replica).inc(new)
                self.generated[i], self.last[i] = r.generated_tokens, now
            if r.finish_reason not in ("", "none"):
                self.done[i] = True
                self._finished(r)

    def whole(self, reply) -> None:
        """A replica's unary reply: its token times (seconds since the replica got the call) moved to this clock by
        the time the call took here beyond the replica's (`time_taken`)."""
        lead = max(0.0, time.perf_counter() - self.start - max((r.time_taken for r in reply.response), default=0.0))
        for r in reply.response:
            if r.generated_tokens > 0:
                if r.last_token_time > 0:
                    self.m.ttft.observe(lead + r.first_token_time)
                    gap = (r.last_token_time - r.first_token_time) / max(1, r.generated_tokens - 1)
                    for _ in range(r.generated_tokens - 1):
                        self.m.itl.observe(gap)
                self.m.generation_tokens.labels(self.replica).inc(r.generated_tokens)
            self._finished(r)

    def _finished(self, r) -> None:
        self.m.prompt_tokens.labels(self.replica).inc(r.prompt_tokens)
        self.m.requests.labels(self.replica, r.finish_reason).inc()

    def finish(self) -> None:
        self.m.e2e.observe(time.perf_counter() - self.start)
