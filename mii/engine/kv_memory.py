"""The KV cache's memory on CPU: zeroed lazily, and faulted in ahead of use.

A CPU KV cache comes from calloc (numpy), so a large one costs neither start-up time nor memory until it is used:
the OS maps and zeroes each page on its first write. That first write is not free. On some virtual machines
fresh memory is backed by the host at about 150 MB/s (measured on this project's VMs: 13 s for a 2 GiB cache), and
with prefix caching on, the engine keeps moving to blocks it has never used (finished sequences' blocks stay
cached), so W64 paid its page faults inside the decode steps: 23% of the engine thread's time.

`KVPrefault` moves those faults off the engine's path. A background thread at the lowest priority asks the
kernel to fault in the pages of the blocks just ahead of the highest one the engine has written
(`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+: the pages are mapped writable as if written, their content is left
alone, so it is safe beside the engine's own writes), and, whenever the engine has been idle for a moment, more:
up to twice the blocks it has used, a few at a time. The block allocator hands out low ids first, so the cache
fills from the start; and it reuses idle cached blocks before it takes a block of memory never touched
(`BlockAllocator`'s `resident`). So a busy engine faults in only what its running sequences need, a small
workload keeps a small footprint, and the prefix cache's capacity doubles with each idle moment of a server that
fills it, up to the whole cache.

The faults are not free for the engine either: a thread inside them holds a core, nice value or not (the VM's
host backs the page meanwhile), and where the engine's threads use every core, their time comes out of the
steps. Measured on the AMX Xeon VMs (2 cores): first touch 70-80 MB/s (24-26 s for the default 2 GiB cache);
W64 with its ~600 MB of new blocks faulted in as it ran 24.6 s, 18.9 s with the cache already in place. So while
the engine is busy the margin is kept only while the allocator runs short of blocks it can hand out without new
memory (`spare`): under a steady load of new prompts it reuses idle cached blocks rather than moving the cache
onto new memory, a margin at a time, as it did before.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from typing import Callable, Optional

import numpy as np
import torch

log = logging.getLogger(__name__)

MADV_NOHUGEPAGE = 15  # linux/mman.h
MADV_POPULATE_WRITE = 23
_PAGE = os.sysconf("SC_PAGE_SIZE")


def zeros_lazy(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU from calloc (numpy), so the pages are zeroed by the OS when first touched and a
    large KV cache costs neither start-up time nor memory until it is used. Zeros matter: masked attention
    still multiplies by never-written slots, and 0 * NaN would poison the output.

    On small pages (`MADV_NOHUGEPAGE`): a cache `[layers, 2, blocks, ...]` puts a block in 2 × layers regions far
    apart, and with transparent huge pages (`always` on this project's VMs) each region's first write faults in a
    whole 2 MB page. The embedded SmolLM2's first prompt then had 120 MB zeroed (and backed by the VM's host)
    inside its prefill: 148-178 ms for a 120-token prompt where the next ones took 82-108, 856 ms on a VM whose
    host memory was cold. On small pages it faults in its blocks' own 12 KB a region: 80-95 ms. In alternated
    processes (4 pairs, a Zen 4 EPYC), W64 on a fresh cache ran 27.7-32.2 s against 32.5-35.9 on huge pages, and
    again on the same cache 26.4-31.4 against 30.0-34.1."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(shape, dtype=np.dtype(f"u{dtype.itemsize}"))
    _small_pages(raw.ctypes.data, raw.nbytes)
    return torch.from_numpy(raw).view(dtype)


def _small_pages(addr: int, nbytes: int) -> None:
    """MADV_NOHUGEPAGE on the whole pages of [addr, addr + nbytes) (Linux; elsewhere, or if refused, nothing)."""
    madvise = _madvise()
    start = addr + (-addr % _PAGE)
    length = (addr + nbytes - start) // _PAGE * _PAGE
    if madvise is not None and length > 0 and madvise(start, length, MADV_NOHUGEPAGE) != 0:
        log.debug("mii: the KV cache may take huge pages (madvise: %s)", os.strerror(ctypes.get_errno()))


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class KVPrefault:
    """Faults in the pages of a CPU KV cache `[layers, 2, blocks, ...]` ahead of use. `want(n)`: the engine has
    written blocks below `n`; the thread makes sure blocks below `n + ahead` are faulted in (`ahead`: by default
    the blocks of 32 MB, at least 4). When no `want` came for `idle_after` seconds (None: never), it goes on up
    to twice the highest block written (plus `ahead`). Holds the cache only weakly: a destroyed engine's cache is
    freed, and the thread ends."""

    AHEAD_BYTES = 32 << 20
    IDLE_BLOCKS_BYTES = 8 << 20  # faulted in per madvise while the engine is idle: a new step waits for it at most

    def __init__(self, cache: torch.Tensor, ahead: int | None = None, idle_after: float | None = 0.5):
        self._cache = weakref.ref(cache)
        self.num_blocks = cache.shape[2]
        self._regions = cache.shape[0] * cache.shape[1]
        self._block_bytes = cache[0, 0, 0].numel() * cache.element_size()  # one block in one region
        self.ahead = ahead if ahead is not None else max(4, self.AHEAD_BYTES // (self._block_bytes * self._regions))
        self._idle_step = max(1, self.IDLE_BLOCKS_BYTES // (self._block_bytes * self._regions))
        self.idle_after = idle_after
        self.spare: Optional[Callable[[], int]] = None
        """The blocks the allocator can hand out without new memory (BlockAllocator.num_reusable; the engine sets
        it): none, or fewer than `ahead`, and `want` keeps the margin."""
        self.done = 0  # blocks [0, done) are faulted in (as far as the kernel allowed)
        self._want = 0
        self._written = 0
        self._last_want = time.monotonic()
        self._cv = threading.Condition()
        self._madvise = _madvise()
        self.error: str | None = None
        self._closed = False
        weakref.finalize(cache, self.close)  # the engine is gone: so is the thread
        self._thread = threading.Thread(target=self._run, name="mii-kv-prefault", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stops the thread and waits for it (it stops between two regions' madvise): at interpreter exit
        (weakref.finalize's atexit) a daemon thread still inside madvise was ended mid-call by the interpreter's
        finalization, and the process aborted ("terminate called without an active exception": `mii generate`
        under load, 1 run in 10)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def resident(self) -> int:
        """Blocks below this id have their pages in place."""
        return self.done

    def want(self, written: int) -> None:
        self._last_want = time.monotonic()
        self._written = max(self._written, written)
        # the margin only while the allocator runs short of blocks it can hand out without new memory (`spare`):
        # it takes faulted-in blocks before idle cached ones, so a margin kept ahead of every step would move the
        # cache onto new memory under a steady load of new prompts, whose faults take a core from the engine
        short = self.spare is None or self.spare() < self.ahead
        target = min(self.num_blocks, written + (self.ahead if short else 0))
        if target > self._want:
            with self._cv:
                self._want = max(self._want, target)
                self._cv.notify()

    def wait(self, timeout: float = 30.0) -> bool:
        """Until the thread has caught up with the last `want` (for tests); True if it did."""
        with self._cv:
            return self._cv.wait_for(lambda: self.done >= self._want or self.error is not None or self._closed,
                                     timeout)

    def _populate(self, b0: int, b1: int) -> bool:
        cache = self._cache()
        if cache is None:
            return False
        base = cache.data_ptr()
        region = self.num_blocks * self._block_bytes
        for r in range(self._regions):
            if self._closed:
                return False
            start = base + r * region + b0 * self._block_bytes
            end = base + r * region + b1 * self._block_bytes
            start -= start % _PAGE
            end += -end % _PAGE
            if self._madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                self.error = os.strerror(ctypes.get_errno())
                log.debug("mii: KV cache pages are faulted in on first use (madvise: %s)", self.error)
                return False
        return True

    def _idle_target(self) -> int:
        return min(self.num_blocks, 2 * self._written + self.ahead)

    def _idle_in(self) -> float | None:
        """Seconds until the engine counts as idle (<= 0: it is), None when there is nothing left to do then."""
        if self.idle_after is None or self.done >= self._idle_target():
            return None
        return self.idle_after - (time.monotonic() - self._last_want)

    def _run(self) -> None:
        try:  # Linux: a thread's own nice value; it yields to the engine's threads
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        if self._madvise is None:
            self.error = "no madvise"
        while self.error is None:
            with self._cv:
                while not (self._closed or self._want > self.done):
                    idle_in = self._idle_in()
                    if idle_in is not None and idle_in <= 0:
                        break
                    self._cv.wait(timeout=idle_in)
                if self._closed:
                    return
                if self._want > self.done:  # 16 blocks at a time: a new want is seen soon
                    b0, b1 = self.done, min(self._want, self.done + 16)
                else:  # the engine is idle: on toward twice what it used
                    b0, b1 = self.done, min(self._idle_target(), self.done + self._idle_step)
            ok = self._populate(b0, b1)
            with self._cv:
                if ok:
                    self.done = b1
                self._cv.notify_all()
            if not ok:
                return
