"""One engine process of a deployment (a replica): loads the model, runs the engine loop in its own thread, and
serves MII's gRPC service plus `grpc.health.v1` on a loopback port that it reports to the front process.

The engine is not thread-safe, so exactly one thread (`EngineLoop`) calls `add_request`, `step` and `abort`;
the asyncio gRPC handlers talk to it through a command queue and get outputs back through per-call sinks.
A handler that ends for any reason (finished, client gone, deadline passed) aborts what it still owns, so the
sequences' KV blocks return to the pool.

Run as `python -m mii.serving.replica` with a JSON spec on stdin (written by `mii.serving.deployment`).
"""
from __future__ import annotations

import asyncio
import json
import logging
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

from mii.engine.engine import RequestOutput
from mii.engine.params import GenerationParams
from mii.errors import ServerOverloadedError, ValidationError
from mii.pipeline import normalize_prompts, per_prompt_params
from mii.response import Response
from mii.serving.protocol import CHANNEL_OPTIONS, error_info, error_status, pb2, pb2_grpc, read_request, to_reply

log = logging.getLogger("mii")


@dataclass
class _Add:
    prompts: list[list[int]]
    params: list[GenerationParams]
    sink: "_Sink"


class _Sink:
    """Delivers engine-thread events to one asyncio handler: ("added", uids), ("error", exc), ("out", outputs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))


class EngineLoop:
    """The one thread that owns the engine. `submit` and `abort` may be called from any thread."""

    def __init__(self, engine, max_waiting: Optional[int] = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, _Sink] = {}
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

    def submit(self, prompts: list[list[int]], params: list[GenerationParams], sink: _Sink) -> None:
        self._cmds.put(_Add(prompts, params, sink))

    def abort(self, uids) -> None:
        self._cmds.put(("abort", list(uids)))

    # --- engine thread -------------------------------------------------------------------------------------------

    def _snapshot(self) -> dict:
        kv = self.engine.kv
        return dict(num_running=self.engine.num_running, num_waiting=self.engine.num_waiting,
                    kv_cache_usage=kv.usage, kv_blocks_total=kv.num_blocks,
                    kv_blocks_used=kv.num_blocks - kv.allocator.num_free, prompt_tokens_total=self.prompt_tokens,
                    generation_tokens_total=self.generation_tokens, requests_total=self.requests)

    def _handle(self, cmd) -> None:
        if cmd is None:
            return
        if isinstance(cmd, _Add):
            uids = []
            try:
                waiting = self.engine.num_waiting
                if self.max_waiting is not None and waiting + len(cmd.prompts) > self.max_waiting:
                    raise ServerOverloadedError(
                        f"the server is overloaded: {waiting} requests are waiting "
                        f"(max_waiting_requests={self.max_waiting}); retry later")
                for ids, p in zip(cmd.prompts, cmd.params):
                    uids.append(self.engine.add_request(ids, p))
            except Exception as e:
                for uid in uids:
                    self.engine.abort(uid)
                cmd.sink.put("error", e)
                return
            for uid in uids:
                self._sinks[uid] = cmd.sink
            self.requests += len(uids)
            self.prompt_tokens += sum(len(ids) for ids in cmd.prompts)
            cmd.sink.put("added", uids)
        else:
            for uid in cmd[1]:
                if self._sinks.pop(uid, None) is not None:
                    self.engine.abort(uid)

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
                    sink.put("error", e)
                self._sinks.clear()
                continue
            by_sink: dict[int, tuple[_Sink, list[RequestOutput]]] = {}
            for o in outs:
                sink = self._sinks.get(o.uid)
                if sink is None:
                    continue
                self.generation_tokens += len(o.token_ids)
                by_sink.setdefault(id(sink), (sink, []))[1].append(o)
                if o.finished:
                    del self._sinks[o.uid]
            for sink, group in by_sink.values():
                sink.put("out", group)
            self.stats = self._snapshot()


class ReplicaServicer(pb2_grpc.ModelResponseServicer):
    """MII's service on one engine. Each call expands prompts × n into sequences and streams their outputs."""

    def __init__(self, pipe, loop: EngineLoop, index: int, model_name: str, on_terminate):
        self.pipe = pipe
        self.loop = loop
        self.index = index
        self.model_name = model_name
        self.on_terminate = on_terminate

    # --- requests ------------------------------------------------------------------------------------------------

    def _prepare(self, request):
        """Validate and expand a request: (prompts, token ids, params) per sequence (n per prompt)."""
        prompts, kwargs = read_request(request)
        plist, _ = normalize_prompts(prompts)
        params = per_prompt_params(kwargs, len(plist))
        engine = self.pipe.engine
        out_prompts, out_ids, out_params = [], [], []
        for i, (prompt, p) in enumerate(zip(plist, params)):
            ids = self.pipe.encode(prompt)
            if not ids:
                raise ValidationError(f"prompts[{i}]", "the prompt encodes to no tokens")
            engine.max_total(len(ids), p)
            for j in range(p.n):
                pj = p if p.n == 1 or p.seed is None else GenerationParams.from_kwargs({"seed": p.seed + j}, p.__dict__)
                out_prompts.append(prompt)
                out_ids.append(ids)
                out_params.append(pj)
        return out_prompts, out_ids, out_params

    def _prefix(self, prompt, p: GenerationParams) -> str:
        if not p.return_full_text:
            return ""
        return prompt if isinstance(prompt, str) else self.pipe.tokenizer.decode(prompt, skip_special_tokens=True)

    async def _generate(self, request, context):
        """Yield, per engine step with news, one `Response` per sequence (empty text when it had none)."""
        start = time.perf_counter()
        try:
            prompts, ids, params = self._prepare(request)
        except Exception as e:
            await context.abort(*error_status(e))
        sink = _Sink(asyncio.get_running_loop())
        self.loop.submit(ids, params, sink)
        pending: Optional[set] = None
        try:
            kind, value = await sink.queue.get()
            if kind == "error":
                await context.abort(*error_status(value))
            uids = value
            index = {uid: i for i, uid in enumerate(uids)}
            pending = set(uids)
            started = [False] * len(uids)
            state = [Response("", len(x), 0, "none") for x in ids]
            while pending:
                kind, value = await sink.queue.get()
                if kind == "error":
                    pending.clear()
                    await context.abort(*error_status(value))
                chunk = [Response("", s.prompt_length, s.generated_length, s.finish_reason, [],
                                  [] if params[i].logprobs is not None else None) for i, s in enumerate(state)]
                for o in value:
                    i = index[o.uid]
                    text = o.text if started[i] else self._prefix(prompts[i], params[i]) + o.text
                    started[i] = True
                    lp = None
                    if params[i].logprobs is not None:
                        lp = [{"token_id": t, "logprob": x, "top_logprobs": top} for t, x, top in o.logprobs]
                    chunk[i] = state[i] = Response(text, o.prompt_length, o.generated_length, o.finish_reason,
                                                   o.token_ids, lp)
                    if o.finished:
                        pending.discard(o.uid)
                yield chunk, time.perf_counter() - start
        finally:
            # cancelled, deadline passed or failed: free the sequences' KV blocks
            if pending is None:
                asyncio.ensure_future(self._abort_when_added(sink))
            elif pending:
                self.loop.abort(pending)

    async def _abort_when_added(self, sink: _Sink) -> None:
        kind, value = await sink.queue.get()
        if kind == "added":
            self.loop.abort(value)

    async def GeneratorReplyStream(self, request, context):
        async for chunk, elapsed in self._generate(request, context):
            yield pb2.MultiGenerationReply(response=[to_reply(r, elapsed) for r in chunk])

    async def GeneratorReply(self, request, context):
        texts: list[list[str]] = []
        last, elapsed = [], 0.0
        tokens: list[list[int]] = []
        logprobs: list[list] = []
        async for chunk, elapsed in self._generate(request, context):
            if not texts:
                texts, tokens, logprobs = [[] for _ in chunk], [[] for _ in chunk], [[] for _ in chunk]
            for i, r in enumerate(chunk):
                texts[i].append(r.generated_text)
                tokens[i].extend(r.token_ids or ())
                logprobs[i].extend(r.logprobs or ())
            last = chunk
        final = [Response("".join(texts[i]), r.prompt_length, r.generated_length, r.finish_reason, tokens[i],
                          logprobs[i] if r.logprobs is not None else None) for i, r in enumerate(last)]
        return pb2.MultiGenerationReply(response=[to_reply(r, elapsed) for r in final])

    async def EngineStats(self, request, context):
        s = self.loop.stats
        return pb2.EngineStatsReply(replicas=[pb2.ReplicaStats(
            replica=self.index, pid=os.getpid(), max_context=self.pipe.engine.plan.max_context,
            model=self.model_name, alive=True, **s)])

    async def Terminate(self, request, context):
        self.on_terminate()
        return empty_pb2.Empty()


# --- process entry -----------------------------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Exit when the front process is gone (even when it was killed), so no replica is left behind."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


async def serve_replica(spec: dict) -> None:
    import torch

    from mii.config import ModelConfig
    from mii.pipeline import MIIPipeline

    model_config = ModelConfig.model_validate(spec["model_config"])
    index = spec["index"]
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)] + CHANNEL_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()

    pipe = await asyncio.to_thread(MIIPipeline, model_config)
    if pipe.tp is not None:  # a tensor-parallel rank that dies takes this replica down (out of rotation), no hang
        pipe.tp.on_failure = lambda why: os._exit(1)
    engine_loop = EngineLoop(pipe.engine, spec.get("max_waiting_requests"))
    engine_loop.start()
    done = asyncio.Event()
    aloop = asyncio.get_running_loop()
    servicer = ReplicaServicer(pipe, engine_loop, index, spec.get("model_name", ""),
                               lambda: aloop.call_soon_threadsafe(done.set))
    pb2_grpc.add_ModelResponseServicer_to_server(servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(pb2.DESCRIPTOR.services_by_name["ModelResponse"].full_name,
                              health_pb2.HealthCheckResponse.SERVING)
    log.info("replica %d (pid %d, %d threads) serving on 127.0.0.1:%d", index, os.getpid(),
             torch.get_num_threads(), port)
    _write_json(spec["ready_file"], {"port": port, "pid": os.getpid()})
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, done.set)
    await done.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=1)
    engine_loop.stop()


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main() -> int:
    spec = json.loads(sys.stdin.read())
    log.setLevel(spec.get("log_level", logging.INFO))
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        asyncio.run(serve_replica(spec))
    except Exception as e:
        log.error("replica %s failed:\n%s", spec.get("index"), traceback.format_exc())
        _write_json(spec["error_file"], error_info(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
