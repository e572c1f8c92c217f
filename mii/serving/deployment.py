"""The front process of a deployment: claims the deployment's record, starts the load balancer's gRPC server
(MII's service + `grpc.health.v1`) and, when asked, the HTTP gateway, spawns one engine process per replica
(CPU threads divided between them, or GPUs given to each after `device_map`), puts each in rotation once it
reports ready, and supervises them: a replica whose process dies (killed, out of memory, a crash) leaves rotation
at once and is started again — its whole tensor-parallel group — with backoff while it keeps failing.

On `Terminate`, SIGTERM or SIGINT it drains: new requests are refused (503 / UNAVAILABLE) while those in flight
get `drain_timeout` seconds to finish; then it stops every process it started and removes the record. A second
signal cuts the drain short and kills what is left.

Started detached by `mii.serve` (`python -m mii.serving.deployment`, spec on stdin, log in the deployments
folder) or in the foreground by `mii serve`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mii.children import child_main, end_group, freeze_heap, read_error, spawn, wait_or_kill
from mii.config import DEVICE_MAP_DEFAULT, MIIConfig
from mii.errors import DeploymentExistsError, DeploymentUnavailableError, MIIError, ValidationError
from mii.loading.source import DEFAULT_MODEL_NAME
from mii.parallel.placement import gpu_count, replica_devices
from mii.serving import reasoning, records, tool_parsers
from mii.serving.auth import GRPCKeyCheck, exposure_warnings
from mii.serving.balancer import BalancerServicer, LoadBalancer, Replica
from mii.serving.gateway import ServedModel, build_app
from mii.serving.metrics import Metrics
from mii.serving.protocol import pb2, pb2_grpc, server_options

log = logging.getLogger("mii")
_SERVICE = pb2.DESCRIPTOR.services_by_name["ModelResponse"].full_name


def bind_host(host: str) -> str:
    """The address to bind: `localhost` means IPv4 loopback (one address, what clients expect)."""
    return "127.0.0.1" if host in ("localhost", "") else host


def connect_host(host: str) -> str:
    """Where a client on this host connects to a server bound to `host`."""
    return "127.0.0.1" if host in ("localhost", "", "0.0.0.0", "::", "[::]") else host


def replica_threads(cfg: MIIConfig) -> int:
    """CPU threads of each engine process (each tensor-parallel rank): the cores divided between them."""
    mc = cfg.model_config_
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return mc.num_threads or max(1, cores // (mc.replica_num * mc.tensor_parallel))


def http_server(app):
    """A uvicorn server without its own signal handlers (the front process owns SIGINT/SIGTERM)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, timeout_keep_alive=5))


MAX_REPLICAS = 256
"""The most replicas `scale` accepts."""
RESTART_BACKOFF_S = 0.5
"""Wait before restarting a replica that died; doubled for each death or failed start in a row, up to the max."""
RESTART_BACKOFF_MAX_S = 30.0
STABLE_S = 60.0
"""A replica that served this long before dying starts again from the shortest wait."""


class LocalReplica:
    """A replica's engine process on this host (its tensor-parallel ranks are in its process group)."""

    node = "local"

    def __init__(self, spec: dict, env: dict, log_file: str = ""):
        self.spec = spec
        self.log_file = log_file
        for f in (spec["ready_file"], spec["error_file"]):
            Path(f).unlink(missing_ok=True)
        # its own session: a signal to the front's terminal does not reach it, and its group is its ranks
        self.proc = spawn("mii.serving.replica", spec, env=env, start_new_session=True)
        self.pid = self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode

    def ready(self) -> Optional[dict]:
        """The replica's ready info once it serves; None while it loads; raises its typed error if it exited."""
        ready = Path(self.spec["ready_file"])
        if ready.is_file():
            return json.loads(ready.read_text())
        if self.proc.poll() is not None:
            error = read_error(self.spec["error_file"])
            raise error or MIIError(f"replica {self.spec['index']} exited with code {self.proc.returncode} while "
                                    f"loading (see {self.log_file or 'the deployment log'})")
        return None

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.proc.wait(timeout)

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()

    def end(self) -> None:
        end_group(self.proc)


class Deployment:
    def __init__(self, cfg: MIIConfig, announce: Callable[[str], None] = print):
        self.cfg = cfg
        self.name = cfg.deployment_name
        self.announce = announce
        self.host = bind_host(cfg.restful_api_host)
        self.stop_event = asyncio.Event()
        self.force = asyncio.Event()
        """Set by a second signal (or Terminate) while stopping: no more draining, kill what is left."""
        self.metrics = Metrics()
        self.lb = LoadBalancer(self.metrics, cfg.request_timeout, cfg.model_config_.replica_num, api_key=cfg.api_key)
        self.health = health.aio.HealthServicer()
        self.processes: dict[int, LocalReplica] = {}
        """Each replica's current engine process (rank 0 of its tensor-parallel group, the group's leader)."""
        self.launches: dict[int, tuple[dict, dict]] = {}
        """Each replica's (spec, environment), to start it again the same way; its keys are the replicas the
        deployment has now (`scale` adds and removes them)."""
        self.ray = None
        """The `ray` module once joined to the cluster (`cluster="ray"`); replicas are then `RayReplica`s."""
        self._directory = None
        self.threads = 0
        """CPU threads of each replica's ranks (set at start; replicas added by `scale` get as many)."""
        self._scale_lock = asyncio.Lock()
        self.served: Optional[ServedModel] = None
        self._tmp = Path(tempfile.mkdtemp(prefix=f"mii-{self.name}-"))
        self._grpc: Optional[grpc.aio.Server] = None
        self._http = None
        self._http_task: Optional[asyncio.Task] = None
        self._restarting: set[int] = set()
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._failures: dict[int, int] = {}
        self._up_since: dict[int, float] = {}
        self.record: dict = {}

    # --- lifecycle -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        mc = self.cfg.model_config_
        self.record = dict(
            name=self.name, pid=os.getpid(), state="starting", host=connect_host(self.cfg.grpc_host),
            port=self.cfg.port_number, http_port=self.cfg.restful_api_port if self.cfg.enable_restful_api else None,
            model=mc.model_name_or_path, log=str(records.log_path(self.name)), started=time.time(), replicas=[],
            mii_config=self.cfg.model_dump(mode="json", by_alias=True, exclude={"api_key"}), cluster=self.cfg.cluster)
        records.claim(self.record)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        try:
            if self.cfg.cluster == "ray":
                await self._join_ray()
            await self._start()
            freeze_heap()  # the gateway, tokenizer and balancer live as long as this process
            await self.stop_event.wait()
            log.info("deployment %r stopping", self.name)
        finally:
            await self._shutdown()
            records.remove(self.name, os.getpid())
            if self.ray is not None:
                self.ray.shutdown()

    async def _join_ray(self) -> None:
        from mii.serving import ray_cluster

        self.ray = await asyncio.to_thread(ray_cluster.connect, self.cfg.ray_address)
        if ray_cluster.name_taken(self.ray, self.name):
            raise DeploymentExistsError(f"a deployment named {self.name!r} already runs on this Ray cluster; stop it "
                                        f"with mii.client({self.name!r}).terminate_server() or pick another "
                                        "deployment_name")
        node_ip = self.ray.util.get_node_ip_address()
        grpc_host = bind_host(self.cfg.grpc_host)
        everywhere = grpc_host in ("0.0.0.0", "::")
        # what a client on another node connects to: this node's address when the service listens on every one
        self.record.update(node_ip=node_ip, loopback=grpc_host.startswith("127.") or grpc_host == "::1",
                           ray_address=self.ray.get_runtime_context().gcs_address,
                           cluster_host=node_ip if everywhere else self.record["host"])
        log.info("deployment %r: on the Ray cluster at %s (%d node(s)), front on %s", self.name,
                 self.record["ray_address"], sum(1 for n in self.ray.nodes() if n.get("Alive")), node_ip)

    def stop(self) -> None:
        """Begin a graceful stop (drain, then exit); called again while stopping, stop at once."""
        if self.stop_event.is_set():
            if not self.force.is_set():
                log.warning("deployment %r: stopping at once", self.name)
            self.force.set()
        self.stop_event.set()

    async def _start(self) -> None:
        cfg = self.cfg
        for warning in exposure_warnings(cfg.restful_api_host if cfg.enable_restful_api else None, cfg.grpc_host,
                                         cfg.api_key):
            log.warning("WARNING: %s", warning)
        server = self._grpc = grpc.aio.server(options=server_options(cfg.max_request_bytes),
                                              interceptors=[GRPCKeyCheck(cfg.api_key)] if cfg.api_key else None)
        pb2_grpc.add_ModelResponseServicer_to_server(BalancerServicer(self.lb, self.stop, self.scale), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        grpc_host = bind_host(cfg.grpc_host)
        try:
            server.add_insecure_port(f"{grpc_host}:{cfg.port_number}")
        except RuntimeError:
            raise ValidationError("port_number", f"cannot listen on {grpc_host}:{cfg.port_number} (gRPC): "
                                  "the port is in use or the address is not local") from None
        await server.start()
        self.served = ServedModel(name=cfg.model_config_.model_name_or_path or DEFAULT_MODEL_NAME,
                                  deployment_name=self.name)
        if cfg.enable_restful_api:
            sock = http_listener(self.host, cfg.restful_api_port)
            self._http = http_server(build_app(self.lb, self.served, cfg.api_key, cfg.metrics_need_key,
                                               cfg.max_request_bytes, cfg.enable_chat_ui))
            self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        await self._start_replicas()
        await self._load_model_info()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.record["state"] = "ready"
        if self.ray is not None:
            from mii.serving import ray_cluster

            self._directory = ray_cluster.publish(self.ray, self.record)
        self._write_record()
        self._task(self._monitor())
        http = ""
        if cfg.enable_restful_api:
            base = f"http://{self.record['host']}:{cfg.restful_api_port}"
            chat = f"chat page {base}/, " if cfg.enable_chat_ui else ""
            http = f", HTTP {base} ({chat}OpenAI API {base}/v1, REST {base}/mii/{self.name})"
        self.announce(f"mii: deployment {self.name!r} ready with {len(self.lb.replicas)} replica(s) of "
                      f"{self.served.name}: gRPC {self.record['host']}:{cfg.port_number}{http}")

    def _task(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _write_record(self) -> None:
        self.record["replicas"] = [{"index": r.index, "pid": r.process.pid, "address": r.address, "node": r.node}
                                   for r in self.lb.replicas]
        records.write(self.record)
        if self._directory is not None:
            self._directory.set.remote(self.record)

    async def _set_health(self, status) -> None:
        await self.health.set("", status)
        await self.health.set(_SERVICE, status)

    # --- replicas ------------------------------------------------------------------------------------------------

    async def _start_replicas(self) -> None:
        mc = self.cfg.model_config_
        if self.ray is None:
            self.threads = replica_threads(self.cfg)
            devices = replica_devices(mc, gpu_count())
            where = "".join(f"; replica {i} on GPU(s) {d}" for i, d in enumerate(devices) if d)
        else:
            from mii.serving.ray_cluster import replica_resources

            self._ray_resources = replica_resources(self.ray, mc)
            self.threads = self._ray_resources[0] // mc.tensor_parallel
            devices = [None] * mc.replica_num
            where = f"; each asks Ray for {self._ray_resources[0]} CPU(s)" + (
                f" and {self._ray_resources[1]} GPU(s)" if self._ray_resources[1] else "")
        for i in range(mc.replica_num):
            self.launches[i] = replica_launch(self.cfg, i, self.threads, devices[i], self._tmp, self.served.name)
            self._spawn(i)
        log.info("deployment %r: %d replica(s) of %s loading, %d thread(s) each%s", self.name, mc.replica_num,
                 self.served.name, self.threads, where)
        await self._await_ready(range(mc.replica_num))

    async def _await_ready(self, indices) -> None:
        """Put each of these replicas in rotation once it serves; raises the error of one that failed."""
        waiting = set(indices)
        while waiting:
            for i in sorted(waiting):
                replica = self._poll_ready(i)
                if replica is not None:
                    self.lb.add(replica)
                    self._up_since[i] = time.monotonic()
                    waiting.discard(i)
            if self.stop_event.is_set():
                raise MIIError("stopped while loading")
            await asyncio.sleep(0.05)

    def _spawn(self, index: int):
        spec, env = self.launches[index]
        if self.ray is None:
            handle = LocalReplica(spec, env, self.record.get("log", ""))
        else:
            from mii.serving.ray_cluster import RayReplica

            # only mii's own settings travel: the rest of this host's environment means nothing on another node
            own = {k: v for k, v in env.items() if k.startswith("MII_") or k in ("TOKENIZERS_PARALLELISM",
                                                                                 "OMP_NUM_THREADS")}
            handle = RayReplica(self.ray, spec, own, *self._ray_resources)
        self.processes[index] = handle
        return handle

    def _poll_ready(self, index: int) -> Optional[Replica]:
        """The replica once it reports ready; None while it loads; its typed error if it ended."""
        handle = self.processes[index]
        info = handle.ready()
        if info is None:
            return None
        self.served.plans[index] = {"pid": info["pid"], "plan": info.get("plan"), "node": handle.node}
        return Replica(index, f"{connect_host(info.get('host', '127.0.0.1'))}:{info['port']}", handle)

    async def _load_model_info(self) -> None:
        stats = await self.lb.stats()
        self.served.max_context = max(s.max_context for s in stats)
        self.served.tokenizer = await asyncio.to_thread(load_served_tokenizer, self.cfg.model_config_)
        template = getattr(self.served.tokenizer, "chat_template", None)
        self.served.tool_call_parser = tool_parsers.resolve(self.cfg.tool_call_parser, template)
        self.served.reasoning_parser = reasoning.resolve(self.cfg.reasoning_parser, template)
        log.info("deployment %r: tool-call parser %s, reasoning parser %s", self.name,
                 self.served.tool_call_parser or "none", self.served.reasoning_parser or "none")
        self.served.aliases = {self.name, os.path.basename(self.served.name.rstrip("/"))}
        self.served.ready = True

    async def _monitor(self) -> None:
        """Restart replicas whose process died; gRPC health NOT_SERVING while none is up."""
        was_serving = True
        while not self.stop_event.is_set():
            self.lb.check()
            for r in self.lb.replicas:
                if not r.alive and not r.retiring and r.index not in self._restarting:
                    self._restarting.add(r.index)
                    self._task(self._restart(r.index))
            serving = bool(self.lb.live)
            if serving != was_serving:
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if serving
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)
                if not serving:
                    log.error("deployment %r: no replica left", self.name)
                was_serving = serving
            await asyncio.sleep(0.2)

    async def _restart(self, index: int) -> None:
        """Start a dead replica again — its whole tensor-parallel group — with backoff while it keeps failing."""
        try:
            if time.monotonic() - self._up_since.get(index, 0.0) > STABLE_S:
                self._failures[index] = 0
            while not self.stop_event.is_set():
                fails = self._failures.get(index, 0)
                self._failures[index] = fails + 1
                delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** fails)
                log.warning("deployment %r: replica %d is down; restarting it in %.1f s", self.name, index, delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop_event.wait(), delay)
                if self.stop_event.is_set() or index not in self.launches:  # stopping, or scaled down meanwhile
                    return
                await asyncio.to_thread(self.processes[index].end)  # what is left of the old group (or actor)
                if self.stop_event.is_set() or index not in self.launches:
                    return
                self._spawn(index)
                try:
                    replica = None
                    while replica is None and not self.stop_event.is_set():
                        await asyncio.sleep(0.05)
                        replica = self._poll_ready(index)
                except Exception as e:
                    log.error("deployment %r: replica %d failed to start again: %s", self.name, index, e)
                    continue
                if replica is None:
                    return
                await self.lb.replace(replica)
                self._up_since[index] = time.monotonic()
                self.metrics.restarts.labels(str(index)).inc()
                self._write_record()
                log.warning("deployment %r: replica %d restarted (pid %d%s); %d of %d up", self.name, index,
                            replica.process.pid, "" if self.ray is None else f", node {replica.node}",
                            len(self.lb.live), self.lb.expected)
                return
        finally:
            self._restarting.discard(index)

    # --- scaling -------------------------------------------------------------------------------------------------

    async def scale(self, n: int) -> int:
        """Change the number of replicas to `n` (the `Scale` RPC: `client.scale(n)`, `mii scale`); returns the
        replicas serving then. New replicas take the lowest free indices and enter rotation once loaded (a failure
        to load is raised, and nothing of it stays); removed ones, the highest indices, first leave rotation and
        finish their requests in flight (up to `drain_timeout`), then stop. Requests are not dropped either way."""
        if not 1 <= n <= MAX_REPLICAS:
            raise ValidationError("replicas", f"replicas={n}: between 1 and {MAX_REPLICAS} (terminate_server() "
                                              "stops a deployment)")
        async with self._scale_lock:
            if self.lb.draining or self.stop_event.is_set():
                raise DeploymentUnavailableError("the deployment is shutting down")
            have = sorted(self.launches)
            if n > len(have):
                await self._add_replicas([i for i in range(n) if i not in self.launches][:n - len(have)], n)
            elif n < len(have):
                await self._retire(have[n:])
            self.lb.expected = n
            self._write_record()
            log.info("deployment %r scaled to %d replica(s) (%d serving)", self.name, n, len(self.lb.live))
            return len(self.lb.live)

    async def _add_replicas(self, indices: list[int], n: int) -> None:
        mc = self.cfg.model_config_
        devices = ([None] * n if self.ray is not None else
                   replica_devices(mc.model_copy(update={"replica_num": n}), gpu_count()))
        for i in indices:
            self.launches[i] = replica_launch(self.cfg, i, self.threads, devices[i], self._tmp, self.served.name)
            self._spawn(i)
        log.info("deployment %r: %d replica(s) more loading (%s)", self.name, len(indices),
                 ", ".join(map(str, indices)))
        try:
            await self._await_ready(indices)
        except BaseException:
            for i in indices:
                replica = next((r for r in self.lb.replicas if r.index == i), None)
                if replica is not None:
                    await self.lb.remove(replica)
                await asyncio.to_thread(self.processes.pop(i).end)
                self.launches.pop(i, None)
                self.served.plans.pop(i, None)
            raise

    async def _retire(self, indices: list[int]) -> None:
        gone = [r for r in self.lb.replicas if r.index in indices]
        for i in indices:
            self.launches.pop(i)  # not restarted from now on
        for r in gone:
            r.retiring = True
        deadline = time.monotonic() + self.cfg.drain_timeout
        while any(r.outstanding for r in gone) and time.monotonic() < deadline and not self.stop_event.is_set():
            await asyncio.sleep(0.05)
        for i in indices:
            handle = self.processes.pop(i)
            if handle.poll() is None:
                handle.terminate()
            await asyncio.to_thread(wait_or_kill, [handle], 5)
            await asyncio.to_thread(handle.end)
            self.served.plans.pop(i, None)
        for r in gone:
            await self.lb.remove(r)

    # --- shutdown ------------------------------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Refuse new requests (503 / UNAVAILABLE), let those in flight finish within `drain_timeout` (a second
        signal cuts it short), then stop the replicas, the servers, and remove what this deployment made."""
        self.lb.draining = True
        self.record["state"] = "stopping"
        with contextlib.suppress(Exception):
            records.write(self.record)
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._drain()
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        procs = list(self.processes.values())
        if self.force.is_set():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        else:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        await asyncio.to_thread(wait_or_kill, procs, 0.5 if self.force.is_set() else 5)
        for p in procs:  # tensor-parallel ranks that outlived their leader (a Ray replica's actor)
            await asyncio.to_thread(p.end)
        if self._http is not None:
            self._http.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._http_task, 0.5 if self.force.is_set() else 5)
        if self._grpc is not None:
            await self._grpc.stop(grace=0 if self.force.is_set() else 0.5)
        with contextlib.suppress(Exception):
            await self.lb.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    async def _drain(self) -> None:
        timeout = self.cfg.drain_timeout
        if self.lb.in_flight:
            log.info("deployment %r draining: %d request(s) in flight get up to %g s to finish", self.name,
                     self.lb.in_flight, timeout)
        deadline = time.monotonic() + timeout
        while self.lb.in_flight and time.monotonic() < deadline and not self.force.is_set():
            await asyncio.sleep(0.05)
        if self.lb.in_flight:
            self.lb.closing_reason = (
                "the deployment was stopped at once before this request finished" if self.force.is_set() else
                f"the deployment shut down before this request finished (drain_timeout={timeout:g} s)")
            log.warning("deployment %r: %d request(s) still in flight end now: %s", self.name, self.lb.in_flight,
                        self.lb.closing_reason)


def replica_launch(cfg: MIIConfig, index: int, threads: int, gpus: Optional[list[int]], tmp: Path,
                   model_name: str) -> tuple[dict, dict]:
    """The spec and environment of replica `index`'s engine process. With GPUs, CUDA_VISIBLE_DEVICES narrows the
    process (and its tensor-parallel ranks, which inherit it) to them, so rank r takes the r-th of its own GPUs."""
    mc = cfg.model_config_
    # each replica's tensor-parallel group meets on its own port
    update = {"num_threads": threads, "torch_dist_port": mc.torch_dist_port + index}
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    if gpus is not None:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[d] if visible else str(d) for d in gpus)
        update["device_map"] = DEVICE_MAP_DEFAULT
    own = mc.model_copy(update=update)
    spec = dict(index=index, model_config=own.model_dump(mode="json"),
                max_waiting_requests=cfg.max_waiting_requests, stream_interval_ms=cfg.stream_interval_ms,
                model_name=model_name, api_key=cfg.api_key,
                log_level=log.getEffectiveLevel(),
                ready_file=str(tmp / f"replica{index}.ready"), error_file=str(tmp / f"replica{index}.error"))
    return spec, env


def http_listener(host: str, port: int) -> socket.socket:
    """The HTTP gateway's listening socket. Made with `IPPROTO_TCP`, not protocol 0: asyncio sets TCP_NODELAY on
    accepted connections only then, and without it a keep-alive connection's first SSE chunk waits for the
    client's delayed ACK (~40 ms more to the first token)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValidationError("restful_api_port", f"cannot listen on {host}:{port} (HTTP): {e.strerror}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def load_served_tokenizer(mc):
    from mii.loading import gguf_file, resolve_source
    from mii.loading.loader import load_tokenizer

    source = resolve_source(mc.model_name_or_path)
    folder = gguf_file.cached_folder(source.path, source.name) if source.kind == "gguf" else source.path
    return load_tokenizer(folder, mc.tokenizer)


def run(cfg: MIIConfig, announce: Callable[[str], None] = print) -> None:
    """Run a deployment in this process until it is terminated (Terminate RPC, SIGTERM, SIGINT)."""
    async def main():
        await Deployment(cfg, announce).run()

    asyncio.run(main())


def _run_detached(spec: dict) -> None:
    import torch

    torch.set_num_threads(1)  # the front process does no tensor work
    run(MIIConfig.model_validate(spec["mii_config"]), announce=lambda line: log.info("%s", line))


def main() -> int:
    """Entry of the detached front process started by `mii.serve` (spec on stdin; it outlives its parent)."""
    return child_main(_run_detached, "deployment", watch_parent=False)


if __name__ == "__main__":
    sys.exit(main())
