"""mii's child processes (a deployment's front process and replicas, spawned tensor-parallel ranks): each is
`python -m MODULE` with a JSON spec on stdin. `spawn` starts one; `child_main` is the child's side: it reads the
spec, exits when the parent goes away (so nothing is left behind, even when the parent was killed), and reports a
start-up failure in one format (`mii.errors.error_info` JSON in the spec's `error_file`), which `read_error` turns
back into the same typed error in the parent."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from mii.errors import MIIError, error_from_info, error_info

log = logging.getLogger("mii")


def freeze_heap() -> None:
    """Leave what this process has built so far out of Python's garbage collections (`gc.freeze`, after one last
    collection). With the model loaded, a full collection walks ~220,000 objects (torch's, transformers', the
    model's): 124 ms, measured on the Zen 4 EPYC, during which the thread that runs it holds the GIL (in a
    replica, the engine's steps and every stream wait), and the interpreter's exit runs several (0.5-0.9 s of a
    `mii generate`). Only for processes that keep what they built until they exit (a replica's engine, `mii
    generate`'s pipeline, a deployment's front): frozen objects are never collected, so a process that builds and
    drops pipelines (a library user's) must not."""
    gc.collect()
    gc.freeze()


def spawn(module: str, spec: dict, **popen_kwargs) -> subprocess.Popen:
    """Start `python -m module` and hand it `spec` on stdin."""
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, **popen_kwargs)
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    return proc


def wait_or_kill(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for `procs` to exit, `timeout` seconds for all of them together; kill those still running then."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def write_json(path, data: dict) -> None:
    """Write a small JSON file whole or not at all (the parent polls for it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_error(path) -> Optional[Exception]:
    """The typed error a child wrote to `path` before it exited, if it wrote one."""
    try:
        return error_from_info(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


def _exit_with_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def child_main(run: Callable[[dict], None], what: str, watch_parent: bool = True) -> int:
    """The body of a child's `main()`: `run(spec)`; the exit code. `what` names the process in the log (formatted
    with the spec, e.g. "replica {index}"); `watch_parent=False` for a process meant to outlive its parent."""
    spec = json.loads(sys.stdin.read())
    if "log_level" in spec:
        log.setLevel(spec["log_level"])
    if watch_parent:
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    name = what.format(**spec)
    try:
        run(spec)
    except (KeyboardInterrupt, SystemExit):
        return 0
    except BaseException as e:
        if isinstance(e, MIIError):
            log.error("%s failed: %s", name, e)
        else:
            log.error("%s failed:\n%s", name, traceback.format_exc())
        if spec.get("error_file"):
            write_json(spec["error_file"], error_info(e))
        return 1
    return 0


def end_group(proc: subprocess.Popen) -> None:
    """Kill what is left of a replica's process group (its tensor-parallel ranks; the replica leads the group, as
    it was started in its own session). Only processes of that group that run mii are touched."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in _group_members(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and b"mii." in (entry / "cmdline").read_bytes():
                members.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return members
