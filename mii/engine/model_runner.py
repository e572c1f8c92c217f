"""The only part of the engine that touches tensors: allocates the KV cache, turns a `ScheduledBatch` into
one forward pass, and samples.

Hot path rules: the step's metadata is built once, on the host with numpy, and moved to the device in a few
copies; the forward has no per-sequence Python loop; the one host sync per step is reading the sampled ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mii.engine.sampler import SamplerOutput, SamplingBatch, pad_ids, sample
from mii.engine.scheduler import ScheduledBatch, ScheduledChunk
from mii.layers.attention import AttentionContext, AttentionGroup


@dataclass
class StepOutput:
    """What one forward pass produced: the sampled token (and logprobs) per sequence that reached its end."""

    uids: list[int]
    sampled: SamplerOutput

    def tokens_by_uid(self) -> dict[int, int]:
        return dict(zip(self.uids, self.sampled.tokens))


def zeros_lazy(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU from calloc (numpy), so the pages are zeroed by the OS when first touched and a
    large KV cache costs neither start-up time nor memory until it is used. Zeros matter: masked attention
    still multiplies by never-written slots, and 0 * NaN would poison the output."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(shape, dtype=np.dtype(f"u{dtype.itemsize}"))
    return torch.from_numpy(raw).view(dtype)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, eos_token_ids: tuple, vocab_size: int):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.eos = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        layers = model.attention_layers()
        kvh, d = layers[0].n_kv_heads, layers[0].head_dim
        # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.kv_cache = zeros_lazy((len(layers), 2, num_blocks, block_size, kvh, d), dtype, device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        layers = model.attention_layers()
        return len(layers) * 2 * block_size * layers[0].n_kv_heads * layers[0].head_dim * dtype.itemsize

    # --- metadata ------------------------------------------------------------------------------------------------

    def _group(self, chunks: list[ScheduledChunk], offsets: np.ndarray) -> AttentionGroup:
        bs = self.block_size
        S = len(chunks)
        lengths = np.fromiter((c.length for c in chunks), np.int64, S)
        Q = int(lengths.max())
        starts = np.fromiter((c.start for c in chunks), np.int64, S)
        max_blocks = int(-(-(starts + lengths).max() // bs))
        tables = np.zeros((S, max_blocks), dtype=np.int64)
        for i, c in enumerate(chunks):
            n = min(len(c.seq.block_table), max_blocks)
            tables[i, :n] = c.seq.block_table[:n]
        q = np.arange(Q, dtype=np.int64)
        valid = q[None, :] < lengths[:, None]                            # [S, Q]
        token_idx = np.where(valid, offsets[:, None] + q[None, :], 0)    # [S, Q]
        q_pos = np.where(valid, starts[:, None] + q[None, :], 0)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        first, count = int(offsets[0]), int(lengths.sum())
        contiguous = bool(valid.all()) and (token_idx.reshape(-1) == np.arange(first, first + count)).all()
        return AttentionGroup(
            num_seqs=S, q_len=Q, span=(first, first + count) if contiguous else None,
            token_idx=None if contiguous else t(token_idx.reshape(-1)),
            valid=None if contiguous or valid.all() else t(valid.reshape(-1)),
            flat_idx=None if contiguous else t(token_idx[valid]),
            blocks=t(tables.reshape(-1)), q_pos=t(q_pos))

    def _prepare(self, batch: ScheduledBatch):
        chunks = batch.chunks
        bs = self.block_size
        lengths = np.fromiter((c.length for c in chunks), np.int64, len(chunks))
        offsets = np.zeros(len(chunks), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        ids, pos, slots = [], [], []
        for c in chunks:
            ids.extend(c.seq.token_ids[c.start: c.start + c.length])
            p = np.arange(c.start, c.start + c.length)
            pos.append(p)
            slots.append(np.asarray(c.seq.block_table, dtype=np.int64)[p // bs] * bs + p % bs)
        positions = np.concatenate(pos)
        # the scheduler puts decode tokens first: they form one contiguous group, the rest another
        n_decode = int(np.argmin(lengths == 1)) if (lengths > 1).any() else len(chunks)
        groups = [self._group(chunks[a:b], offsets[a:b]) for a, b in ((0, n_decode), (n_decode, len(chunks))) if b > a]
        ctx = AttentionContext(slot_mapping=torch.from_numpy(np.concatenate(slots)).to(self.device),
                               block_size=bs, num_tokens=int(lengths.sum()), groups=groups)
        sample_rows = [i for i, c in enumerate(chunks) if c.samples]
        last = offsets[sample_rows] + lengths[sample_rows] - 1
        return (torch.tensor(ids, dtype=torch.long, device=self.device), torch.from_numpy(positions).to(self.device),
                ctx, [chunks[i].seq for i in sample_rows], torch.from_numpy(last).to(self.device))

    def _sampling_batch(self, seqs) -> SamplingBatch:
        V = self.vocab_size
        ps = [s.params for s in seqs]
        greedy = [p.greedy for p in ps]
        temperature = [1.0 if p.temperature is None else p.temperature for p in ps]
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in ps]
        top_k = [p.top_k if p.top_k else V for p in ps]
        dev = self.device
        sampled_rows = [not g for g in greedy]
        sb = SamplingBatch(
            greedy=torch.tensor(greedy, device=dev),
            temperature=torch.tensor(temperature, device=dev),
            top_p=torch.tensor(top_p, device=dev),
            top_k=torch.tensor(top_k, device=dev),
            min_p=torch.tensor([p.min_p for p in ps], device=dev),
            seeds=torch.tensor([s.seed for s in seqs], dtype=torch.long, device=dev),
            steps=torch.tensor([s.num_generated for s in seqs], dtype=torch.long, device=dev),
            all_greedy=all(greedy),
            needs_sort=any(r and (p.top_p < 1.0 or bool(p.top_k)) for r, p in zip(sampled_rows, ps)),
            any_min_p=any(r and p.min_p > 0 for r, p in zip(sampled_rows, ps)),
            logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
        )
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in ps):
            sb.penalties = (
                torch.tensor([p.repetition_penalty for p in ps], device=dev),
                torch.tensor([p.presence_penalty for p in ps], device=dev),
                torch.tensor([p.frequency_penalty for p in ps], device=dev),
                pad_ids([s.prompt_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, ps)], dev),
                pad_ids([s.generated_ids for s in seqs], dev))
        banned = [(list(self.eos) if not p.ignore_eos else []) + list(p.stop_token_ids)
                  if s.num_generated < p.min_new_tokens else [] for s, p in zip(seqs, ps)]
        if any(banned):
            sb.banned = pad_ids(banned, dev)
        return sb

    # --- the step ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        input_ids, positions, ctx, seqs, last = self._prepare(batch)
        hidden = self.model(input_ids, positions, ctx)  # [T, hidden]
        if not seqs:
            return StepOutput([], SamplerOutput([]))
        logits = self.model.compute_logits(hidden[last])  # [S, V]
        return StepOutput([s.uid for s in seqs], sample(logits, self._sampling_batch(seqs)))

    @torch.inference_mode()
    def logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits of the sampled rows (for tests and scoring), without sampling."""
        input_ids, positions, ctx, seqs, last = self._prepare(batch)
        return self.model.compute_logits(self.model(input_ids, positions, ctx)[last]).float()
