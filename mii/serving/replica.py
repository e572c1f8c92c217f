"""One engine process of a deployment (a replica): loads the model, runs the engine loop in its own thread, and
serves MII's gRPC service plus `grpc.health.v1` on a port it reports to the front process: on loopback, or on its
node's address when Ray placed it (`mii.serving.ray_cluster`).

Every gRPC call takes the one request path: `InputProcessor.process` (tokenized on one tokenizer thread, off the
event loop), `Engine.add_requests`, and `OutputProcessor` for the chunks and final responses. The engine is not
thread-safe, so exactly one thread (`EngineLoop`) calls `add_requests`, `step` and `abort`; the asyncio gRPC
handlers talk to it through a command queue and get outputs back through per-call sinks.
A handler that ends for any reason (finished, client gone, deadline passed) aborts what it still owns, so the
sequences' KV blocks return to the pool.

Run as `python -m mii.serving.replica` with a JSON spec on stdin (see `mii.children`; written by
`mii.serving.deployment`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import grpc
from google.protobuf import empty_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mii.children import child_main, freeze_heap, write_json
from mii.engine.engine import RequestOutput
from mii.engine.outputs import OutputProcessor
from mii.engine.requests import EngineRequest, InputProcessor
from mii.errors import ServerOverloadedError
from mii.serving.auth import GRPCKeyCheck
from mii.serving.protocol import CHANNEL_OPTIONS, error_status, pb2, pb2_grpc, read_request, to_multi_reply

log = logging.getLogger("mii")


@dataclass
class _Add:
    requests: list[EngineRequest]
    sink: "_Sink"


class _Sink:
    """Delivers engine-thread events to one asyncio handler: ("added", uids), ("error", exc), ("out", outputs).

    Each delivery wakes the handler (and, for a stream, the front process), and on a machine whose cores all run
    the engine's step, each wake takes one of them away from it. So the engine thread keeps a call's outputs until
    a delivery is due: a unary call's (`hold`) until one of its sequences finishes, noting when each sequence's
    first and last tokens came; a stream's for at most `interval` seconds since its last delivery (its first
    outputs and a finished sequence's at once)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hold: bool = False, interval: float = 0.0):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.start = time.perf_counter()
        self.hold = hold
        self.interval = interval
        self._held: list[RequestOutput] = []
        self._sent = -math.inf
        self.token_times: dict[int, list[float]] = {}
        """uid -> [first, last] token's time (`perf_counter`), kept when `hold`."""

    def put(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

    def deliver(self, outputs: list[RequestOutput]) -> bool:
        """One step's outputs of this call (engine thread; [] for a step without any, where a stream's held outputs
        may be due). True while a stream holds outputs that are not due yet."""
        now = time.perf_counter()
        if self.hold:
            for o in outputs:
                if o.token_ids:
                    self.token_times.setdefault(o.uid, [now, now])[1] = now
        self._held += outputs
        due = any(o.finished for o in outputs) or (not self.hold and now - self._sent >= self.interval)
        if not (self._held and due):
            return bool(self._held) and not self.hold
        self._sent = now
        outputs, self._held = self._held, []
        self.put("out", outputs)
        return False

    def fail(self, error: Exception) -> None:
        """End the call with `error` after the outputs it holds (a stream's tokens before a failure are sent)."""
        if self._held:
            self.put("out", self._held)
            self._held = []
        self.put("error", error)


class EngineLoop:
    """The one thread that owns the engine. `submit` and `abort` may be called from any thread."""

    def __init__(self, engine, max_waiting: Optional[int] = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, _Sink] = {}
        self._holding: dict[int, _Sink] = {}
        """Streams that hold outputs not yet due, by id: a step without their outputs (a sequence preempted or
        waiting for room) still sends them when due."""
        self._stopping = False
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = 0
        self.stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="mii-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._cmds.put(None)
        self._thread.join(timeout=10)

    def submit(self, requests: list[EngineRequest], sink: _Sink) -> None:
        self._cmds.put(_Add(requests, sink))

    def abort(self, uids) -> None:
        self._cmds.put(("abort", list(uids)))

    # --- engine thread -------------------------------------------------------------------------------------------

    def _snapshot(self) -> dict:
        kv = self.engine.kv
        return dict(num_running=self.engine.num_running, num_waiting=self.engine.num_waiting,
                    kv_cache_usage=kv.usage, kv_blocks_total=kv.num_blocks,
                    kv_blocks_used=kv.num_blocks - kv.allocator.num_free, num_preemptions=self.engine.num_preemptions,
                    prefix_cache_queries=kv.queried_tokens, prefix_cache_hits=kv.hit_tokens,
                    prompt_tokens_total=self.prompt_tokens,
                    generation_tokens_total=self.generation_tokens, requests_total=self.requests)

    def _handle(self, cmd) -> None:
        if cmd is None:
            return
        if isinstance(cmd, _Add):
            try:
                if self.max_waiting is not None and self.engine.num_queued(cmd.requests) > self.max_waiting:
                    raise ServerOverloadedError(
                        f"the server is overloaded: {self.engine.num_queued()} requests are waiting for room "
                        f"(max_waiting_requests={self.max_waiting}); retry later")
                uids = self.engine.add_requests(cmd.requests)
            except Exception as e:
                cmd.sink.put("error", e)
                return
            for uid in uids:
                self._sinks[uid] = cmd.sink
            self.requests += len(uids)
            self.prompt_tokens += sum(len(r.prompt_ids) for r in cmd.requests)
            cmd.sink.put("added", uids)
        else:
            for uid in cmd[1]:
                if (sink := self._sinks.pop(uid, None)) is not None:
                    self._holding.pop(id(sink), None)
                    self.engine.abort(uid)

    def _fail_call(self, sink: _Sink, error: Exception) -> None:
        """End one call with `error`: abort its other sequences (n > 1, several prompts) and tell its handler."""
        for uid in [uid for uid, s in self._sinks.items() if s is sink]:
            del self._sinks[uid]
            self.engine.abort(uid)
        self._holding.pop(id(sink), None)
        sink.fail(error)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            if not engine.has_unfinished():
                self.stats = self._snapshot()
                self._handle(self._cmds.get())
            while True:
                try:
                    self._handle(self._cmds.get_nowait())
                except queue.Empty:
                    break
            if self._stopping or not engine.has_unfinished():
                continue
            try:
                outs = engine.step()
            except Exception as e:  # a bug: fail every request rather than hang them
                log.error("engine step failed:\n%s", traceback.format_exc())
                for uid, sink in list(self._sinks.items()):
                    engine.abort(uid)
                    sink.fail(e)
                self._sinks.clear()
                self._holding.clear()
                continue
            by_sink: dict[int, tuple[_Sink, list[RequestOutput]]] = {}
            for o in outs:
                sink = self._sinks.get(o.uid)
                if sink is None:
                    continue
                if o.error is not None:  # the engine dropped this sequence: its call fails, the others go on
                    self._fail_call(sink, o.error)
                    by_sink.pop(id(sink), None)
                    continue
                self.generation_tokens += len(o.token_ids)
                by_sink.setdefault(id(sink), (sink, []))[1].append(o)
                if o.finished:
                    del self._sinks[o.uid]
            # the stats first: a client that has this step's tokens then sees at least this step's stats (a loaded
            # machine could run a client's EngineStats between the two, which answered with the step before's)
            self.stats = self._snapshot()
            for key, (sink, group) in by_sink.items():
                if sink.deliver(group):
                    self._holding[key] = sink
                else:
                    self._holding.pop(key, None)
            for key, sink in list(self._holding.items()):
                if key not in by_sink and not sink.deliver([]):
                    del self._holding[key]


class ReplicaServicer(pb2_grpc.ModelResponseServicer):
    """MII's service on one engine. Each call expands prompts × n into sequences and streams their outputs."""

    def __init__(self, loop: EngineLoop, inputs: InputProcessor, index: int, model_name: str, on_terminate,
                 stream_interval: float = 0.0):
        self.loop = loop
        self.stream_interval = stream_interval
        """Seconds between a stream's chunks at most (`MIIConfig.stream_interval_ms`)."""
        self.inputs = inputs
        self.index = index
        self.model_name = model_name
        self.on_terminate = on_terminate
        # one thread tokenizes: the event loop never waits on it, and no two encodes share the tokenizer at once
        self._tokenize = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mii-tokenize")

    async def _generate(self, request, context, sink: _Sink):
        """Per delivery of news (every engine step with news; for a holding sink, each finished sequence): (the
        call's `OutputProcessor`, the news, seconds since the call began)."""
        try:
            prompts, kwargs = read_request(request)
            requests, _ = await asyncio.get_running_loop().run_in_executor(
                self._tokenize, self.inputs.process, prompts, kwargs, not request.chat)
        except Exception as e:
            await context.abort(*error_status(e))
        outputs = OutputProcessor(requests)
        self.loop.submit(requests, sink)
        added = False
        try:
            kind, value = await sink.queue.get()
            if kind == "error":
                await context.abort(*error_status(value))
            outputs.bind(value)
            added = True
            while not outputs.finished:
                kind, value = await sink.queue.get()
                if kind == "error":  # the engine loop dropped every sequence already
                    outputs.pending.clear()
                    await context.abort(*error_status(value))
                yield outputs, outputs.update(value), time.perf_counter() - sink.start
        finally:
            # cancelled, deadline passed or failed: free the sequences' KV blocks
            if not added:
                asyncio.ensure_future(self._abort_when_added(sink))
            elif outputs.pending:
                self.loop.abort(set(outputs.pending))

    async def _abort_when_added(self, sink: _Sink) -> None:
        kind, value = await sink.queue.get()
        if kind == "added":
            self.loop.abort(value)

    async def GeneratorReplyStream(self, request, context):
        # aclosing: a cancelled stream aborts its sequences at once, not when the event loop finalizes `_generate`
        sink = _Sink(asyncio.get_running_loop(), interval=self.stream_interval)
        async with contextlib.aclosing(self._generate(request, context, sink)) as steps:
            async for outputs, news, elapsed in steps:
                yield to_multi_reply(outputs.chunk(news), elapsed)

    async def GeneratorReply(self, request, context):
        sink = _Sink(asyncio.get_running_loop(), hold=True)
        outputs, elapsed = None, 0.0
        async with contextlib.aclosing(self._generate(request, context, sink)) as steps:
            async for outputs, _, elapsed in steps:
                pass
        if outputs is None:
            return to_multi_reply([], elapsed)
        times = [[t - sink.start for t in sink.token_times.get(uid, ())] for uid in outputs.uids]
        return to_multi_reply(outputs.responses(), elapsed, times)

    async def EngineStats(self, request, context):
        s = self.loop.stats
        threads, drops = self.loop.engine.runner.pace()  # (read here: not a step's work)
        return pb2.EngineStatsReply(replicas=[pb2.ReplicaStats(
            replica=self.index, pid=os.getpid(), max_context=self.inputs.limits.max_context,
            model=self.model_name, alive=True, threads=threads, thread_drops=drops, **s)])

    async def Terminate(self, request, context):
        self.on_terminate()
        return empty_pb2.Empty()


# --- process entry -----------------------------------------------------------------------------------------------


async def serve_replica(spec: dict) -> None:
    import torch

    from mii.config import ModelConfig
    from mii.engine.factory import build_engine

    model_config = ModelConfig.model_validate(spec["model_config"])
    index = spec["index"]
    health_servicer = health.aio.HealthServicer()
    key = spec.get("api_key")  # the deployment's: this port is reachable by anyone on this host
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)] + CHANNEL_OPTIONS,
                             interceptors=[GRPCKeyCheck(key)] if key else None)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host = spec.get("host", "127.0.0.1")  # a Ray node's address when the front runs on another node
    port = server.add_insecure_port(f"{host}:0")
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()

    built = await asyncio.to_thread(build_engine, model_config)
    if built.tp_group is not None:  # a tensor-parallel rank that dies takes this replica down (out of rotation)
        built.tp_group.on_failure = lambda why: os._exit(1)
    freeze_heap()  # the engine lives as long as this process: full collections no longer walk it
    engine_loop = EngineLoop(built.engine, spec.get("max_waiting_requests"))
    engine_loop.start()
    done = asyncio.Event()
    aloop = asyncio.get_running_loop()
    servicer = ReplicaServicer(engine_loop, built.input_processor(), index, spec.get("model_name", ""),
                               lambda: aloop.call_soon_threadsafe(done.set), spec.get("stream_interval_ms", 0) / 1000)
    pb2_grpc.add_ModelResponseServicer_to_server(servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(pb2.DESCRIPTOR.services_by_name["ModelResponse"].full_name,
                              health_pb2.HealthCheckResponse.SERVING)
    log.info("replica %d (pid %d, %d threads) serving on %s:%d", index, os.getpid(), torch.get_num_threads(), host,
             port)
    write_json(spec["ready_file"], {"host": host, "port": port, "pid": os.getpid(), "plan": built.plan.as_dict()})
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, done.set)
    await done.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=1)
    engine_loop.stop()


def main() -> int:
    return child_main(lambda spec: asyncio.run(serve_replica(spec)), "replica {index}")


if __name__ == "__main__":
    sys.exit(main())
