"""Helpers for the tensor-parallel tests: free ports, and this process's child processes (so a test can check
that every rank it started is gone, even after a failure)."""
from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

KV = {"state_manager": {"max_ragged_batch_size": 48, "kv_block_size": 8,
                        "memory_config": {"mode": "allocate", "size": 256}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int | None = None) -> set[int]:
    """Direct children of `pid` (this process by default), from /proc."""
    pid = pid or os.getpid()
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in pids if alive(p)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if it leaves child processes behind; kills them either way."""
    before = children()
    yield
    extra = children() - before
    left = wait_gone(extra)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {sorted(left)}"
