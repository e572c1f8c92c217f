"""CUDA graphs for decode steps: capture the forward (and LM head) once per padded batch size at start, replay it
when a step fits, run eagerly otherwise.

Why: a decode step of a small model is hundreds of short kernels; launched one by one from Python the GPU waits
on the host. A graph launches them all at once. Prompt chunks (long, few steps) stay eager.

What a graph sees: static input buffers, filled before each replay from one pinned host buffer with two
non-blocking copies (everything but the block tables, then the block-table rows in use). A step of `n`
sequences replays the graph of the smallest captured size B >= n; rows n..B-1 are padding: token 0 at
position 0, no keys (`seq_len` 0, so attention gives zeros) and KV slot -1 (the Triton K/V write skips it).
The captured attention takes the decode tiles (max_query_len 1) and reads block tables up to each sequence's
length, so one table width (the longest context) serves every step.

Used only with our Triton attention (it skips slot -1 and reads the varlen metadata) and one process (graphs
under tensor parallelism need NCCL inside the capture; not checked on one GPU, so off).
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Optional

import numpy as np
import torch

from mii.layers.attention import AttentionContext

log = logging.getLogger("mii")

MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every 16, up to min(max_seqs, limit) (always included)."""
    top = max(1, min(max_seqs, limit))
    sizes = [s for s in (1, 2, 4, 8) if s < top] + [s for s in range(16, top, 16)] + [top]
    return sorted(set(sizes))


def bucket(sizes: list[int], n: int) -> Optional[int]:
    """The smallest size >= n, or None when n is larger than all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(meta) -> bool:
    """Every sequence of the step brings exactly one token (decode, or a one-token prompt chunk)."""
    S = len(meta.seq_lens)
    return meta.num_decode == S and len(meta.input_ids) == S


class _CudaGraph:
    """torch.cuda.CUDAGraph capture of `fn`, sharing one memory pool across sizes."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()
        self.pool = self.graph.pool()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class EagerReplay:
    """Stand-in for a graph (CPU tests): runs `fn` on the same static buffers at each replay."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool=None):
        self.fn, self.pool = fn, pool

    def replay(self) -> torch.Tensor:
        return self.fn()


class DecodeGraphs:
    """One graph per padded batch size over shared static inputs; `run(meta)` → logits [R, V], or None when the
    step does not fit (not decode-only, or more sequences than the largest graph)."""

    def __init__(self, runner, sizes: list[int], max_blocks_per_seq: int, graph_cls=None):
        self.sizes = sorted(sizes)
        self.model = runner.model
        dev = runner.device
        B, W = self.sizes[-1], max_blocks_per_seq
        on_gpu = dev.type == "cuda"
        # one int64 layout, host (pinned) and device: ids | positions | slots | seq_lens | query_start | tables
        head = 4 * B + B + 1
        self._host = torch.zeros(head + B * W, dtype=torch.int64, pin_memory=on_gpu)
        self._dev = torch.zeros(head + B * W, dtype=torch.int64, device=dev)
        self._head, self._B, self._W = head, B, W
        h = self._host.numpy()
        self.h_ids, self.h_pos, self.h_slots, self.h_lens = (h[i * B:(i + 1) * B] for i in range(4))
        self.h_tables = h[head:].reshape(B, W)
        h[4 * B: head] = np.arange(B + 1)  # query_start: one query per row, padding included
        self.h_slots[:] = -1
        d = self._dev
        self.ids, self.pos, self.slots, self.lens = (d[i * B:(i + 1) * B] for i in range(4))
        self.query_start = d[4 * B: head]
        self.tables = d[head:].view(B, W)
        self._dev.copy_(self._host)
        self._copied = torch.cuda.Event() if on_gpu else None
        self.graphs: dict = {}
        graph_cls = graph_cls or _CudaGraph
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            g = graph_cls(self._forward_fn(size, runner.block_size), pool)
            pool = g.pool
            self.graphs[size] = g

    def _forward_fn(self, B: int, block_size: int) -> Callable[[], torch.Tensor]:
        ctx = AttentionContext(slot_mapping=self.slots[:B], block_size=block_size, num_tokens=B, groups=[],
                               query_start=self.query_start[:B + 1], seq_lens=self.lens[:B],
                               block_tables=self.tables[:B], max_query_len=1, max_seq_len=0, num_decode=B)
        model = self.model
        # fresh views at each call: layers may cache per-step work keyed by the positions tensor's identity (the
        # rotary table lookup), and a capture must record that work, not find it cached
        return lambda: model.compute_logits(model(self.ids[:B], self.pos[:B], ctx))  # [B, V]

    def fits(self, meta) -> Optional[int]:
        if not is_decode_only(meta) or meta.block_tables.shape[1] > self._W:
            return None
        return bucket(self.sizes, len(meta.seq_lens))

    def stage(self, meta, B: int) -> int:
        """Write the step's metadata into the host buffer (padding rows after it); returns the rows in use."""
        n, w = len(meta.seq_lens), meta.block_tables.shape[1]
        self.h_ids[:n], self.h_ids[n:B] = meta.input_ids, 0
        self.h_pos[:n], self.h_pos[n:B] = meta.positions, 0
        self.h_slots[:n], self.h_slots[n:B] = meta.slots, -1
        self.h_lens[:n], self.h_lens[n:B] = meta.seq_lens, 0
        self.h_tables[:n, :w] = meta.block_tables  # entries past a row's length are never read
        return n

    def run(self, meta) -> Optional[torch.Tensor]:
        B = self.fits(meta)
        if B is None:
            return None
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the pinned buffer
        n = self.stage(meta, B)
        self._dev[: self._head].copy_(self._host[: self._head], non_blocking=True)
        self.tables[:n].copy_(self._host[self._head:].view(self._B, self._W)[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        logits = self.graphs[B].replay()  # [B, V]
        logit_index = meta.logit_index
        if len(logit_index) == n:  # every row samples (decode): rows 0..n-1
            return logits[:n]
        return logits[torch.from_numpy(logit_index).to(logits.device, non_blocking=True)]


def plan_cuda_graphs(runner, plan, enabled: bool, tp_group=None) -> None:
    """On a GPU: capture the decode graphs when they apply, else say in the plan why not."""
    if not enabled:
        plan.cuda_graphs = "off: cuda_graphs=False"
    elif tp_group is not None:
        plan.cuda_graphs = "off under tensor parallelism (NCCL inside graphs is not checked yet)"
    elif plan.attention != "kernel":
        plan.cuda_graphs = "off: they need the Triton attention (padding rows skip the K/V write)"
    else:
        capture_decode_graphs(runner, plan)


def capture_decode_graphs(runner, plan, graph_cls=None) -> Optional[DecodeGraphs]:
    """Capture the decode graphs for `plan` (its batch-size cap, context, block size), record sizes, time and
    memory in the plan, and attach them to the runner. Failures are logged and leave the runner eager."""
    sizes = graph_batch_sizes(plan.max_batch_seqs)
    width = -(-plan.max_context // plan.kv_block_size)
    on_gpu = runner.device.type == "cuda"
    t = time.perf_counter()
    before = torch.cuda.memory_reserved(runner.device) if on_gpu else 0
    try:
        with torch.inference_mode():
            graphs = DecodeGraphs(runner, sizes, width, graph_cls)
        if on_gpu:
            torch.cuda.synchronize(runner.device)
    except Exception as e:  # a capture failure costs speed, never correctness
        log.warning("mii: CUDA graph capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e)
        plan.cuda_graphs = f"off: capture failed ({type(e).__name__})"
        return None
    seconds = time.perf_counter() - t
    mib = ((torch.cuda.memory_reserved(runner.device) if on_gpu else 0) - before) / 2 ** 20
    plan.cuda_graphs = (f"{len(sizes)} decode batch sizes ({', '.join(map(str, sizes))}), "
                        f"captured in {seconds:.1f} s, {mib:.0f} MiB")
    runner.graphs = graphs
    return graphs
