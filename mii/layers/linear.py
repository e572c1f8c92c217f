"""Linear layers whose parameters load their own slice of a checkpoint tensor.

`weight_loader(param, loaded, shard_id)` is how a checkpoint tensor reaches a parameter: column-parallel layers
keep their rank's rows, row-parallel ones their rank's columns, and fused layers (qkv, gate/up) place each
checkpoint tensor (`shard_id` "q"/"k"/"v" or 0/1) at its offset. Checkpoints that store the fused tensor
already (Phi-3's qkv_proj and gate_up_proj, Qwen's c_attn) pass `shard_id` "qkv" / "all": the layer splits it
into its parts and loads each as above, so tensor parallelism still takes the right rows.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mii import kernels
from mii.errors import ModelLoadError
from mii.layers.quant import quant_linear_op, scheme
from mii.parallel import all_gather_last, all_reduce, tp_rank, tp_size


def check_shape(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ModelLoadError(f"shape mismatch{' for ' + name if name else ''}: checkpoint has "
                             f"{tuple(loaded.shape)}, the model expects {tuple(param.shape)}")


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ModelLoadError(f"{what} ({n}) does not divide by tensor_parallel={d}")
    return n // d


@functools.lru_cache(maxsize=None)
def bf16_packable() -> bool:
    """Whether oneDNN can prepack bf16 linear weights here: it needs AVX512 (bw/vl/dq) or AVX-NE-CONVERT, and
    raises on other CPUs (AVX2-only machines), so ask it once with a small weight."""
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16), 64)
        return True
    except RuntimeError:
        return False


def packed_linear(x: torch.Tensor, module: nn.Module, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ module.weight.T + bias: through oneDNN's prepacked weight when there is one, through
    `mii::linear_bf16w` when the weight is kept in bf16 for fp32 math (`store_weights_bf16`), through
    `mii::linear_quant` when it is quantized (`mii/layers/quant.py`)."""
    return linear_op(module, bias)(x)


def linear_op(module: nn.Module, bias: Optional[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`packed_linear` for this module bound once to the op it reaches (by the weight's form: final once the model
    is loaded)."""
    if module.packed is not None:
        packed = module.packed
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    w = module.weight
    if scheme(w) is not None:
        act8, op = getattr(module, "act8", False), quant_linear_op(w.device)
        return lambda x: op(x, w, bias, act8)
    if module.bf16_kernel:
        return lambda x: torch.ops.mii.linear_bf16w(x, w, bias)
    return lambda x: F.linear(x, w, bias)


def tile_bf16w(w: torch.Tensor) -> torch.Tensor:
    """[N, K] → the tiled layout `mii::linear_bf16w` streams best: [N/8, K/8, 64], each tile 8 rows x 8 columns
    with the rows interleaved in pairs (tile element p*16 + j*2 + s is row 2p+s, column j). N and K must be
    multiples of 8."""
    n, k = w.shape
    return w.view(n // 8, 4, 2, k // 8, 8).permute(0, 3, 1, 4, 2).contiguous().view(n // 8, k // 8, 64)


def tile_bf16_kpairs(w: torch.Tensor) -> torch.Tensor:
    """[N, K] → the layout `mii::linear_bf16w` multiplies with native bf16 dot products (`vdpbf16ps`):
    [N/16, K/2, 32], tile j of a 16-row group holding columns 2j and 2j+1 of its rows (element r*2 + s is row r,
    column 2j + s). N must be a multiple of 16 and K even."""
    n, k = w.shape
    return w.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(n // 16, k // 2, 32)


def bf16w_rows(w: torch.Tensor) -> int:
    """Output rows of a weight `mii::linear_bf16w` reads: row-major, tiled or k-pair tiled."""
    return w.shape[0] * (1 if w.dim() == 2 else 16 if w.shape[-1] == 32 else 8)


def tiled_rows(tiles: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a tiled weight (either layout), row-major ([*ids.shape, K]): the embedding lookup of a tied
    LM head. `mii::tiled_rows` where the CPU kernels are built (the tiles exist only there), else these views."""
    if tiles.device.type == "cpu" and kernels.cpu_op("tiled_rows"):
        return torch.ops.mii.tiled_rows(tiles, ids)
    return tiled_rows_reference(tiles, ids)


def tiled_rows_reference(tiles: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`tiled_rows` by torch indexing of the tiles' views."""
    if tiles.shape[-1] == 32:  # k-pair tiles
        return tiles.view(tiles.shape[0], tiles.shape[1], 16, 2)[ids // 16, :, ids % 16].reshape(
            *ids.shape, tiles.shape[1] * 2)
    t = tiles.view(tiles.shape[0], tiles.shape[1], 4, 8, 2)
    r = ids % 8
    return t[ids // 8, :, r // 2, :, r % 2].reshape(*ids.shape, tiles.shape[1] * 8)


def store_weights_bf16(model: nn.Module, kpairs: bool = False) -> int:
    """Keep the weights of every linear, the LM head and the embedding in bf16 (half the bytes a decode step
    streams) while the rest of the model computes in its own dtype: their matmuls go through
    `mii::linear_bf16w` (bf16 weights widened to fp32 in registers), the embedding casts the rows it returns.
    A weight a matmul reads whose sides are multiples of 8 is stored tiled (`tile_bf16w`; an embedding tied to
    it reads its rows from the tiles). With `kpairs` (CPUs with native bf16 dot products, activations in bf16)
    the tiles are `tile_bf16_kpairs`'s, for weights with rows a multiple of 16 and an even width. Where the mii
    CPU kernels are built. Returns how many weights."""
    weights, matmul = {}, set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not (hasattr(m, "bf16_kernel") or hasattr(m, "out_dtype")) or w is None or w.dim() != 2 or not w.numel():
            continue
        if hasattr(m, "bf16_kernel"):
            m.bf16_kernel = True
            matmul.add(id(w))
        if hasattr(m, "out_dtype"):
            m.out_dtype = w.dtype  # before any conversion: a tied weight is shared with the LM head
        weights[id(w)] = w
    for w in weights.values():
        w.data = w.data.to(torch.bfloat16)
        if id(w) in matmul and kpairs and w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0:
            w.data = tile_bf16_kpairs(w.data)
        elif id(w) in matmul and not kpairs and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0:
            w.data = tile_bf16w(w.data)
    return len(weights)


def prepack_cpu_bf16(model: nn.Module) -> int:
    """Re-lay out the bf16 weights of every linear and LM head in oneDNN's blocked format: 1.3-2x faster
    matmuls at decode batch sizes (1-256 rows) on CPU, bit-identical results. A linear's dense copy is freed
    (weights are loaded by then); a weight shared with an embedding is kept. Returns how many were packed."""
    if not bf16_packable():
        return 0
    shared = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if "embed" in name}
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not hasattr(m, "packed") or w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.numel() == 0:
            continue
        m.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
        if id(w) not in shared:
            w.data = w.data.new_empty(0)
        n += 1
    return n


class LinearBase(nn.Module):
    packed = None  # oneDNN blocked copy of the weight, set by prepack_cpu_bf16
    bf16_kernel = False  # bf16 weight, fp32 math through mii::linear_bf16w (set by store_weights_bf16)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; `gather_output` rebuilds the full output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False):
        self.tp_size = tp_size()
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"), bias)
        self.gather_output = gather_output

    def weight_loader(self, param, loaded, shard_id=None):
        rows = param.shape[0]
        loaded = loaded.narrow(0, tp_rank() * rows, rows) if self.tp_size > 1 else loaded
        check_shape(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x):
        y = packed_linear(x, self, self.bias)
        return all_gather_last(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate/up); `shard_id` is the index of the part."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id == "all":  # the checkpoint stores the parts concatenated: [part 0; part 1; ...]
            for i, part in enumerate(loaded.split(self.out_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        size = self.out_sizes[shard_id] // self.tp_size
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        part = loaded.narrow(0, tp_rank() * size, size) if self.tp_size > 1 else loaded
        target = param.data.narrow(0, offset, size)
        check_shape(target, part, f"part {shard_id}")
        target.copy_(part)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are split across ranks, or replicated when there are fewer than ranks."""

    def __init__(self, hidden: int, head_dim: int, n_heads: int, n_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.total_sizes = [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim]
        self.n_heads = divide(n_heads, tp, "attention heads")
        if n_kv_heads >= tp:
            self.n_kv_heads = divide(n_kv_heads, tp, "key/value heads")
            self.kv_replicas = 1
        else:
            self.n_kv_heads = 1
            self.kv_replicas = divide(tp, n_kv_heads, "ranks per key/value head")
        out = (self.n_heads + 2 * self.n_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id == "qkv":  # the checkpoint stores [q; k; v] concatenated
            for sid, part in zip("qkv", loaded.split(self.total_sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        index = tp_rank() if shard_id == "q" else tp_rank() // self.kv_replicas
        part = loaded.narrow(0, index * size, size) if self.tp_size > 1 else loaded
        target = param.data.narrow(0, offset, size)
        check_shape(target, part, f"{shard_id}_proj")
        target.copy_(part)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (bias added once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp_size = tp_size()
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 2 and self.tp_size > 1:
            cols = param.shape[1]
            loaded = loaded.narrow(1, tp_rank() * cols, cols)
        check_shape(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x):
        y = all_reduce(packed_linear(x, self, None))
        return y + self.bias if self.bias is not None else y
