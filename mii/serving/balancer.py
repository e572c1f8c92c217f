"""The load balancer of a deployment's front process: routes each request to the live replica with the fewest
outstanding sequences (prompts × n; ties in turn), forwards it over gRPC as a stream (or as one unary call when the
caller wants the whole answer: the replica and this process then wake once per finished sequence, not every step),
retries on another replica when one died before answering, and takes dead replicas out of rotation (the
deployment restarts them and puts the new process in with `replace`). `BalancerServicer` exposes it as MII's gRPC
service; the HTTP gateway calls `LoadBalancer.stream` / `generate` directly, in the same event loop.

Closing a stream early, or cancelling a unary call (client gone, deadline passed), cancels the replica call, which
aborts the sequences. Every request has a deadline when `request_timeout` is set (or its gRPC caller gave one),
passed on to the replica, so an expired request is aborted there too. A stream whose replica dies after it answered
ends at once with `DeploymentUnavailableError` (503): its tokens so far cannot be resumed elsewhere (a unary call has
answered nothing before its end, so it is retried). While the deployment drains for
shutdown, new requests are refused the same way and `in_flight` counts down.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Optional, Union

import grpc
from google.protobuf import empty_pb2

from mii.errors import (DeploymentUnavailableError, KVCacheError, MIIError, RequestTimeoutError, ServerOverloadedError,
                        UnknownArgument, ValidationError)
from mii.serving.auth import call_metadata
from mii.serving.metrics import Metrics
from mii.response import Response
from mii.serving.protocol import (CHANNEL_OPTIONS, error_from_rpc, error_status, from_multi_reply, num_sequences, pb2,
                                  pb2_grpc, to_multi_reply)

if TYPE_CHECKING:
    from mii.serving.deployment import LocalReplica
    from mii.serving.ray_cluster import RayReplica

log = logging.getLogger("mii")


@dataclass(eq=False)
class Replica:
    index: int
    address: str
    process: Optional[Union["LocalReplica", "RayReplica"]] = None
    alive: bool = True
    retiring: bool = False
    """Being removed by a scale-down: no new requests; those in flight finish."""
    outstanding: int = 0
    channel: Optional[grpc.aio.Channel] = field(default=None, repr=False)
    stub: Optional[pb2_grpc.ModelResponseStub] = field(default=None, repr=False)

    @property
    def node(self) -> str:
        """Where its process runs ("local", or a Ray node's address/id)."""
        return self.process.node if self.process is not None else "local"

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None


class LoadBalancer:
    def __init__(self, metrics: Optional[Metrics] = None, request_timeout: Optional[float] = None,
                 expected: int = 0, api_key: Optional[str] = None):
        self.metrics = metrics or Metrics()
        self._metadata = call_metadata(api_key)
        """The deployment's key, sent to the replicas: they check it too (their ports are reachable from this host)."""
        self.replicas: list[Replica] = []
        self.request_timeout = request_timeout
        self.expected = expected
        """Replicas the deployment is configured with (fewer live ones: degraded)."""
        self.in_flight = 0
        """Requests being served (each `stream` from its first step to its end)."""
        self.draining = False
        """Shutting down: new requests are refused with `DeploymentUnavailableError`."""
        self.closing_reason: Optional[str] = None
        """Set when the replicas are stopped under requests still in flight: the error those requests end with."""
        self._turn = itertools.count()

    def add(self, replica: Replica) -> None:
        replica.channel = grpc.aio.insecure_channel(replica.address, options=CHANNEL_OPTIONS)
        replica.stub = pb2_grpc.ModelResponseStub(replica.channel)
        self.replicas.append(replica)
        self.metrics.up.labels(str(replica.index)).set(1)

    async def replace(self, replica: Replica) -> None:
        """Put a restarted replica in rotation in place of the dead one with its index."""
        old = next((r for r in self.replicas if r.index == replica.index), None)
        self.add(replica)
        if old is not None:
            self.replicas.remove(old)
            await old.channel.close()
        self.replicas.sort(key=lambda r: r.index)

    @property
    def degraded(self) -> bool:
        return len(self.live) < self.expected

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def nodes(self) -> dict[str, list[int]]:
        """The replicas in rotation on each node."""
        out: dict[str, list[int]] = {}
        for r in self.live:
            out.setdefault(r.node, []).append(r.index)
        return out

    async def remove(self, replica: Replica) -> None:
        """Take a replica out for good (a scale-down, once its requests finished)."""
        self.replicas.remove(replica)
        self.metrics.up.remove(str(replica.index))
        await replica.channel.close()

    def mark_dead(self, replica: Replica, why: str) -> None:
        if replica.alive:
            replica.alive = False
            self.metrics.up.labels(str(replica.index)).set(0)
            log.warning("replica %d taken out of rotation: %s (%d left)", replica.index, why, len(self.live))

    def check(self) -> None:
        """Take replicas whose process ended out of rotation."""
        for r in self.replicas:
            if r.alive and not r.retiring and r.exited():  # (a retiring one is stopped on purpose)
                self.mark_dead(r, getattr(r.process, "died", None) or f"its process exited with code "
                                  f"{r.process.returncode}")

    def pick(self, exclude=()) -> Replica:
        self.check()
        live = [r for r in self.live if r not in exclude and not r.retiring]
        if not live:
            raise DeploymentUnavailableError("no replica of this deployment is serving")
        least = min(r.outstanding for r in live)
        ties = [r for r in live if r.outstanding == least]
        return ties[next(self._turn) % len(ties)]

    async def stream(self, request, timeout: Optional[float] = None, unary: bool = False) -> AsyncIterator:
        """Forward one request; yield the replica's `MultiGenerationReply` chunks (`unary`: its one whole reply, from
        a unary call, which wakes the replica's handler and this process once, not every step). Raises typed mii
        errors. `timeout`: the caller's own deadline in seconds (a gRPC client's), besides `request_timeout`."""
        self.in_flight += 1
        try:
            async for reply in self._stream(request, timeout, unary):
                yield reply
        except MIIError as e:
            self.metrics.errors.labels(_error_kind(e)).inc()
            e.counted = True  # (the HTTP gateway's error handlers do not count it again)
            raise
        finally:
            self.in_flight -= 1

    async def _stream(self, request, timeout: Optional[float], unary: bool = False) -> AsyncIterator:
        if self.draining:
            raise DeploymentUnavailableError("the deployment is shutting down and takes no new requests")
        limits = [(t, why) for t, why in ((self.request_timeout, "request_timeout"), (timeout, "the caller's deadline"))
                  if t is not None]
        limit, why = min(limits) if limits else (None, "")
        deadline = None if limit is None else time.monotonic() + limit
        weight = num_sequences(request)
        tried: list[Replica] = []
        while True:
            replica = self.pick(exclude=tried)
            tried.append(replica)
            tracker = self.metrics.track(replica.index)
            replica.outstanding += weight
            remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
            if unary:
                call = replica.stub.GeneratorReply(request, timeout=remaining, metadata=self._metadata)
            else:
                call = replica.stub.GeneratorReplyStream(request, timeout=remaining, metadata=self._metadata)
            answered = finished = False
            try:
                async for reply in (_one(call) if unary else call):
                    answered = True
                    tracker.whole(reply) if unary else tracker.chunk(reply)
                    yield reply
                finished = True
                tracker.finish()
                return
            except grpc.aio.AioRpcError as e:
                error = error_from_rpc(e)
                if type(error) is not DeploymentUnavailableError:
                    raise error from None  # the replica's own typed error (invalid, overloaded, ...)
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None:
                    raise RequestTimeoutError(f"the request did not finish within {limit:g} s ({why}); "
                                              "it was aborted") from None
                if self.closing_reason is not None:
                    raise DeploymentUnavailableError(self.closing_reason) from None
                if e.code() == grpc.StatusCode.UNAVAILABLE and not answered and not self.draining:
                    await asyncio.sleep(0.05)  # let the process table catch up with a replica that just died
                    if replica.exited() or not await self._answers(replica):
                        self.mark_dead(replica, f"{e.code().name}: {e.details()}")
                        continue  # nothing was sent to the caller yet: run it on another replica
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise DeploymentUnavailableError(
                        f"replica {replica.index} went away while serving this request ({e.code().name}); the "
                        "request did not finish: retry it") from None
                raise error from None
            finally:
                replica.outstanding -= weight
                if not finished:
                    call.cancel()

    async def generate(self, request, timeout: Optional[float] = None) -> list[Response]:
        """Forward one request; the whole responses."""
        (reply,) = [reply async for reply in self.stream(request, timeout, unary=True)]
        return from_multi_reply(reply)

    async def _answers(self, replica: Replica) -> bool:
        try:
            await replica.stub.EngineStats(empty_pb2.Empty(), timeout=2, metadata=self._metadata)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def stats(self) -> list:
        """`ReplicaStats` of every replica (dead ones with alive=False)."""
        self.check()

        async def one(r: Replica):
            if r.alive:
                try:
                    reply = await r.stub.EngineStats(empty_pb2.Empty(), timeout=5, metadata=self._metadata)
                    s = reply.replicas[0]
                    s.outstanding, s.node = r.outstanding, r.node
                    return s
                except grpc.aio.AioRpcError as e:
                    log.warning("replica %d did not answer EngineStats: %s", r.index, e.code().name)
            return pb2.ReplicaStats(replica=r.index, alive=False, outstanding=r.outstanding,
                                    pid=r.process.pid if r.process else 0, node=r.node)

        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    async def close(self) -> None:
        for r in self.replicas:
            await r.channel.close()


async def _one(call) -> AsyncIterator:
    """A unary call as a stream of its one reply."""
    yield await call


def _error_kind(e: MIIError) -> str:
    """The `kind` label of `mii_request_errors_total`."""
    for cls, kind in ((RequestTimeoutError, "timeout"), ((ServerOverloadedError, KVCacheError), "overloaded"),
                      (DeploymentUnavailableError, "unavailable"), ((ValidationError, UnknownArgument), "invalid")):
        if isinstance(e, cls):
            return kind
    return "internal"


class BalancerServicer(pb2_grpc.ModelResponseServicer):
    """MII's gRPC service in front of the replicas."""

    def __init__(self, lb: LoadBalancer, on_terminate: Callable[[], None],
                 on_scale: Optional[Callable[[int], Awaitable[int]]] = None):
        self.lb = lb
        self.on_terminate = on_terminate
        self.on_scale = on_scale

    async def GeneratorReplyStream(self, request, context):
        stream = self.lb.stream(request, context.time_remaining())
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
            return to_multi_reply(await self.lb.generate(request, context.time_remaining()),
                                  time.perf_counter() - start)
        except MIIError as e:
            await context.abort(*error_status(e))

    async def EngineStats(self, request, context):
        return pb2.EngineStatsReply(replicas=await self.lb.stats())

    async def Terminate(self, request, context):
        self.on_terminate()
        return empty_pb2.Empty()

    async def Scale(self, request, context):
        try:
            if self.on_scale is None:
                raise ValidationError("replicas", "this service cannot change its number of replicas")
            return pb2.ScaleReply(replicas=await self.on_scale(request.replicas))
        except MIIError as e:
            await context.abort(*error_status(e))
