"""A GGUF file's quantized blocks kept as they are, for `quantization="auto"` (`mii.loading.quantize`).

GGUF stores a quantized matrix row by row in blocks of 32 (or 256) input features. Where a block format is an
affine map of small integers with fp16 constants, mii's packed layouts (`mii/layers/quant.py`) hold the same
values: **Q8_0** (d · q, q int8) is int8 with scale d; **Q4_0** (d · (q − 8)) is int4 with scale d, offset −8d;
**Q4_1** (d · q + m) is int4 with scale d, offset m — all three exactly, in groups of 32. **Q4_K**
(d · sc_j · q − dmin · m_j per sub-block of 32, 6-bit sc_j and m_j) is int4 with scale d · sc_j and offset
−dmin · m_j rounded to fp16: nearly (a relative error of at most 2^-11 of a group's scale and offset). Other
formats have no such map.

The GGUF conversion (`gguf_file`) writes these (q, scale, offset) rows next to the dequantized weights, in
`gguf_blocks/blocks.safetensors` of the cached folder (q of int4 two to a byte, low nibble first), so a load
never parses the GGUF again nor goes through floats: the loader routes them through each layer's own
`weight_loader` (fused q/k/v and gate/up parts, tensor-parallel slices) and packs what lands in a parameter.
The exact formats' floats are not written at all: `deferred_floats` dequantizes them from the blocks for a load
that wants floats (the gguf package's arithmetic in the same order, so the same fp32 values bit for bit). The
embedded SmolLM2's folder takes 96 MB instead of 609.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

BLOCKS_FILE = "gguf_blocks/blocks.safetensors"
GROUP = 32
EXACT = ("Q8_0", "Q4_0", "Q4_1")
NEARLY = ("Q4_K",)


@dataclass
class RawBlocks:
    """A matrix's GGUF blocks as mii's values: weight[n, k] = scale[n, k // 32] * q[n, k] (+ offset[n, k // 32])."""

    fmt: str
    """The GGUF block format ("Q4_1", ...)."""
    q: torch.Tensor
    """[N, K]: uint8 0..15 (int4) or int8."""
    scale: torch.Tensor
    """[N, K/32] fp16."""
    offset: Optional[torch.Tensor]
    """[N, K/32] fp16 (int4), None (int8)."""

    @property
    def scheme(self) -> str:
        return "int8" if self.offset is None else "int4"

    @property
    def exact(self) -> bool:
        return self.fmt in EXACT


def from_gguf(data: np.ndarray, fmt: str) -> Optional[RawBlocks]:
    """The blocks of a GGUF tensor (`data`: its raw bytes, [N, bytes per row]) in mii's terms, or None when the
    format has no int8/int4 map."""
    if fmt not in EXACT + NEARLY:
        return None
    rows = data.shape[0]
    raw = np.ascontiguousarray(data).reshape(rows, -1)
    if fmt == "Q8_0":  # per block: d (fp16), 32 x int8
        b = raw.reshape(rows, -1, 34)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        q = b[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return RawBlocks(fmt, torch.from_numpy(q), torch.from_numpy(d), None)
    if fmt in ("Q4_0", "Q4_1"):  # per block: d, [m,] 16 bytes: value j in the low nibble of byte j, j + 16 high
        head = 2 if fmt == "Q4_0" else 4
        b = raw.reshape(rows, -1, head + 16)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        if fmt == "Q4_0":
            m = (-8 * d.astype(np.float32)).astype(np.float16)
        else:
            m = b[..., 2:4].copy().view(np.float16)[..., 0]
        qs = b[..., head:]
        q = np.concatenate([qs & 15, qs >> 4], -1).reshape(rows, -1)
        return RawBlocks(fmt, torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
    # Q4_K: per 256: d, dmin (fp16), 12 bytes of 6-bit (sc, m) x 8, 128 bytes: 32-byte chunk c holds sub-block 2c
    # in its low nibbles and 2c + 1 in its high nibbles
    from gguf.quants import Q4_K

    b = raw.reshape(-1, 144)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16])  # [blocks, 8] each
    scale = (d * sc.reshape(-1, 8).astype(np.float32)).astype(np.float16).reshape(rows, -1)
    offset = (-(dmin * m.reshape(-1, 8).astype(np.float32))).astype(np.float16).reshape(rows, -1)
    qs = b[:, 16:].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], 2).reshape(rows, -1)
    return RawBlocks(fmt, torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(offset))


def dequantize(b: RawBlocks) -> torch.Tensor:
    """The float32 values of exact blocks, computed as `gguf.quants` dequantizes the file: d * q (Q8_0),
    d * (q - 8) (Q4_0), d * q + m (Q4_1), each step rounded to fp32 on its own (no fused multiply-add)."""
    if not b.exact:
        raise ValueError(f"{b.fmt} blocks do not hold the file's values exactly")
    n, k = b.q.shape
    q = b.q.view(n, k // GROUP, GROUP).float()
    d = b.scale.float().unsqueeze(-1)
    if b.fmt == "Q8_0":
        w = q * d
    elif b.fmt == "Q4_0":
        w = d * (q - 8)
    else:
        w = torch.add(d * q, b.offset.float().unsqueeze(-1))
    return w.view(n, k)


def save(blocks: dict[str, RawBlocks], formats: dict[str, str], folder: Path) -> None:
    """Write `blocks` (by Hugging Face tensor name) into `folder`'s BLOCKS_FILE, with every tensor's GGUF format
    (`formats`, those without blocks too)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, b in blocks.items():
        q = b.q if b.offset is None else b.q[:, 0::2] | (b.q[:, 1::2] << 4)  # int4: two to a byte
        tensors[f"{name}.q"] = q.contiguous()
        tensors[f"{name}.scale"] = b.scale.contiguous()
        if b.offset is not None:
            tensors[f"{name}.offset"] = b.offset.contiguous()
    path = folder / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"formats": json.dumps(formats)})


class BlockTable:
    """The blocks a converted GGUF folder kept, read one matrix at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._file = safe_open(str(folder / BLOCKS_FILE), framework="pt")
        self.file_formats: dict[str, str] = json.loads(self._file.metadata()["formats"])
        """Every tensor's GGUF format ("Q4_1", "Q6_K", "F32", ...) by Hugging Face name."""

    def get(self, name: str) -> RawBlocks:
        """The blocks of `name`, whose format is one of EXACT or NEARLY."""
        fmt = self.file_formats[name]
        q = self._file.get_tensor(f"{name}.q")
        scale = self._file.get_tensor(f"{name}.scale")
        if fmt == "Q8_0":
            return RawBlocks(fmt, q, scale, None)
        q = torch.stack([q & 15, q >> 4], -1).view(q.shape[0], -1)
        return RawBlocks(fmt, q, scale, self._file.get_tensor(f"{name}.offset"))

    def float_names(self) -> list[str]:
        """The matrices kept only as blocks (their formats exact): the converted folder has no floats of them."""
        names = {k.rpartition(".")[0] for k in self._file.keys()}
        return [n for n, fmt in self.file_formats.items() if fmt in EXACT and n in names]


class Deferred:
    """A matrix kept only as exact blocks, dequantized when `tensor()` is called: the loader calls it only for a
    parameter that takes floats (not for one packed from these same blocks)."""

    def __init__(self, table: BlockTable, name: str):
        self.table, self.name = table, name

    def tensor(self) -> torch.Tensor:
        return dequantize(self.table.get(self.name))


def deferred_floats(folder: Path) -> list[tuple[str, Deferred]]:
    """(name, `Deferred`) for the matrices a converted folder keeps only as exact blocks."""
    if not (folder / BLOCKS_FILE).is_file():
        return []
    table = BlockTable(folder)
    return [(name, Deferred(table, name)) for name in table.float_names()]
