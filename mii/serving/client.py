"""`MIIClient`: talks to a running deployment over gRPC (MII's service) — blocking, streaming and async calls —
and `mii.client(name)`, which finds a deployment on this host by its record (or, on a node of a Ray cluster, one
served on that cluster). A deployment with an API key needs
it on every call (sent as `authorization: Bearer <key>` metadata); the record never holds the key."""
from __future__ import annotations

import inspect
import os
import signal
import time
from typing import AsyncIterator, Callable, Optional, Union

import grpc
from google.protobuf import empty_pb2

from mii.config import MIIConfig
from mii.errors import DeploymentNotFoundError, ValidationError
from mii.response import Response
from mii.serving import records
from mii.serving.auth import call_metadata
from mii.engine.outputs import ResponseJoiner
from mii.engine.requests import normalize_prompts
from mii.serving.protocol import CHANNEL_OPTIONS, error_from_rpc, from_multi_reply, make_request, pb2, pb2_grpc


class MIIClient:
    """A handle on a running deployment (returned by `mii.serve` and `mii.client`)."""

    def __init__(self, record: dict, process=None, api_key: Optional[str] = None, remote: bool = False):
        self.record = record
        self.remote = remote
        """Found on the Ray cluster, running on another host: none of its processes are this host's."""
        self._metadata = call_metadata(api_key)
        self.mii_config = MIIConfig.model_validate(record["mii_config"])
        self.deployment_name: str = record["name"]
        self.port_number: int = record["port"]
        self.address = f"{record.get('cluster_host', record['host'])}:{record['port']}"
        self._process = process  # the front process, when this process started it
        self._channel: Optional[grpc.Channel] = None
        self._stub = None

    def __repr__(self) -> str:
        return f"MIIClient({self.deployment_name!r} at {self.address})"

    # --- requests ------------------------------------------------------------------------------------------------

    def _stub_sync(self):
        if self._stub is None:
            self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = pb2_grpc.ModelResponseStub(self._channel)
        return self._stub

    @staticmethod
    def _request(prompts, kwargs):
        """The wire request; the generation arguments are validated once, by the replica (typed errors come back)."""
        plist, single = normalize_prompts(prompts)
        return make_request(plist, kwargs), single

    def generate(self, prompts, streaming_fn: Optional[Callable[[list[Response]], None]] = None,
                 **kwargs) -> list[Response]:
        """Generate for one prompt or many; `list[Response]` in prompt order (n per prompt when n > 1).
        With `streaming_fn`, it is called with a `list[Response]` (one per sequence) per generated chunk."""
        request, _ = self._request(prompts, kwargs)
        stub = self._stub_sync()
        try:
            if streaming_fn is None:
                return from_multi_reply(stub.GeneratorReply(request, metadata=self._metadata))
            call = stub.GeneratorReplyStream(request, metadata=self._metadata)
            joined = ResponseJoiner()
            try:
                for reply in call:
                    chunk = from_multi_reply(reply)
                    streaming_fn(chunk)
                    joined.add(chunk)
            finally:
                call.cancel()
            return joined.responses()
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    __call__ = generate

    async def agenerate(self, prompts, streaming_fn=None, **kwargs) -> list[Response]:
        """`generate` for a running event loop; `streaming_fn` may be a coroutine function."""
        if streaming_fn is None:
            request, _ = self._request(prompts, kwargs)
            async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
                try:
                    reply = await pb2_grpc.ModelResponseStub(channel).GeneratorReply(request, metadata=self._metadata)
                except grpc.aio.AioRpcError as e:
                    raise error_from_rpc(e) from None
            return from_multi_reply(reply)
        joined = ResponseJoiner()
        async for chunk in self._astream(self._request(prompts, kwargs)[0]):
            result = streaming_fn(chunk)
            if inspect.isawaitable(result):
                await result
            joined.add(chunk)
        return joined.responses()

    async def astream(self, prompts, **kwargs) -> AsyncIterator[Union[Response, list[Response]]]:
        """Yield chunks as they are generated: a `Response` per chunk for a single prompt, else a
        `list[Response]` (one per sequence, empty text when it had nothing new). Closing it early cancels the
        request on the server (its sequences are aborted)."""
        request, single = self._request(prompts, kwargs)
        async for chunk in self._astream(request):
            yield chunk[0] if single and len(chunk) == 1 else chunk

    async def _astream(self, request):
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            call = pb2_grpc.ModelResponseStub(channel).GeneratorReplyStream(request, metadata=self._metadata)
            try:
                async for reply in call:
                    yield from_multi_reply(reply)
            except grpc.aio.AioRpcError as e:
                raise error_from_rpc(e) from None
            finally:
                call.cancel()

    def engine_stats(self) -> list:
        """Each replica's load: running/waiting sequences, KV blocks in use, token counters (`ReplicaStats`)."""
        try:
            return list(self._stub_sync().EngineStats(empty_pb2.Empty(), timeout=10, metadata=self._metadata).replicas)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def scale(self, replicas: int) -> int:
        """Change the deployment's number of replicas (more start and enter rotation once loaded; fewer finish
        their requests in flight first); returns once done, with the number of replicas serving."""
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ValidationError("replicas", f"expected an int, got {replicas!r}")
        try:
            return self._stub_sync().Scale(pb2.ScaleRequest(replicas=replicas), metadata=self._metadata).replicas
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    # --- lifecycle -----------------------------------------------------------------------------------------------

    def terminate_server(self, timeout: Optional[float] = None) -> None:
        """Stop every process of the deployment; returns once they are gone. Requests in flight get the
        deployment's `drain_timeout` to finish; `timeout` (default: that plus 30 s) bounds the whole wait."""
        if timeout is None:
            timeout = self.mii_config.drain_timeout + 30.0
        record = records.read(self.deployment_name) or self.record  # replicas restarted since: their new pids
        if record.get("pid") != self.record["pid"]:
            record = self.record
        try:
            self._stub_sync().Terminate(empty_pb2.Empty(), timeout=10, metadata=self._metadata)
        except grpc.RpcError:
            pass  # already stopping or gone: make sure below
        deadline = time.monotonic() + timeout
        if self.remote:  # its processes are on another host: wait for its service to go away
            while time.monotonic() < deadline:
                try:
                    self._stub_sync().EngineStats(empty_pb2.Empty(), timeout=2, metadata=self._metadata)
                except grpc.RpcError:
                    break
                time.sleep(0.1)
            self.close()
            return
        # (replicas that Ray placed run on their nodes: their actors end with the front process)
        pids = [record["pid"]] + [r["pid"] for r in record.get("replicas", ()) if r.get("node", "local") == "local"]
        if self._process is not None:
            try:
                self._process.wait(timeout=timeout)
            except Exception:
                pass
        while any(records.pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:  # still there: the deployment hangs; kill what is verifiably ours
            if records.pid_alive(pid) and _is_mii_process(pid):
                os.kill(pid, signal.SIGKILL)
        if self._process is not None and self._process.poll() is None:
            self._process.wait(timeout=5)
        records.remove(self.deployment_name, self.record["pid"])
        self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None


def _is_mii_process(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"mii.serving" in f.read()
    except OSError:
        return False


def client(deployment_name_or_model: str, api_key: Optional[str] = None) -> MIIClient:
    """The running deployment named so (or `<model basename>-mii-deployment`); `DeploymentNotFoundError` if none.
    `api_key`: the deployment's, if it has one."""
    name = str(deployment_name_or_model)
    for candidate in (name, records.default_deployment_name(name)):
        try:
            record = records.read(candidate)
        except ValidationError:
            continue
        if record is not None:
            return MIIClient(record, api_key=api_key)
    from mii.serving.ray_cluster import find_record

    for candidate in (name, records.default_deployment_name(name)):  # one served on the Ray cluster of this host
        record = find_record(candidate)
        if record is not None:
            return MIIClient(record, api_key=api_key, remote=True)
    running = ", ".join(records.list_names()) or "none"
    raise DeploymentNotFoundError(f"no running deployment named {name!r} on this host (running: {running}) nor on "
                                  "a Ray cluster it belongs to; start one with mii.serve(...) or `mii serve`")
