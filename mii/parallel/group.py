"""A tensor-parallel group of processes: how its ranks meet, how rank 0 hands each step to the others, and how
the death of one rank becomes a clear error instead of a hang.

Two ways in:
- spawned (`mii.pipeline(..., tensor_parallel=N)` in a plain process, or a deployment replica): this process is
  rank 0; it opens the rendezvous store on `torch_dist_port` and starts N - 1 workers
  (`python -m mii.parallel.worker`, spec on stdin), which load their shard and follow its steps until shutdown.
- `torchrun` (RANK / WORLD_SIZE set): every process runs the user's script and joins that group; rank 0 runs the
  scheduler, the others follow for the length of each pipeline call (MII's launcher model).

Two process groups: the default one (gloo on CPU, NCCL on GPU) carries the layers' collectives with a bounded
timeout (ranks are in lockstep inside a forward); a gloo "control" group carries the step messages from rank 0,
with a timeout long enough for a follower to wait idle between calls. A dead peer closes its gloo connections,
so a waiting rank fails at once; rank 0 also watches the processes it started.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mii.children import read_error, spawn, wait_or_kill
from mii.envs import ranks_on_this_host, torchrun_env
from mii.errors import MIIError, TensorParallelError, ValidationError
from mii.parallel.state import set_tp

log = logging.getLogger("mii")

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""Longest a collective inside a forward may wait for a peer (ranks run the same step, so waits are short)."""
CONTROL_TIMEOUT = timedelta(days=30)
"""How long a follower waits for rank 0's next message (it idles between pipeline calls)."""
JOIN_TIMEOUT_S = 300.0
"""How long rank 0 waits for its spawned workers to reach the rendezvous."""
HOST = "127.0.0.1"


@dataclass
class EndCall:
    """Rank 0 finished a pipeline call; under torchrun the followers return `payload` from theirs."""

    payload: Any = None


class Shutdown:
    """The group is closing: followers leave their loop."""


_ACTIVE: Optional["weakref.ref[TPGroup]"] = None


class TPGroup:
    """This process's membership in a tensor-parallel group (rank 0 or a follower)."""

    def __init__(self, rank: int, size: int, backend: str, workers: Optional[list] = None,
                 torchrun: bool = False, owns_default: bool = True, tmp: Optional[Path] = None):
        self.rank, self.size, self.backend = rank, size, backend
        self.torchrun = torchrun
        self.workers: list[subprocess.Popen] = workers or []
        self.failed: Optional[str] = None
        self.on_failure: Optional[Callable[[str], None]] = None
        """Called (from the watchdog thread) with the reason when a worker dies; a replica exits on it."""
        self._owns_default = owns_default
        self._tmp = tmp
        self._closing = False
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        if self.workers:
            threading.Thread(target=self._watch, name="mii-tp-watchdog", daemon=True).start()

    @property
    def closed(self) -> bool:
        return self._closing

    # --- failure ---------------------------------------------------------------------------------------------

    def _worker_error(self, rank: int) -> str:
        return _worker_error(self.workers, self._tmp, rank)

    def _dead_worker(self) -> Optional[str]:
        for r, proc in enumerate(self.workers, start=1):
            if proc.poll() is not None:
                return self._worker_error(r)
        return None

    def _watch(self) -> None:
        while not self._closing:
            why = self._dead_worker()
            if why is not None and not self._closing:
                self.failed = self.failed or why
                log.error("%s; the tensor-parallel group is down", why)
                self._kill_workers()
                if self.on_failure is not None:
                    self.on_failure(why)
                return
            time.sleep(0.2)

    def check(self) -> None:
        if self.failed is not None:
            raise TensorParallelError(f"the tensor-parallel group failed: {self.failed}")

    @contextlib.contextmanager
    def guard(self):
        """Around work that involves every rank: a failure there leaves the ranks out of step, so it ends the
        group, and a peer's death is reported as such."""
        self.check()
        try:
            yield
        except Exception as e:
            if isinstance(e, MIIError) and not isinstance(e, TensorParallelError):
                raise
            why = self._dead_worker()
            deadline = time.monotonic() + 2.0  # a dead peer's exit code may lag its closed sockets
            while self.workers and why is None and time.monotonic() < deadline:
                time.sleep(0.05)
                why = self._dead_worker()
            self.failed = self.failed or why or f"{type(e).__name__}: {e}"
            self._kill_workers()
            if why is None and not isinstance(e, (dist.DistError, TensorParallelError)):
                raise
            raise TensorParallelError(f"the tensor-parallel group failed: {self.failed}") from e

    # --- messages (control group) ----------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        """Rank 0: broadcast one message (a step's metadata, EndCall, Shutdown) to every other rank."""
        with self.guard():
            dist.broadcast_object_list([msg], src=0, group=self.control)

    def recv(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV blocks, so that every rank holds the same cache)."""
        t = torch.tensor([value], dtype=torch.long)
        with self.guard():
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def follow(self, execute: Callable[[Any], None]) -> Any:
        """A follower: run each step rank 0 sends until it ends the call (returns its payload) or shuts down."""
        while True:
            msg = self.recv()
            if isinstance(msg, EndCall):
                return msg.payload
            if isinstance(msg, Shutdown):
                self._closing = True
                return None
            execute(msg)

    # --- shutdown --------------------------------------------------------------------------------------------

    def _kill_workers(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.kill()
        for p in self.workers:
            with contextlib.suppress(Exception):
                p.wait(timeout=10)

    def close(self, graceful: bool = True) -> None:
        """Rank 0: stop the followers (spawned workers exit; `graceful=False` kills them, for when the ranks may be
        out of step); every rank: leave the groups, back to one rank."""
        global _ACTIVE
        if self.control is None:
            return
        was_closing, self._closing = self._closing, True
        if not graceful:
            self._kill_workers()
        elif self.rank == 0 and self.failed is None and not was_closing:
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([Shutdown()], src=0, group=self.control)
        wait_or_kill(self.workers, 10)
        self.workers = []
        if self.control is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.control)
            self.control = None
        if self._owns_default and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if self._tmp is not None:
            import shutil

            shutil.rmtree(self._tmp, ignore_errors=True)
        set_tp(0, 1)
        if _ACTIVE is not None and _ACTIVE() is self:
            _ACTIVE = None


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _use_device(device: str, local_rank: int, size: int) -> None:
    if device.startswith("cuda"):
        if torch.cuda.device_count() < size:
            raise ValidationError("tensor_parallel", f"{size} ranks need {size} GPUs on this host; torch sees "
                                                     f"{torch.cuda.device_count()}")
        torch.cuda.set_device(local_rank)


def active_group() -> Optional[TPGroup]:
    """The tensor-parallel group this process is in, if any (the layers' rank and size are process-wide)."""
    return _ACTIVE() if _ACTIVE is not None else None


def start(model_config, device: str) -> TPGroup:
    """Join (torchrun) or create (spawn N - 1 workers) the tensor-parallel group of `model_config`; sets this
    process's rank so the layers build and load their shard."""
    global _ACTIVE
    n = model_config.tensor_parallel
    env = torchrun_env()
    if env is not None:
        rank, world, local = env
        if world != n:
            raise ValidationError("tensor_parallel", f"is {n}, but this process was launched as one of "
                                                     f"WORLD_SIZE={world} ranks; they must be equal")
        _use_device(device, local, min(n, ranks_on_this_host(n)))
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group(_backend(device), init_method="env://", timeout=COLLECTIVE_TIMEOUT)
        set_tp(rank, n)
        group = TPGroup(rank, n, _backend(device), torchrun=True, owns_default=owns)
    else:
        if dist.is_initialized():
            raise ValidationError("tensor_parallel", "torch.distributed is already initialized in this process "
                                                     "but RANK/WORLD_SIZE are not set")
        _use_device(device, 0, n)
        group = _spawn(model_config, device)
    _ACTIVE = weakref.ref(group)
    atexit.register(_close_at_exit, weakref.ref(group))
    return group


def _close_at_exit(ref) -> None:
    group = ref()
    if group is not None:
        group.close()


def _spawn(model_config, device: str) -> TPGroup:
    n, port = model_config.tensor_parallel, model_config.torch_dist_port
    try:
        store = dist.TCPStore(HOST, port, n, is_master=True, timeout=timedelta(seconds=JOIN_TIMEOUT_S),
                              wait_for_workers=False)
    except Exception as e:
        raise ValidationError("torch_dist_port", f"cannot open the tensor-parallel rendezvous on {HOST}:{port} "
                                                 f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                                 "pick a free port") from None
    tmp = Path(tempfile.mkdtemp(prefix="mii-tp-"))
    workers = []
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")  # rank 0 shows the progress
    if model_config.num_threads:
        env["OMP_NUM_THREADS"] = str(model_config.num_threads)
    for r in range(1, n):
        spec = dict(model_config=model_config.model_dump(mode="json"), rank=r, size=n, port=port, device=device,
                    error_file=str(tmp / f"rank{r}.error"))
        workers.append(spawn("mii.parallel.worker", spec, env=env))
    try:
        pending = set(range(1, n))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while pending:  # wait at the store, not inside init_process_group, so a worker that dies is seen
            for r in list(pending):
                if store.check([f"joined/{r}"]):
                    pending.discard(r)
                elif workers[r - 1].poll() is not None:
                    raise TensorParallelError(f"could not start the tensor-parallel group: "
                                              f"{_worker_error(workers, tmp, r)}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank(s) {sorted(pending)} did not join within "
                                          f"{JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        dist.init_process_group(_backend(device), store=store, rank=0, world_size=n, timeout=COLLECTIVE_TIMEOUT)
        set_tp(0, n)
        return TPGroup(0, n, _backend(device), workers=workers, tmp=tmp)
    except BaseException:
        for p in workers:
            if p.poll() is None:
                p.kill()
            p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        set_tp(0, 1)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _worker_error(workers, tmp: Path, rank: int) -> str:
    proc = workers[rank - 1]
    why = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
    error = read_error(tmp / f"rank{rank}.error") if tmp is not None else None
    if error is not None:
        why += f": {error}"
    return why


def join_spawned(rank: int, size: int, port: int, device: str) -> TPGroup:
    """A spawned worker: meet rank 0 at its store and join the group."""
    _use_device(device, rank, size)
    store = dist.TCPStore(HOST, port, size, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    set_tp(rank, size)
    return TPGroup(rank, size, _backend(device))


__all__ = ["active_group", "EndCall", "Shutdown", "TPGroup", "join_spawned", "start"]
