"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mii.layers.linear import bf16w_rows, check_shape, linear_op, packed_linear, tiled_rows
from mii.layers.quant import dequantize_rows, out_features, rows_op, scheme
from mii.parallel import all_gather_last, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    out_dtype = None  # the model's dtype when the weight is kept in bf16 (store_weights_bf16): rows are cast to it

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.tp_size = tp_size()
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // self.tp_size)
        self.start = tp_rank() * self.shard
        rows = max(0, min(self.shard, vocab_size - self.start))
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        part = loaded.narrow(0, self.start, param.shape[0]) if self.tp_size > 1 else loaded
        check_shape(param, part, "embedding")
        param.data.copy_(part)

    def _lookup(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """ids → rows of this rank's weight, by the weight's form: a weight tied to an LM head that mii::linear_bf16w
        reads is tiled (store_weights_bf16); a quantized one is in mii/layers/quant.py's layout."""
        w = self.weight
        if scheme(w) is not None:
            return functools.partial(dequantize_rows, w)
        return functools.partial(tiled_rows, w) if w.dim() == 3 else functools.partial(F.embedding, weight=w)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._lookup()(ids)

    def bound(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` bound once to the lookup it reaches where this rank holds the whole vocabulary (see
        CausalLM.bind_ops); else `forward` itself."""
        if self.tp_size > 1:
            return self.forward
        w, dtype = self.weight, self.out_dtype
        if scheme(w) is not None:  # (cast in the lookup itself)
            return functools.partial(rows_op(w.device), w, dtype=dtype)
        rows = self._lookup()
        return rows if dtype is None else (lambda ids: rows(ids).to(dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            y = self._rows(ids)
        else:
            w = self.weight
            rows = out_features(w) if scheme(w) else bf16w_rows(w)
            local = ids - self.start
            inside = (local >= 0) & (local < rows)
            y = self._rows(local.clamp(0, max(rows - 1, 0))) * inside.unsqueeze(-1)
        if self.out_dtype is not None:
            y = y.to(self.out_dtype)
        return y if self.tp_size == 1 else all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary; shares the embedding's weight when the model ties them."""

    packed = None  # oneDNN blocked copy of the weight, set by prepack_cpu_bf16
    bf16_kernel = False  # bf16 weight, fp32 math through mii::linear_bf16w (set by store_weights_bf16)

    def __init__(self, vocab_size: int, dim: int, bias: bool = False):
        super().__init__(vocab_size, dim)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.weight.shape[0]), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def bound(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` bound once to its matmul's op where this rank holds the whole vocabulary; else `forward`."""
        return linear_op(self, self.bias) if self.tp_size == 1 else self.forward

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = packed_linear(h, self, self.bias)
        if self.tp_size > 1:
            pad = self.shard - logits.shape[-1]
            logits = all_gather_last(F.pad(logits, (0, pad)))[..., : self.vocab_size]
        return logits
