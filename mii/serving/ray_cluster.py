"""Replicas on a Ray cluster (`cluster="ray"`, `mii serve MODEL --ray [ADDRESS]`).

The front process (load balancer, gRPC service, HTTP gateway) stays where the deployment was started and becomes a
Ray driver. Each replica is one actor, `ReplicaHost`, that Ray places on a node; the actor starts the replica's
engine process there, exactly as the front does on one host (`python -m mii.serving.replica`, which starts its
tensor-parallel ranks beside it), bound to the node's address, and reports its address and its end. The actor asks
Ray for every CPU thread (and GPU) of every rank of its replica, so a replica's ranks share a node by
construction, and the actors use Ray's SPREAD strategy, so replicas land on different nodes while there are
nodes to spread over. (A placement group per replica would reserve the same single-node bundle, but Ray has no
anti-affinity between placement groups: replicas could not be spread. One actor's resources are already one
reservation on one node.)

Supervision stays the front's: an actor that dies, or whose node goes away, shows as a replica process that
exited; the front takes it out of rotation, its requests in flight end with 503, and it is started again — a new
actor, which Ray places on a node that has room (another one when its node is gone). The replica process watches
its parent, the actor, and exits with it, so nothing is left behind on a node whose raylet died.

`mii.client(name)` on another node finds the deployment through a named actor, `DeploymentDirectory`, that the
front owns (it goes away with the front) and that holds the deployment's record.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from mii.errors import MIIError, ValidationError, error_from_info

NAMESPACE = "mii"
INSTALL = "pip install 'mii[ray]'"


def import_ray():
    quiet_signals()
    try:
        import ray
    except ImportError:
        raise ValidationError("cluster", f"cluster='ray' needs Ray, which is not installed here: {INSTALL}") from None
    return ray


def connect(address: Optional[str]):
    """Join the cluster at `address` (`auto`: the one on this host) or, with none, start one of this host alone
    (or join `$RAY_ADDRESS`); returns the `ray` module."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    kwargs = dict(namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
    if not address and not os.environ.get("RAY_ADDRESS"):
        kwargs["include_dashboard"] = False
    try:
        ray.init(address=address or None, **kwargs)
    except ConnectionError as e:
        raise ValidationError("ray_address", f"cannot join the Ray cluster at {address!r}: {e}") from None
    return ray


def quiet_signals() -> None:
    """Ray's core installs a failure handler that prints a stack trace for every SIGTERM: the signal that stops a
    deployment (and each of its replicas' actors) on purpose. Off in this process and the ones Ray starts from it."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")


def node_label(ip: str, node_id: str) -> str:
    """How a Ray node is shown in /health, /metrics and the record: its address and the start of its id (nodes of
    one host share the address)."""
    return f"{ip}/{node_id[:8]}"


# --- the actor on a replica's node ---------------------------------------------------------------------------------


class ReplicaHost:
    """Runs one replica's engine process on the node Ray placed this actor on."""

    def __init__(self, spec: dict, env: dict):
        import ray

        from mii.children import spawn

        self.tmp = Path(tempfile.mkdtemp(prefix=f"mii-replica{spec['index']}-"))
        self.ip = ray.util.get_node_ip_address()
        self.node = node_label(self.ip, ray.get_runtime_context().get_node_id())
        self.spec = dict(spec, host=self.ip, ready_file=str(self.tmp / "ready"), error_file=str(self.tmp / "error"))
        # Ray's own variables stay (CUDA_VISIBLE_DEVICES names the GPUs Ray gave this actor)
        self.proc = spawn("mii.serving.replica", self.spec, env={**os.environ, **env}, start_new_session=True)

    def wait_ready(self) -> dict:
        """{"ready": the replica's ready info, "node": this node} once it serves, or {"exit": code, "error": error
        info} if it ended."""
        import json

        ready = Path(self.spec["ready_file"])
        while True:
            if ready.is_file():
                return {"ready": json.loads(ready.read_text()), "node": self.node}
            if self.proc.poll() is not None:
                error = Path(self.spec["error_file"])
                return {"exit": self.proc.returncode,
                        "error": json.loads(error.read_text()) if error.is_file() else None}
            time.sleep(0.05)

    def wait_exit(self) -> int:
        return self.proc.wait()

    def stop(self, grace: float) -> None:
        """SIGTERM (the replica drains nothing: the front drained it), SIGKILL after `grace` seconds, then what is
        left of its process group (its tensor-parallel ranks)."""
        from mii.children import end_group, wait_or_kill

        if self.proc.poll() is None:
            self.proc.terminate()
        wait_or_kill([self.proc], grace)
        end_group(self.proc)
        shutil.rmtree(self.tmp, ignore_errors=True)


class DeploymentDirectory:
    """Named `mii-deployment:NAME` in Ray's `mii` namespace: the deployment's record, for `mii.client(NAME)` on any
    node of the cluster. Owned by the front process, so it ends with it."""

    def __init__(self, record: dict):
        self.record = record

    def set(self, record: dict) -> None:
        self.record = record

    def get(self) -> dict:
        return self.record


def directory_name(name: str) -> str:
    return f"mii-deployment:{name}"


# --- the front's side ------------------------------------------------------------------------------------------------


class RayReplica:
    """The front's handle on a replica placed by Ray: what `mii.serving.deployment.LocalReplica` is for a process on
    this host (poll, wait, terminate, kill, end; `ready` for its address)."""

    def __init__(self, ray, spec: dict, env: dict, cpus: int, gpus: int):
        self.ray = ray
        self.index = spec["index"]
        actor_cls = ray.remote(ReplicaHost)
        self.actor = actor_cls.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy="SPREAD",
                                       max_concurrency=4, max_restarts=0).remote(spec, env)
        self._ready = self.actor.wait_ready.remote().future()
        self._exit = self.actor.wait_exit.remote().future()
        self.pid = 0
        self.returncode: Optional[int] = None
        self.node = ""
        self.died: Optional[str] = None
        """Why the actor itself ended (its node went away, or it was killed), when it did."""

    def ready(self) -> Optional[dict]:
        """The replica's ready info once it serves; None while it loads; raises its typed error if it ended."""
        if not self._ready.done():
            if self.poll() is not None:  # the actor died before the replica was ready
                raise MIIError(f"replica {self.index}'s Ray actor ended while it was loading: {self.died}")
            return None
        try:
            result = self._ready.result()
        except Exception as e:
            raise MIIError(f"replica {self.index}'s Ray actor ended while it was loading: {_why(e)}") from None
        if "ready" not in result:
            error = error_from_info(result["error"]) if result["error"] else None
            raise error or MIIError(f"replica {self.index} exited with code {result['exit']} while loading "
                                    "(its log is in the Ray logs of its node)")
        self.pid, self.node = result["ready"]["pid"], result["node"]
        return result["ready"]

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._exit.done():
            try:
                self.returncode = self._exit.result()
            except Exception as e:  # the actor or its node died
                self.died = _why(e)
                self.returncode = -9
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"replica {self.index}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            self.actor.stop.remote(5.0)

    def kill(self) -> None:
        self.end()

    def end(self) -> None:
        """Stop the replica's processes (if its actor still runs) and the actor."""
        if self.poll() is None:
            try:
                self.ray.get(self.actor.stop.remote(0.5), timeout=10)
            except Exception:
                pass
        self.ray.kill(self.actor, no_restart=True)
        if self.returncode is None:
            self.returncode = -9


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def replica_resources(ray, mc) -> tuple[int, int]:
    """(CPUs, GPUs) a replica asks Ray for: `num_threads` CPUs per rank (when unset, the smallest node's CPUs
    divided between the ranks), and a GPU per rank when the cluster has GPUs and the device is not `cpu`."""
    tp = mc.tensor_parallel
    gpus = tp if mc.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0 else 0
    if mc.num_threads:
        per_rank = mc.num_threads
    else:
        sizes = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
        per_rank = max(1, int(min(sizes or [tp])) // tp)
    return per_rank * tp, gpus


def name_taken(ray, name: str) -> bool:
    """A deployment of this name already serves on the cluster."""
    try:
        ray.get_actor(directory_name(name), namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def publish(ray, record: dict):
    """The directory actor holding `record` (kept up to date through its `set`)."""
    actor_cls = ray.remote(DeploymentDirectory)
    return actor_cls.options(name=directory_name(record["name"]), namespace=NAMESPACE, num_cpus=0).remote(record)


def find_record(name: str) -> Optional[dict]:
    """The record of the deployment `name` running on the Ray cluster this host belongs to (None without Ray, a
    cluster, or such a deployment). Only tried when no deployment of that name runs on this host."""
    quiet_signals()
    try:
        import ray
    except ImportError:
        return None
    if not (ray.is_initialized() or os.environ.get("RAY_ADDRESS")
            or Path(tempfile.gettempdir(), "ray", "ray_current_cluster").exists()):
        return None  # this host is in no Ray cluster
    try:
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE, log_to_driver=False,
                     logging_level="WARNING")
        actor = ray.get_actor(directory_name(name), namespace=NAMESPACE)
        record = ray.get(actor.get.remote(), timeout=30)
    except Exception:
        return None
    if record.get("loopback") and record.get("node_ip") != ray.util.get_node_ip_address():
        raise ValidationError("deployment_name", f"deployment {name!r} runs on the Ray node {record['node_ip']}, "
                              "but its gRPC service listens on loopback only: serve it with grpc_host='0.0.0.0' "
                              "(and an api_key) to reach it from other nodes")
    return record
