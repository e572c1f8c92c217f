"""The CPU KV cache's memory (mii/engine/kv_memory.py): its pages faulted in by a background thread
a margin ahead of the blocks in use, without changing what the engine wrote; residency read back with mincore(2)."""
import ctypes
import gc
import math
import mmap
import os
import time

import torch

from mii.engine.kv_memory import KVPrefault, zeros_lazy

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_NOHUGEPAGE = 15  # linux/mman.h


def resident(t: torch.Tensor) -> bool:
    """Whether every page under tensor `t` (contiguous) is resident."""
    assert t.is_contiguous()
    start = t.data_ptr() - t.data_ptr() % PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    end += -end % PAGE
    vec = (ctypes.c_ubyte * ((end - start) // PAGE))()
    assert _libc.mincore(start, end - start, vec) == 0, os.strerror(ctypes.get_errno())
    return all(v & 1 for v in vec)


def _cache(blocks=2048):
    """[layers, 2, blocks, block_size, kv_heads, head_dim], a block 16 * 2 * 64 * 4 bytes = two pages per region,
    on a fresh anonymous mapping of small pages: calloc may serve reused (resident) memory, and one transparent
    huge page would make 256 blocks resident at once where the test counts blocks."""
    shape = (2, 2, blocks, 16, 2, 64)
    mapping = mmap.mmap(-1, 4 * math.prod(shape))
    cache = torch.frombuffer(mapping, dtype=torch.float32).view(shape)
    assert _libc.madvise(cache.data_ptr(), len(mapping), MADV_NOHUGEPAGE) == 0, os.strerror(ctypes.get_errno())
    return cache


def test_faults_in_ahead_of_use_and_keeps_content():
    cache = _cache()
    written = torch.randn(16, 2, 64)
    cache[1, 0, 3] = written
    assert not resident(cache[0, 1, 20]) and not resident(cache[1, 1, 5])
    pre = KVPrefault(cache, ahead=4, idle_after=None)
    try:
        pre.want(10)
        assert pre.wait() and pre.error is None and pre.done == 14
        for layer in range(2):
            for kv in range(2):
                assert resident(cache[layer, kv, :14]), (layer, kv)
        # well past the margin: still not touched (the blocks' pages are whole, so block 20 shares none with 13)
        assert not resident(cache[0, 0, 20:]) and not resident(cache[1, 1, 20:])
        assert torch.equal(cache[1, 0, 3], written)
        cache[1, 0, 3] = 0
        assert not cache.view(torch.int32).any()  # nothing else was written
        pre.want(5000)  # clamped to the cache
        assert pre.wait() and pre.done == 2048 and resident(cache)
    finally:
        pre.close()


def test_no_margin_while_the_allocator_has_blocks_to_spare():
    """A busy engine's margin ahead of the blocks written is kept only while the allocator runs short of blocks it
    can hand out without new memory (`spare`): with enough idle cached blocks it reuses them, and nothing new is
    faulted in (before, a steady load of new prompts moved the cache onto new memory a margin at a time)."""
    cache = _cache()
    pre = KVPrefault(cache, ahead=4, idle_after=None)
    spare = [4]
    pre.spare = lambda: spare[0]
    try:
        pre.want(10)
        assert pre.wait() and pre.done == 10  # the blocks written, no margin
        assert not resident(cache[0, 0, 10:]) and not resident(cache[1, 1, 10:])
        spare[0] = 3  # running short: the margin again
        pre.want(10)
        assert pre.wait() and pre.done == 14 and resident(cache[1, 1, :14])
        assert not resident(cache[0, 0, 14:])
    finally:
        pre.close()


def test_an_idle_engine_gets_up_to_twice_what_it_used():
    cache = _cache()
    pre = KVPrefault(cache, ahead=4, idle_after=0.05)
    try:
        pre.want(10)
        deadline = time.monotonic() + 30
        while pre.done < 24 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # and no further
        assert pre.done == 24 == pre.resident() and pre.error is None
        assert all(resident(cache[layer, kv, :24]) for layer in range(2) for kv in range(2))
        assert not resident(cache[0, 0, 24:]) and not resident(cache[1, 1, 24:])
        assert not cache.view(torch.int32).any()
    finally:
        pre.close()


def test_the_thread_ends_with_the_cache():
    cache = _cache()
    pre = KVPrefault(cache, ahead=8)
    pre.want(0)
    assert pre.wait()
    thread = pre._thread
    del cache
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_close_stops_the_thread_between_regions():
    """close() returns once the thread has ended, even while it is faulting in a large range (it stops between two
    regions' madvise): at interpreter exit a thread still inside madvise aborted the process."""
    cache = _cache(blocks=65536)  # 4 regions of 512 MB
    pre = KVPrefault(cache, ahead=65536, idle_after=None)
    pre.want(1)  # the whole cache: seconds of page faults
    deadline = time.monotonic() + 10
    while not any(resident(cache[0, 0, b: b + 1]) for b in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.001)
    start = time.monotonic()
    pre.close()
    assert not pre._thread.is_alive() and time.monotonic() - start < 5
    assert pre.done < 65536  # it did not finish the range first


def test_an_engine_faults_in_its_cache_as_it_goes(pipe):
    """The engine's runner tells the thread the highest block each step writes; the engine gives it the
    allocator's count of blocks to spare."""
    pre = pipe.engine.runner.prefault
    assert pre.spare == pipe.engine.kv.allocator.num_reusable
    pipe(["hello"] * 3, max_new_tokens=8)
    assert pre.wait() and pre.error is None
    assert pre.done >= min(pre.num_blocks, pre.ahead + 1)
    cache = pipe.engine.runner.kv_cache
    assert all(resident(cache[layer, kv, : pre.done]) for layer in range(cache.shape[0]) for kv in range(2))


def test_a_lazy_cache_takes_small_pages_so_a_first_block_commits_only_its_own():
    """zeros_lazy's cache is [layers, 2, blocks, ...]: a prompt's first block lies in 2 × layers regions far apart,
    and with transparent huge pages each region's first write would fault in a whole 2 MB page (SmolLM2: 120 MB,
    zeroed and backed by a VM's host inside the first request's prefill). Small pages: only the block's own."""
    shape = (30, 2, 2912, 32, 3, 64)  # the embedded SmolLM2's 2 GiB default cache
    cache = zeros_lazy(shape, torch.bfloat16, torch.device("cpu"))
    block = torch.randn(shape[3:]).to(torch.bfloat16)
    for layer in range(shape[0]):
        for kv in range(2):
            cache[layer, kv, 0] = block
    for layer in range(shape[0]):
        for kv in range(2):
            assert resident(cache[layer, kv, 0]), (layer, kv)
            # a block's 12 KB are not whole pages: block 1 may share one with block 0, none further on does
            assert not any(resident(cache[layer, kv, b]) for b in (2, 3, 50, 150)), (layer, kv)
            assert torch.equal(cache[layer, kv, 0], block)
    assert not cache[:, :, 1:].view(torch.int16).any()
