"""The front process of a deployment: claims the deployment's record, starts the load balancer's gRPC server
(MII's service + `grpc.health.v1`) and, when asked, the HTTP gateway, spawns one engine process per replica
(CPU threads divided between them), puts each in rotation once it reports ready, watches them, and on
`Terminate`, SIGTERM or SIGINT stops everything it started and removes the record.

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mii.children import child_main, read_error, spawn, wait_or_kill
from mii.config import MIIConfig
from mii.errors import MIIError, ValidationError
from mii.serving import records
from mii.serving.balancer import BalancerServicer, LoadBalancer, Replica
from mii.serving.gateway import ServedModel, build_app
from mii.serving.metrics import Metrics
from mii.serving.protocol import CHANNEL_OPTIONS, pb2, pb2_grpc

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


class Deployment:
    def __init__(self, cfg: MIIConfig, announce: Callable[[str], None] = print):
        self.cfg = cfg
        self.name = cfg.deployment_name
        self.announce = announce
        self.host = bind_host(cfg.restful_api_host)
        self.stop_event = asyncio.Event()
        self.metrics = Metrics()
        self.lb = LoadBalancer(self.metrics)
        self.health = health.aio.HealthServicer()
        self.processes: list[subprocess.Popen] = []
        self.served: Optional[ServedModel] = None
        self._tmp = Path(tempfile.mkdtemp(prefix=f"mii-{self.name}-"))
        self._grpc: Optional[grpc.aio.Server] = None
        self._http = None
        self._http_task: Optional[asyncio.Task] = None
        self.record: dict = {}

    # --- lifecycle -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        mc = self.cfg.model_config_
        self.record = dict(
            name=self.name, pid=os.getpid(), state="starting", host=connect_host(self.cfg.restful_api_host),
            port=self.cfg.port_number, http_port=self.cfg.restful_api_port if self.cfg.enable_restful_api else None,
            model=mc.model_name_or_path, log=str(records.log_path(self.name)), started=time.time(), replicas=[],
            mii_config=self.cfg.model_dump(mode="json", by_alias=True, exclude={"api_key"}))
        records.claim(self.record)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        try:
            await self._start()
            await self.stop_event.wait()
            log.info("deployment %r stopping", self.name)
        finally:
            await self._shutdown()
            records.remove(self.name, os.getpid())

    async def _start(self) -> None:
        cfg = self.cfg
        server = self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)] + CHANNEL_OPTIONS)
        pb2_grpc.add_ModelResponseServicer_to_server(BalancerServicer(self.lb, self.stop_event.set), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            server.add_insecure_port(f"{self.host}:{cfg.port_number}")
        except RuntimeError:
            raise ValidationError("port_number", f"cannot listen on {self.host}:{cfg.port_number} (gRPC): "
                                  "the port is in use or the address is not local") from None
        await server.start()
        self.served = ServedModel(name=cfg.model_config_.model_name_or_path or "SmolLM2-135M-Instruct",
                                  deployment_name=self.name)
        if cfg.enable_restful_api:
            sock = http_listener(self.host, cfg.restful_api_port)
            self._http = http_server(build_app(self.lb, self.served, cfg.api_key))
            self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        await self._start_replicas()
        await self._load_model_info()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.record.update(state="ready", replicas=[
            {"index": r.index, "pid": r.process.pid, "address": r.address} for r in self.lb.replicas])
        records.write(self.record)
        asyncio.create_task(self._monitor())
        http = ""
        if cfg.enable_restful_api:
            base = f"http://{self.record['host']}:{cfg.restful_api_port}"
            http = f", HTTP {base} (OpenAI API {base}/v1, REST {base}/mii/{self.name})"
        self.announce(f"mii: deployment {self.name!r} ready with {len(self.lb.replicas)} replica(s) of "
                      f"{self.served.name}: gRPC {self.record['host']}:{cfg.port_number}{http}")

    async def _set_health(self, status) -> None:
        await self.health.set("", status)
        await self.health.set(_SERVICE, status)

    async def _start_replicas(self) -> None:
        mc = self.cfg.model_config_
        threads = replica_threads(self.cfg)
        waiting = {}
        for i in range(mc.replica_num):
            # each replica's tensor-parallel group meets on its own port
            own = mc.model_copy(update={"num_threads": threads, "torch_dist_port": mc.torch_dist_port + i})
            spec = dict(index=i, model_config=own.model_dump(mode="json"),
                        max_waiting_requests=self.cfg.max_waiting_requests, model_name=self.served.name,
                        log_level=log.getEffectiveLevel(),
                        ready_file=str(self._tmp / f"replica{i}.ready"), error_file=str(self._tmp / f"replica{i}.error"))
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
            proc = spawn("mii.serving.replica", spec, env=env, start_new_session=True)
            self.processes.append(proc)
            waiting[i] = (proc, spec)
        log.info("deployment %r: %d replica(s) of %s loading, %d thread(s) each", self.name, mc.replica_num,
                 self.served.name, threads)
        while waiting:
            for i, (proc, spec) in list(waiting.items()):
                ready = Path(spec["ready_file"])
                if ready.is_file():
                    port = json.loads(ready.read_text())["port"]
                    self.lb.add(Replica(i, f"127.0.0.1:{port}", proc))
                    del waiting[i]
                elif proc.poll() is not None:
                    error = read_error(spec["error_file"])
                    if error is not None:
                        raise error
                    raise MIIError(f"replica {i} exited with code {proc.returncode} while loading "
                                   f"(see {self.record['log']})")
            if self.stop_event.is_set():
                raise MIIError("stopped while loading")
            await asyncio.sleep(0.05)

    async def _load_model_info(self) -> None:
        stats = await self.lb.stats()
        self.served.max_context = max(s.max_context for s in stats)
        self.served.tokenizer = await asyncio.to_thread(load_served_tokenizer, self.cfg.model_config_)
        self.served.aliases = {self.name, os.path.basename(self.served.name.rstrip("/"))}
        self.served.ready = True

    async def _monitor(self) -> None:
        was_serving = True
        while not self.stop_event.is_set():
            self.lb.check()
            serving = bool(self.lb.live)
            if serving != was_serving:
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if serving
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)
                if not serving:
                    log.error("deployment %r: no replica left", self.name)
                was_serving = serving
            await asyncio.sleep(0.5)

    async def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        if self._http is not None:
            self._http.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._http_task, 5)
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        wait_or_kill(self.processes, 5)
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
        with contextlib.suppress(Exception):
            await self.lb.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


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
