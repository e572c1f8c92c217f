"""Weight-only quantization at load time (`ModelConfig.quantization`): which weights become int8 / int4 in
`mii/layers/quant.py`'s packed layouts, from what, and the account the engine plan shows.

- **What**: every linear (`LinearBase`: fused q/k/v, o, gate/up, down, and the other families' projections).
  The LM head (and an embedding tied to it) takes a GGUF's own blocks where they map (SmolLM2's Q8_0: exact,
  where bf16 rounds the file's values, and at one row 1.5x faster than bf16 through mii::linear_quant; Q8_0 also
  under an explicit int4, as finer than asked), else stays in the weight dtype: every logit goes through it, so
  it is where quantization error would show most.
  Kept in the weight dtype: an untied embedding (a step reads a few of its rows, not the matrix), norms, biases,
  MoE routers (they pick the experts, and are tiny) and MoE experts (stacked tensors the fused MoE layer
  multiplies itself). The KV cache and the activations keep the model's dtype.
- **When**: as each linear's weight is complete (`Quantizer.loaded`, called by `load_weights`), so the float
  copy is freed before the next is read: the resident memory after loading is the quantized model's. Under
  tensor parallelism each rank quantizes its own shard, so groups never straddle a shard boundary.
- **From a float checkpoint**: int8 symmetric per output channel (or groups of `quantization_group`), int4 scale
  + offset in groups of `quantization_group` (default `INT4_GROUP`); a matrix whose input size the group does not
  divide takes the largest of 128/64/32 below it that does; one with an odd number of rows or an input size not
  a multiple of 32 stays in the weight dtype.
- **From a GGUF file** (`gguf_blocks`): a linear whose every part (q, k and v of a fused qkv; gate and up) the
  file holds in one block format that maps onto the scheme asked for (auto: the file's own) gets those blocks
  as they are, routed through the layer's `weight_loader` like the float tensor (fused offsets, TP slices).
  Otherwise, with `auto`: a linear the file quantized in formats without a map (Q5_K, Q6_K, ...) or in mixed
  ones is quantized to int8 in groups of 32 from the file's values (8 bits against the file's 4-6), one the
  file keeps in float stays float. With an explicit `int8` / `int4`, it is quantized from the file's values.
"""
from __future__ import annotations

import collections
import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from mii.errors import ModelLoadError, ValidationError
from mii.layers.embedding import ParallelLMHead
from mii.layers.linear import LinearBase
from mii.layers.moe import SparseMoeBlock
from mii.layers.quant import INT4, INT8, group_size, pack_int4, pack_int8, quantize_int4, quantize_int8, scheme

INT4_GROUP = 64
GROUPS = (128, 64, 32)
GGUF_GROUP = 32
FLOAT_FORMATS = {"F32", "F16", "BF16", "F64"}
@dataclass(frozen=True)
class QuantSpec:
    """What the plan asked for: `scheme` int8 / int4 for every linear, or None with `keep_file` (auto on a GGUF:
    each linear keeps the file's own format)."""

    scheme: Optional[str]
    group: Optional[int]
    keep_file: bool = False

    @property
    def active(self) -> bool:
        return self.scheme is not None or self.keep_file


def quant_spec(quantization: str, group: Optional[int], device: str, source_kind: str) -> tuple[QuantSpec, str]:
    """The spec for `ModelConfig.quantization` on `device`, and the plan's reason for it."""
    on_gpu = device.startswith("cuda")
    if quantization in (INT8, INT4):
        if on_gpu:
            raise ValidationError("quantization", f"{quantization!r} runs on CPU only (mii::linear_quant); a GPU "
                                                  "has no kernel for these layouts here: use quantization='none' "
                                                  "(bf16/fp16 weights) on CUDA")
        g = group or (INT4_GROUP if quantization == INT4 else None)
        what = f"groups of {g}" if g else "one scale per output channel"
        return QuantSpec(quantization, g), (f"{quantization} weight-only, {what}, quantized at load; activations in "
                                            "the model dtype")
    if quantization == "auto" and source_kind == "gguf":
        if on_gpu:
            return QuantSpec(None, None), "auto: a GGUF is dequantized on a GPU (no kernel for its blocks there)"
        return QuantSpec(None, GGUF_GROUP, keep_file=True), ("auto: the GGUF's own blocks kept (Q8_0 → int8, "
                                                              "Q4_0/Q4_1 → int4 exactly, Q4_K → int4 nearly)")
    return QuantSpec(None, None), ("none: weights in the model's dtype" if quantization == "none" else
                                   "auto: a float checkpoint stays unquantized")


def pick_group(k: int, wanted: int) -> Optional[int]:
    """`wanted` if it divides `k`, else the largest of GROUPS below it that does (None when none does)."""
    for g in (wanted,) + tuple(g for g in GROUPS if g < wanted):
        if g % 32 == 0 and k % g == 0:
            return g
    return None


@dataclass
class QuantReport:
    """What loading did to each linear, for the engine plan."""

    kept_raw: collections.Counter = field(default_factory=collections.Counter)
    """GGUF block format → linears packed from the file's own blocks."""
    quantized: collections.Counter = field(default_factory=collections.Counter)
    """"int4 g64" etc. → linears quantized from float values."""
    requantized: dict = field(default_factory=dict)
    """Parameter name → why a linear a GGUF stores quantized was quantized again from its values."""
    unquantized: dict = field(default_factory=dict)
    """Parameter name → why it stayed in the weight dtype."""
    notes: list = field(default_factory=list)
    lm_head: str = ""
    """The GGUF block format the LM head kept, if it did."""

    def summary(self) -> str:
        parts = [f"{n} from the GGUF's {fmt} blocks" for fmt, n in sorted(self.kept_raw.items())]
        parts += [f"{n} quantized to {label}" for label, n in sorted(self.quantized.items())]
        if self.lm_head:
            parts.append(f"LM head from its {self.lm_head} blocks")
        if self.requantized:
            parts.append(f"{len(self.requantized)} " + "; ".join(_grouped(self.requantized)))
        if self.unquantized:
            parts.append(f"{len(self.unquantized)} not quantized: " + "; ".join(_grouped(self.unquantized)))
        return ", ".join(parts) + ("; " + "; ".join(self.notes) if self.notes else "")


def _grouped(why: dict, show: int = 3) -> list[str]:
    """'reason (names...)' per distinct reason."""
    by = collections.defaultdict(list)
    for name, reason in why.items():
        by[reason].append(name)
    return [f"{r} ({', '.join(n[:show])}{' ...' if len(n) > show else ''})" for r, n in by.items()]


def _label(w: torch.Tensor) -> str:
    s = scheme(w)
    if s is None:
        return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(w.dtype, str(w.dtype))
    g = group_size(w)
    return "int8 per-channel" if s == INT8 and w.shape[1] == 1 else f"{s} g{g}"


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's tensors by format ("int4 g32", "bf16", "fp32", ...): every parameter and prepacked
    weight once (a tied one once)."""
    seen, out = set(), collections.Counter()
    for m in model.modules():
        tensors = list(m.parameters(recurse=False)) + ([m.packed] if getattr(m, "packed", None) is not None else [])
        for t in tensors:
            if id(t) in seen or not t.numel():
                continue
            seen.add(id(t))
            out[_label(t.data)] += t.numel() * t.element_size()
    return dict(out.most_common())


class Quantizer:
    """Packs each linear's weight as soon as `load_weights` has filled it (`loaded`), from the GGUF's blocks or
    from its float values; `report` says what it did."""

    def __init__(self, model: nn.Module, spec: QuantSpec, folder: Optional[Path] = None):
        self.spec = spec
        self.report = QuantReport()
        # MoE routers stay float: they pick the experts (a flipped top-k changes the computation), and are tiny
        routers = {id(r) for m in model.modules() if isinstance(m, SparseMoeBlock)
                   for r in (m.gate, m.shared_expert_gate if m.shared_expert is not None else None) if r is not None}
        self.linears = {f"{name}.weight": m for name, m in model.named_modules()
                        if isinstance(m, LinearBase) and id(m) not in routers}
        self.heads = {id(m.weight): m for m in model.modules() if isinstance(m, ParallelLMHead)}
        # an embedding tied to a packed LM head reads its rows dequantized: they must come out in its dtype
        self.row_readers = [m for m in model.modules() if hasattr(m, "out_dtype") and hasattr(m, "weight")]
        self.blocks = None
        if spec.keep_file or (spec.active and folder is not None):
            from mii.loading import gguf_blocks

            if folder is not None and (folder / gguf_blocks.BLOCKS_FILE).is_file():
                self.blocks = gguf_blocks.BlockTable(folder)

    def loaded(self, pname: str, param: nn.Parameter, sources: list, materialize: Callable = lambda: None) -> None:
        """`param` (named `pname`) has all its parts, from checkpoint tensors `sources` [(name, shard id)].
        `materialize()` copies in the parts that came as exact blocks only (`gguf_blocks.Deferred`): called on
        every path that keeps or quantizes the floats, not where the blocks are packed."""
        if id(param) in self.heads and self.blocks is not None and param.dim() == 2:
            packed = self._from_blocks(pname, param, sources, lm_head=True)
            if packed is not None:
                for m in self.row_readers:
                    if m.weight is param and m.out_dtype is None:
                        m.out_dtype = param.dtype
                param.data = packed
                return
            materialize()
            if self._file_quantized(sources):
                self.report.unquantized[pname] = "the LM head, dequantized: its blocks do not map (to the scheme asked)"
            return
        module = self.linears.get(pname)
        if module is None or param.dim() != 2 or scheme(param) is not None:
            materialize()
            if self.blocks is not None and param.dim() == 2 and self._file_quantized(sources):
                self.report.unquantized[pname] = "dequantized: not a linear (an embedding reads a few rows a step)"
            return
        packed = self._from_blocks(pname, param, sources) if self.blocks is not None else None
        if packed is None:
            materialize()
            packed = self._from_float(pname, param, sources)
        if packed is not None:
            param.data = packed  # the float storage is freed here

    def _from_blocks(self, pname: str, param: nn.Parameter, sources: list,
                     lm_head: bool = False) -> Optional[torch.Tensor]:
        from mii.loading.gguf_blocks import EXACT, NEARLY

        fmts = {self.blocks.file_formats.get(name) for name, _ in sources}
        if not fmts <= set(EXACT + NEARLY):
            return None
        schemes = {INT8 if f == "Q8_0" else INT4 for f in fmts}
        wanted = self.spec.scheme
        # the LM head keeps Q8_0 under int4 too: the file's own values, 8 bits where int4 would lose some
        finer = lm_head and schemes == {INT8}
        if len(schemes) != 1 or (wanted is not None and schemes != {wanted} and not finer):
            return None
        n, k = param.shape
        if k % GGUF_GROUP or n % 2:
            self.report.notes.append(f"{pname}: a [{n}, {k}] shard cannot hold the file's blocks of 32 as they are")
            return None
        is_int4 = schemes == {INT4}
        q = torch.empty(n, k, dtype=torch.uint8 if is_int4 else torch.int8)
        s = torch.empty(n, k // GGUF_GROUP, dtype=torch.float16)
        m = torch.empty_like(s) if is_int4 else None
        loader = getattr(param, "weight_loader")
        for name, shard in sources:  # each part lands where the layer puts the float tensor (offsets, TP slices)
            raw = self.blocks.get(name)
            loader(q, raw.q, shard)
            loader(s, raw.scale, shard)
            if m is not None:
                loader(m, raw.offset, shard)
        label = "/".join(sorted(f if f in EXACT else f"{f} (scales rounded to fp16)" for f in fmts))
        if lm_head:
            self.report.lm_head = label
        else:
            self.report.kept_raw[label] += 1
        return pack_int4(q, s.float(), m.float()) if is_int4 else pack_int8(q, s.float())

    def _file_quantized(self, sources: list) -> bool:
        return any(self.blocks.file_formats.get(name, "F32") not in FLOAT_FORMATS for name, _ in sources)

    def _from_float(self, pname: str, param: nn.Parameter, sources: list) -> Optional[torch.Tensor]:
        target, group = self.spec.scheme, self.spec.group
        if target is None:  # auto on a GGUF: re-quantize what the file quantized without a map, else keep float
            if not self.spec.keep_file or self.blocks is None:
                return None
            fmts = {self.blocks.file_formats.get(name, "F32") for name, _ in sources}
            if not fmts - FLOAT_FORMATS:
                self.report.unquantized[pname] = f"{'/'.join(sorted(fmts))} in the file"
                return None
            target, group = INT8, GGUF_GROUP
            self.report.requantized[pname] = (f"re-quantized to int8 g32 from the file's {'/'.join(sorted(fmts))} "
                                              "(no int4/int8 map as a whole)")
        n, k = param.shape
        if n % 2 or k % 32:
            self.report.requantized.pop(pname, None)
            self.report.unquantized[pname] = f"[{n}, {k}]: needs an even number of rows and inputs in 32s"
            return None
        g = (pick_group(k, group) if group else k) if target == INT8 else pick_group(k, group)
        packed = quantize_int8(param.data, g) if target == INT8 else quantize_int4(param.data, g)
        if group and g != group:
            self.report.notes.append(f"{pname}: group {g} ({group} does not divide its {k} inputs)")
        if pname not in self.report.requantized:
            self.report.quantized[_label(packed)] += 1
        return packed


def release_freed_memory() -> None:
    """Give the float copies freed while quantizing back to the system (glibc keeps freed heap pages)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def check_model(model: nn.Module, spec: QuantSpec) -> None:
    """A model with nothing to quantize under an explicit scheme is a mistake worth saying."""
    if spec.scheme is not None and not any(scheme(p) for p in model.parameters()):
        raise ModelLoadError(f"quantization={spec.scheme!r}: no linear of {type(model).__name__} could be quantized")
