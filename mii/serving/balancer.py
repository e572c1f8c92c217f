"""The load balancer of a deployment's front process: routes each request to the live replica with the fewest
outstanding sequences (prompts × n; ties in turn), forwards it over gRPC as a stream, retries on another replica
when one died before answering, and takes dead replicas out of rotation. `BalancerServicer` exposes it as MII's gRPC
service; the HTTP gateway calls `LoadBalancer.stream` / `generate` directly, in the same event loop.

Closing a stream early (client gone, deadline passed) cancels the replica call, which aborts the sequences.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

import grpc
from google.protobuf import empty_pb2

from mii.errors import DeploymentUnavailableError, MIIError
from mii.serving.metrics import Metrics
from mii.engine.outputs import ResponseJoiner
from mii.response import Response
from mii.serving.protocol import (CHANNEL_OPTIONS, error_from_rpc, error_status, from_multi_reply, num_sequences, pb2,
                                  pb2_grpc, to_multi_reply)

log = logging.getLogger("mii")


@dataclass(eq=False)
class Replica:
    index: int
    address: str
    process: Optional[subprocess.Popen] = None
    alive: bool = True
    outstanding: int = 0
    channel: Optional[grpc.aio.Channel] = field(default=None, repr=False)
    stub: Optional[pb2_grpc.ModelResponseStub] = field(default=None, repr=False)

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None


class LoadBalancer:
    def __init__(self, metrics: Optional[Metrics] = None):
        self.metrics = metrics or Metrics()
        self.replicas: list[Replica] = []
        self._turn = itertools.count()

    def add(self, replica: Replica) -> None:
        replica.channel = grpc.aio.insecure_channel(replica.address, options=CHANNEL_OPTIONS)
        replica.stub = pb2_grpc.ModelResponseStub(replica.channel)
        self.replicas.append(replica)
        self.metrics.up.labels(str(replica.index)).set(1)

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def mark_dead(self, replica: Replica, why: str) -> None:
        if replica.alive:
            replica.alive = False
            self.metrics.up.labels(str(replica.index)).set(0)
            log.warning("replica %d taken out of rotation: %s (%d left)", replica.index, why, len(self.live))

    def check(self) -> None:
        """Take replicas whose process ended out of rotation."""
        for r in self.replicas:
            if r.alive and r.exited():
                self.mark_dead(r, f"its process exited with code {r.process.returncode}")

    def pick(self, exclude=()) -> Replica:
        self.check()
        live = [r for r in self.live if r not in exclude]
        if not live:
            raise DeploymentUnavailableError("no replica of this deployment is serving")
        least = min(r.outstanding for r in live)
        ties = [r for r in live if r.outstanding == least]
        return ties[next(self._turn) % len(ties)]

    async def stream(self, request) -> AsyncIterator:
        """Forward one request; yield the replica's `MultiGenerationReply` chunks. Raises typed mii errors."""
        weight = num_sequences(request)
        tried: list[Replica] = []
        while True:
            replica = self.pick(exclude=tried)
            tried.append(replica)
            tracker = self.metrics.track(replica.index)
            replica.outstanding += weight
            call = replica.stub.GeneratorReplyStream(request)
            answered = finished = False
            try:
                async for reply in call:
                    answered = True
                    tracker.chunk(reply)
                    yield reply
                finished = True
                tracker.finish()
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and not answered:
                    await asyncio.sleep(0.05)  # let the process table catch up with a replica that just died
                    if replica.exited() or not await self._answers(replica):
                        self.mark_dead(replica, f"{e.code().name}: {e.details()}")
                        continue
                raise error_from_rpc(e) from None
            finally:
                replica.outstanding -= weight
                if not finished:
                    call.cancel()

    async def generate(self, request) -> list[Response]:
        """Forward one request; the whole responses (its streamed chunks joined)."""
        joined = ResponseJoiner()
        async for reply in self.stream(request):
            joined.add(from_multi_reply(reply))
        return joined.responses()

    async def _answers(self, replica: Replica) -> bool:
        try:
            await replica.stub.EngineStats(empty_pb2.Empty(), timeout=2)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def stats(self) -> list:
        """`ReplicaStats` of every replica (dead ones with alive=False)."""
        self.check()

        async def one(r: Replica):
            if r.alive:
                try:
                    reply = await r.stub.EngineStats(empty_pb2.Empty(), timeout=5)
                    s = reply.replicas[0]
                    s.outstanding = r.outstanding
                    return s
                except grpc.aio.AioRpcError as e:
                    log.warning("replica %d did not answer EngineStats: %s", r.index, e.code().name)
            return pb2.ReplicaStats(replica=r.index, alive=False, outstanding=r.outstanding,
                                    pid=r.process.pid if r.process else 0)

        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    async def close(self) -> None:
        for r in self.replicas:
            await r.channel.close()


class BalancerServicer(pb2_grpc.ModelResponseServicer):
    """MII's gRPC service in front of the replicas."""

    def __init__(self, lb: LoadBalancer, on_terminate: Callable[[], None]):
        self.lb = lb
        self.on_terminate = on_terminate

    async def GeneratorReplyStream(self, request, context):
        stream = self.lb.stream(request)
        try:
            async for reply in stream:
                yield reply
        except MIIError as e:
            await context.abort(*error_status(e))
        finally:
            await stream.aclose()

    async def GeneratorReply(self, request, context):
        start = time.perf_counter()
        try:
            return to_multi_reply(await self.lb.generate(request), time.perf_counter() - start)
        except MIIError as e:
            await context.abort(*error_status(e))

    async def EngineStats(self, request, context):
        return pb2.EngineStatsReply(replicas=await self.lb.stats())

    async def Terminate(self, request, context):
        self.on_terminate()
        return empty_pb2.Empty()
