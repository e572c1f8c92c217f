"""The only part of the engine that touches tensors: allocates the KV cache, turns a `ScheduledBatch` into
one forward pass, and samples.

Hot path rules: the step's metadata is built once, on the host with numpy, and moved to the device in a few
copies; the forward has no per-sequence Python loop; the one host sync per step is reading the sampled ids.

Tensor parallelism: `prepare` (host metadata, a picklable `StepMeta`) is split from `execute` (device tensors,
forward, logits). Rank 0 builds the metadata, sends it to the other ranks, and all run `execute` together
(the layers' collectives keep them in step); only rank 0 samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from mii.engine.constraints import fill_bitmask
from mii.engine.kv_memory import KVPrefault, zeros_lazy
from mii.engine.sampler import SamplerOutput, SamplingBatch, pad_ids, sample, token_logprobs, unpack_bitmask
from mii.engine.scheduler import ScheduledBatch
from mii.errors import KVCacheError, ValidationError
from mii.layers.attention import AttentionContext, AttentionGroup


@dataclass
class StepOutput:
    """What one forward pass produced: the sampled token (and logprobs) per sequence that reached its end."""

    uids: list[int]
    sampled: SamplerOutput
    prompt_logprobs: dict = field(default_factory=dict)
    """uid → [(prompt token id, logprob, {top id: logprob})] for the prompt positions this step computed."""

    def tokens_by_uid(self) -> dict[int, int]:
        return dict(zip(self.uids, self.sampled.tokens))


@dataclass
class GroupMeta:
    """An attention group's sequences (numpy, [S] each): query lengths, first positions, offsets in the flat
    batch, and block tables [S, max_blocks] padded with block 0."""

    lengths: np.ndarray
    starts: np.ndarray
    offsets: np.ndarray
    tables: np.ndarray


@dataclass
class StepMeta:
    """One step's host-side metadata: small numpy arrays, picklable, so rank 0 can hand it to the other
    tensor-parallel ranks, which run the same forward from it."""

    input_ids: np.ndarray    # [T] int64
    positions: np.ndarray    # [T] int64
    slots: np.ndarray        # [T] int64: KV cache slot (block * block_size + offset) of each new token
    groups: list             # [GroupMeta] for the torch attention backend: decode tokens, then prompt chunks
    logit_index: np.ndarray  # [R] int64: flat index of the last token of each chunk that samples
    sample_rows: np.ndarray  # [R] int64: which chunks of the batch those are
    query_start: np.ndarray  # [S + 1] int32: cumulative query lengths
    seq_lens: np.ndarray     # [S] int32: keys per sequence once this step's tokens are written
    block_tables: np.ndarray  # [S, max_blocks] int32, padded with 0
    num_decode: int          # leading sequences with one query token
    max_query_len: int = 1   # the longest chunk's tokens
    max_seq_len: int = 0     # the longest sequence's keys
    prompt_index: Optional[np.ndarray] = None  # [P] int64: flat index of each prompt token whose next-token
    # logprob a request asked for (prompt_logprobs); their logits follow the sampled rows' in `execute`


def kv_row(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one token's row of one kv head in the cache: an int8 cache's rows end in their fp32 scale."""
    return head_dim + 4 if dtype == torch.int8 else head_dim


def _allows_besides(row_bits: np.ndarray, ids: list[int]) -> bool:
    """Whether a constraint's bitmask row ([ceil(V / 32)] int32) allows a token outside `ids`."""
    row = row_bits.view(np.uint32).copy()
    for t in ids:
        row[t >> 5] &= ~np.uint32(1 << (t & 31))
    return bool(row.any())


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, eos_token_ids: tuple, vocab_size: int, tp_group=None, attention: str = "torch"):
        self.model = model
        self.attention = attention  # "kernel" reads the varlen metadata only; "torch" needs the padded groups
        self._sampling_cache: dict = {}  # batch's sequence uids -> SamplingBatch (parameters that do not move)
        self.tp_group = tp_group  # mii.parallel.TPGroup on rank 0 of a TP group: steps are sent to the others
        self.block_size = block_size
        self.device = device
        self.eos = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        layers = model.attention_layers()
        kvh, d = layers[0].n_kv_heads, layers[0].head_dim
        if kv_dtype == torch.int8:  # rows of d int8 values, then their fp32 scales (kernels/paged_attention_cpu.cpp)
            like = torch.empty(1, kvh, block_size, d + 4, dtype=torch.int8)
            if not torch.ops.mii.keys_paired(torch.empty(0, dtype=torch.bfloat16), like):
                raise ValidationError("kv_cache_dtype", f"int8 with head size {d} and blocks of {block_size}: mii's "
                                      "CPU kernel reads an int8 cache of head size 64 or 128, blocks of a multiple of "
                                      "16, on a CPU with AVX512-VNNI and AVX512-BF16")
        # [layers, 2, blocks, kv_heads, block_size, head_dim]: head-major blocks (mii/layers/attention.py)
        shape = (len(layers), 2, num_blocks, kvh, block_size, kv_row(d, kv_dtype))
        try:
            self.kv_cache = zeros_lazy(shape, kv_dtype, device)
        except (MemoryError, RuntimeError) as e:  # (torch.OutOfMemoryError is a RuntimeError)
            raise KVCacheError(f"cannot allocate the KV cache {list(shape)} ({kv_dtype}) on {device}: "
                               f"{type(e).__name__}: {e}") from None
        # on CPU its pages are faulted in by a background thread ahead of the blocks in use, and more while the
        # engine is idle; the allocator reads how far (kv_memory.py)
        self.prefault = KVPrefault(self.kv_cache) if device.type == "cpu" else None
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            layer.backend = attention
        if attention == "kernel":  # mii's kernels are there (C++ on CPU, Triton on a GPU): fused norm/rotary/silu too
            for m in model.modules():
                if hasattr(m, "fused"):
                    m.fused = True
            if device.type == "cpu":  # the decoder layers in one C++ call where the architecture allows
                for m in model.modules():
                    if hasattr(m, "fuse_stack"):
                        m.fuse_stack()
        if hasattr(model, "bind_ops"):
            model.bind_ops()
        # the threads of this engine's steps (the plan's), and the stack whose pace may take fewer for its steps on
        # a busy CPU (mii_team::Pace, kernels/team.h)
        self.threads = torch.get_num_threads()
        self.paced = next((m.stack["held"] for m in model.modules() if isinstance(getattr(m, "stack", None), dict)),
                          None)
        self.graphs = None  # mii.engine.cuda_graphs.DecodeGraphs on a GPU: decode steps replayed from CUDA graphs

    def pace(self) -> tuple[int, int]:
        """(the threads the steps take now, between trials; how often the pace took one fewer): the plan's threads
        and 0 without a paced stack."""
        if self.paced is None:
            return self.threads, 0
        threads, drops, _, _ = torch.ops.mii.stack_pace(self.paced)
        return int(threads) or self.threads, int(drops)  # (0: no step yet)

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        layers = model.attention_layers()
        return len(layers) * 2 * block_size * layers[0].n_kv_heads * kv_row(layers[0].head_dim, dtype) * dtype.itemsize

    # --- metadata ------------------------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> StepMeta:
        """The step's host-side metadata (numpy), built once; under tensor parallelism rank 0 sends it as is."""
        if self.attention == "kernel" and all(c.length == 1 for c in batch.chunks):
            return self._prepare_decode(batch)
        return self._prepare_any(batch)

    def _prepare_any(self, batch: ScheduledBatch) -> StepMeta:
        chunks = batch.chunks
        bs = self.block_size
        S = len(chunks)
        lengths = np.fromiter((c.length for c in chunks), np.int64, S)
        starts = np.fromiter((c.start for c in chunks), np.int64, S)
        query_start = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(lengths, out=query_start[1:])
        offsets = query_start[:-1]
        seq_lens = starts + lengths
        T = int(query_start[-1])
        # block tables [S, max_blocks], padded with block 0
        tables = np.zeros((S, int(-(-seq_lens.max() // bs))), dtype=np.int64)
        ids = []
        for i, c in enumerate(chunks):
            n = min(len(c.seq.block_table), tables.shape[1])
            tables[i, :n] = c.seq.block_table[:n]
            ids.extend(c.seq.token_ids[c.start: c.start + c.length])
        # each token's sequence row and position, without a per-sequence loop
        row = np.repeat(np.arange(S), lengths)                            # [T]
        positions = np.arange(T, dtype=np.int64) - offsets[row] + starts[row]
        slots = tables[row, positions // bs] * bs + positions % bs
        # the scheduler puts decode tokens first: they form one contiguous group, the rest another
        n_decode = int(np.argmin(lengths == 1)) if (lengths > 1).any() else S
        groups = []
        for a, b in ((0, n_decode), (n_decode, S)) if self.attention == "torch" else ():
            if b > a:
                groups.append(GroupMeta(lengths[a:b], starts[a:b], offsets[a:b],
                                        tables[a:b, : int(-(-seq_lens[a:b].max() // bs))]))
        rows = np.fromiter((i for i, c in enumerate(chunks) if c.samples), np.int64)
        meta = StepMeta(np.asarray(ids, dtype=np.int64), positions, slots, groups,
                        query_start[rows + 1] - 1, rows, query_start.astype(np.int32), seq_lens.astype(np.int32),
                        tables.astype(np.int32), n_decode, int(lengths.max()), int(seq_lens.max()))
        self._score_prompts(meta, batch, offsets)
        return meta

    def _prepare_decode(self, batch: ScheduledBatch) -> StepMeta:
        """`prepare` for a step of one token per sequence (the kernels' varlen view only), in plain Python over the
        sequences: at decode batch sizes numpy's cost per call outweighs its work, and a single-stream decode step
        ran its ~20 numpy calls with caches the weights had just swept: 0.15 ms, now 0.07 (docs/performance.md)."""
        chunks = batch.chunks
        bs, S = self.block_size, len(chunks)
        starts = [c.start for c in chunks]
        tables = np.zeros((S, max(starts) // bs + 1), dtype=np.int32)
        ids, slots = [], []
        for i, c in enumerate(chunks):
            table, p = c.seq.block_table, c.start
            tables[i, : len(table)] = table[: tables.shape[1]]
            ids.append(c.seq.token_ids[p])
            slots.append(table[p // bs] * bs + p % bs)
        rows = np.array([i for i, c in enumerate(chunks) if c.samples], dtype=np.int64)
        positions = np.array(starts, dtype=np.int64)
        meta = StepMeta(np.array(ids, dtype=np.int64), positions, np.array(slots, dtype=np.int64), [], rows, rows,
                        np.arange(S + 1, dtype=np.int32), (positions + 1).astype(np.int32), tables, S, 1,
                        max(starts) + 1)
        self._score_prompts(meta, batch, np.arange(S))
        return meta

    @staticmethod
    def _score_prompts(meta: StepMeta, batch: ScheduledBatch, offsets: np.ndarray) -> None:
        """Prompt logprobs: position j's logits score prompt token j + 1; positions already scored are skipped (a
        recomputed prompt after preemption)."""
        spans = _prompt_spans(batch)
        if spans:
            chunks = batch.chunks
            meta.prompt_index = np.concatenate([np.arange(offsets[i] + a - chunks[i].start,
                                                          offsets[i] + b - chunks[i].start) for i, a, b in spans])

    def _group(self, g: GroupMeta) -> AttentionGroup:
        bs = self.block_size
        S, lengths, starts, offsets = len(g.lengths), g.lengths, g.starts, g.offsets
        Q = int(lengths.max())
        q = np.arange(Q, dtype=np.int64)
        valid = q[None, :] < lengths[:, None]                            # [S, Q]
        token_idx = np.where(valid, offsets[:, None] + q[None, :], 0)    # [S, Q]
        q_pos = np.where(valid, starts[:, None] + q[None, :], 0)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)
        first, count = int(offsets[0]), int(lengths.sum())
        contiguous = bool(valid.all()) and (token_idx.reshape(-1) == np.arange(first, first + count)).all()
        return AttentionGroup(
            num_seqs=S, q_len=Q, span=(first, first + count) if contiguous else None,
            token_idx=None if contiguous else t(token_idx.reshape(-1)),
            valid=None if contiguous or valid.all() else t(valid.reshape(-1)),
            flat_idx=None if contiguous else t(token_idx[valid]),
            blocks=t(g.tables.reshape(-1)), q_pos=t(q_pos))

    def _inputs(self, meta: StepMeta):
        """Device tensors of a step: (input ids [T], positions [T], AttentionContext, logit_index [R])."""
        dev = self.device
        if dev.type == "cpu":  # (the arrays as they are)
            to = torch.from_numpy
        else:
            to = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # no host sync (pageable: staged at once)
        ctx = AttentionContext(slot_mapping=to(meta.slots), block_size=self.block_size,
                               num_tokens=len(meta.input_ids), groups=[self._group(g) for g in meta.groups],
                               query_start=to(meta.query_start), seq_lens=to(meta.seq_lens),
                               block_tables=to(meta.block_tables), max_query_len=meta.max_query_len,
                               max_seq_len=meta.max_seq_len, num_decode=meta.num_decode)
        return to(meta.input_ids), to(meta.positions), ctx, to(meta.logit_index)

    def execute(self, meta: StepMeta) -> Optional[torch.Tensor]:
        """Every rank's part of a step: the forward, and the logits of the sampled rows ([R, V], None if none). On
        the plan's threads, or fewer where the decoder stack's pace has seen a busy CPU take their time."""
        n = self.threads if self.paced is None else torch.ops.mii.stack_threads(self.paced, self.threads)
        if n == self.threads:
            return self._execute(meta)
        torch.set_num_threads(n)
        try:
            return self._execute(meta)
        finally:
            torch.set_num_threads(self.threads)

    def _execute(self, meta: StepMeta) -> Optional[torch.Tensor]:
        scoring = meta.prompt_index is not None and len(meta.prompt_index)
        if not scoring and self.graphs is not None and (logits := self.graphs.run(meta)) is not None:
            return logits
        input_ids, positions, ctx, logit_index = self._inputs(meta)
        if self.prefault is not None and len(meta.slots):
            self.prefault.want(int(meta.slots.max()) // self.block_size + 1)
        hidden = self.model(input_ids, positions, ctx)  # [T, hidden]
        if scoring:  # the prompt positions to score follow the sampled rows: [R + P, V]
            logit_index = torch.cat([logit_index, torch.from_numpy(meta.prompt_index).to(self.device)])
        if not len(logit_index):
            return None
        if scoring or len(logit_index) < len(hidden):  # (else every token's, in order: a decode step)
            hidden = hidden[logit_index]
        return self.model.compute_logits(hidden)  # [R, V] (or [R + P, V])

    def _forward(self, meta: StepMeta) -> Optional[torch.Tensor]:
        if self.tp_group is None:
            return self.execute(meta)
        self.tp_group.send(meta)
        with self.tp_group.guard():
            return self.execute(meta)

    def _sampling_batch(self, seqs) -> SamplingBatch:
        """The step's sampling tensors. The per-request parameters are rebuilt only when the batch's sequences
        change (in steady decode they do not); what moves every step (token counts, penalties' histories, the EOS
        ban before min_new_tokens) is rebuilt only when some row needs it."""
        key = tuple(s.uid for s in seqs)
        sb = self._sampling_cache.get(key)
        if sb is None:
            sb = self._sampling_cache[key] = self._sampling_params(seqs)
            if len(self._sampling_cache) > 8:
                self._sampling_cache.pop(next(iter(self._sampling_cache)))
        dev = self.device
        ps = [s.params for s in seqs]
        if not sb.all_greedy:
            sb.steps = torch.tensor([s.num_generated for s in seqs], dtype=torch.long).to(dev, non_blocking=True)
        if sb.penalties is not None:
            sb.penalties = sb.penalties[:3] + (
                pad_ids([s.prompt_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, ps)], dev),
                pad_ids([s.generated_ids for s in seqs], dev))
        sb.allowed = None
        if sb.constrained:  # the grammar moves every step: its bitmask too (on the CPU, by llguidance)
            V = self.vocab_size
            bits = fill_bitmask([seqs[i].constraint for i in sb.constrained], V)  # [C, ceil(V / 32)] int32
            if dev.type == "cpu":  # numpy unpacks bits ~10x faster than tensor shifts on the CPU
                sb.allowed = torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :V]
                                              .view(np.bool_))
            else:  # 32x fewer bytes to copy; unpacked on the device
                sb.allowed = unpack_bitmask(torch.from_numpy(bits).to(dev, non_blocking=True), V)
        sb.banned = None
        if sb.has_min_tokens:
            banned = [(list(self.eos) if not p.ignore_eos else []) + list(p.stop_token_ids)
                      if s.num_generated < p.min_new_tokens else [] for s, p in zip(seqs, ps)]
            # a grammar that allows nothing the ban leaves (it is complete: only EOS may follow) ends its request:
            # a complete grammar ends a request even before min_new_tokens
            for c, i in enumerate(sb.constrained):
                if banned[i] and not _allows_besides(bits[c], banned[i]):
                    banned[i] = []
            if any(banned):
                sb.banned = pad_ids(banned, dev)
        return sb

    def _sampling_params(self, seqs) -> SamplingBatch:
        V = self.vocab_size
        ps = [s.params for s in seqs]
        greedy = [p.greedy for p in ps]
        temperature = [1.0 if p.temperature is None else p.temperature for p in ps]
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in ps]
        top_k = [p.top_k if p.top_k else V for p in ps]
        dev = self.device
        sampled_rows = [not g for g in greedy]
        sb = SamplingBatch(
            greedy=torch.tensor(greedy).to(dev, non_blocking=True),
            temperature=torch.tensor(temperature).to(dev, non_blocking=True),
            top_p=torch.tensor(top_p).to(dev, non_blocking=True),
            top_k=torch.tensor(top_k).to(dev, non_blocking=True),
            min_p=torch.tensor([p.min_p for p in ps]).to(dev, non_blocking=True),
            seeds=torch.tensor([s.seed for s in seqs], dtype=torch.long).to(dev, non_blocking=True),
            steps=None,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_sort=any(r and (p.top_p < 1.0 or bool(p.top_k)) for r, p in zip(sampled_rows, ps)),
            any_min_p=any(r and p.min_p > 0 for r, p in zip(sampled_rows, ps)),
            logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
        )
        sb.has_min_tokens = any(p.min_new_tokens > 0 for p in ps)
        sb.constrained = tuple(i for i, s in enumerate(seqs) if s.constraint is not None)
        if sb.constrained:
            sb.constrained_rows = torch.tensor(sb.constrained, dtype=torch.long).to(dev, non_blocking=True)
        if any(p.logit_bias for p in ps):
            rows = [i for i, p in enumerate(ps) for _ in p.logit_bias]
            sb.logit_bias = (torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
                             torch.tensor([t for p in ps for t, _ in p.logit_bias], dtype=torch.long).to(dev),
                             torch.tensor([b for p in ps for _, b in p.logit_bias], dtype=torch.float32).to(dev))
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in ps):
            sb.penalties = (torch.tensor([p.repetition_penalty for p in ps]).to(dev, non_blocking=True),
                            torch.tensor([p.presence_penalty for p in ps]).to(dev, non_blocking=True),
                            torch.tensor([p.frequency_penalty for p in ps]).to(dev, non_blocking=True))
        return sb

    # --- the step ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        meta = self.prepare(batch)
        logits = self._forward(meta)
        if logits is None:
            return StepOutput([], SamplerOutput([]))
        R = len(meta.sample_rows)
        scored = _prompt_logprobs(logits[R:], batch) if meta.prompt_index is not None else {}
        seqs = [batch.chunks[i].seq for i in meta.sample_rows]
        sampled = sample(logits[:R], self._sampling_batch(seqs)) if R else SamplerOutput([])
        return StepOutput([s.uid for s in seqs], sampled, scored)

    @torch.inference_mode()
    def logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits of the sampled rows (for tests and scoring), without sampling."""
        logits = self._forward(self.prepare(batch))
        return logits.float() if logits is not None else torch.empty(0, self.vocab_size)


def _prompt_spans(batch: ScheduledBatch) -> list[tuple[int, int, int]]:
    """(chunk row, first, last): the prompt positions first..last - 1 of each chunk whose request wants prompt
    logprobs and that are not scored yet (position j's logits score prompt token j + 1)."""
    spans = []
    for i, c in enumerate(batch.chunks):
        if c.seq.prompt_logprobs is not None:
            first = max(c.start, len(c.seq.prompt_logprobs))
            last = min(c.start + c.length, c.seq.num_prompt - 1)
            if last > first:
                spans.append((i, first, last))
    return spans


def _prompt_logprobs(logits: torch.Tensor, batch: ScheduledBatch) -> dict:
    """uid → [(prompt token, logprob, {top id: logprob})] from the logits [P, V] of `_prompt_spans(batch)`."""
    spans = [(batch.chunks[i].seq, a, b) for i, a, b in _prompt_spans(batch)]
    targets = torch.tensor([t for seq, a, b in spans for t in seq.prompt_ids[a + 1: b + 1]], dtype=torch.long,
                           device=logits.device)
    k = max(seq.params.prompt_logprobs for seq, _, _ in spans)
    chosen, top_lp, top_ids = token_logprobs(logits, targets, k)                 # [P], [P, k], [P, k]
    chosen, top_lp, top_ids = chosen.tolist(), top_lp.tolist(), top_ids.tolist()
    out, row = {}, 0
    for seq, a, b in spans:
        kk = seq.params.prompt_logprobs
        out[seq.uid] = [(seq.prompt_ids[j + 1], chosen[row + j - a], dict(zip(top_ids[row + j - a][:kk],
                                                                               top_lp[row + j - a][:kk])))
                        for j in range(a, b)]
        row += b - a
    return out
