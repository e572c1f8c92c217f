"""Packed weights cached on disk: a model's parameters as the kernels read them (int8/int4 packed by a
quantization, bf16 weights in the tiles of `store_weights_bf16`, the rest in the model's dtype), kept in
`$MII_CACHE_DIR/packed/<key>` (default ~/.cache/mii) so that the next start of the same checkpoint, settings and
mii maps them as they are (no copy: the file's pages are the weights, shared by every process that maps them)
instead of reading the checkpoint and packing it again (a 0.5B-parameter model: ~2 s of quantization a start; a 7B
one, ~30 s and its 14 GB of bf16 read; a 1B one in bf16, ~4 s of copies and tiling).

The key holds what the packed values depend on: the checkpoint folder's files (names, sizes, times), the
quantization asked for, the model's dtype, class and bf16 layout, and the source of the code that lays parameters
out and packs them (`mii/loading`, `mii/layers`, `mii/models`). A copy of the same checkpoint whose files changed,
or packed by other code, is removed when a new one is written, as are those of checkpoints that are gone; a read
marks its copy used, and any copy nobody read for 30 days goes too. A write that would leave the disk with less
than `MIN_FREE_BYTES` (or a twentieth of it) free is skipped. One rank only: under tensor parallelism each rank
packs its own shard, as before.
`MII_PACKED_CACHE=0` turns the cache off.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from mii.envs import cache_dir
from mii.kernels import UNUSED_DAYS  # (the kernel builds' rule: a copy nobody read for this long goes)
from mii.layers.quant import scheme
from mii.loading.quantize import QuantReport, QuantSpec

log = logging.getLogger("mii")

FORMAT_VERSION = 2
MIN_FREE_BYTES = 2 << 30  # what a write leaves free on the cache's disk, at least
WEIGHTS_FILE = "model.safetensors"
RECORD_FILE = "record.json"  # the source folder, its files' identity, the code's, the QuantReport, the modules' flags
_CODE = sorted(p for d in ("loading", "layers", "models") for p in (Path(__file__).parents[1] / d).glob("*.py"))


def _identity(folder: Path) -> str:
    """The checkpoint folder's files as they are now: names, sizes and modification times."""
    parts = [f"{p.name}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in sorted(folder.iterdir()) if p.is_file()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _code() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in _CODE) + f"{FORMAT_VERSION}".encode()).hexdigest()[:16]


@dataclasses.dataclass
class Entry:
    """Where a checkpoint's packed weights are (or will be) cached under one quantization and dtype."""

    folder: Path
    source: Path
    identity: str
    code: str

    @property
    def exists(self) -> bool:
        return (self.folder / RECORD_FILE).is_file() and (self.folder / WEIGHTS_FILE).is_file()


@dataclasses.dataclass
class Read:
    """A copy read into the model: the account of its quantization (None where none was asked for)."""

    report: Optional[QuantReport]


def entry(source: Path, spec: Optional[QuantSpec], dtype: torch.dtype, model: nn.Module, layout: str) -> Entry:
    """`layout`: how the bf16 weights are laid out ("" as loaded, or `store_weights_bf16`'s tiles)."""
    identity, code = _identity(source), _code()
    what = f"{source.resolve()}|{identity}|{code}|{spec}|{dtype}|{type(model).__name__}|{layout}"
    key = hashlib.sha256(what.encode()).hexdigest()[:16]
    return Entry(cache_dir() / "packed" / f"{source.name}-{key}", source.resolve(), identity, code)


def load(at: Entry, model: nn.Module) -> Optional[Read]:
    """Put the cached parameters into `model` (built, not loaded), mapped from the file, with the modules' flags
    as they were written; None (with a warning, the folder removed) where the folder cannot be read."""
    from safetensors.torch import load_file

    params = dict(model.named_parameters())
    try:
        record = json.loads((at.folder / RECORD_FILE).read_text())
        tensors = {n: t for n, t in load_file(str(at.folder / WEIGHTS_FILE)).items() if not n.startswith(_PAD)}
        if set(tensors) != set(params):
            raise ValueError(f"other parameters than {type(model).__name__} has")
        modules = dict(model.named_modules())
        flags = [(modules[name], "out_dtype", getattr(torch, dtype)) for name, dtype in record["out_dtypes"].items()]
        flags += [(modules[name], "bf16_kernel", True) for name in record["bf16_kernels"]]
    except Exception as e:  # (nothing assigned yet: the checkpoint loads as if there were no cache)
        log.warning("mii: ignoring the packed weights cached in %s (%s: %s)", at.folder, type(e).__name__, e)
        shutil.rmtree(at.folder, ignore_errors=True)
        return None
    for name, param in params.items():
        param.data = tensors[name]
    for module, flag, value in flags:  # (an embedding's rows' dtype; a linear that reads bf16 tiles)
        setattr(module, flag, value)
    with contextlib.suppress(OSError):
        os.utime(at.folder / RECORD_FILE)  # (its last use)
    _remove_stale(at, written=False)
    report = record["report"]
    return Read(report and QuantReport(
        kept_raw=collections.Counter(report["kept_raw"]), quantized=collections.Counter(report["quantized"]),
        requantized=report["requantized"], unquantized=report["unquantized"], notes=report["notes"],
        lm_head=report["lm_head"]))


def save(at: Entry, model: nn.Module, report: Optional[QuantReport]) -> bool:
    """Start writing `model`'s parameters, its modules' flags and `report` under `at` on a thread of its own, so that
    the start does not wait for the disk (a bf16 1B model: 2 GB); True if it started. False (and a warning) where
    the folder cannot be made or the disk would be left too full. The thread writes atomically (a folder renamed
    into place), then removes the cached folders that can never be read again; Python waits for it at exit, and
    `wait_for_writes` in the meantime."""
    out_dtypes = {name: str(m.out_dtype).removeprefix("torch.") for name, m in model.named_modules()
                  if getattr(m, "out_dtype", None) is not None}
    record = {"source": str(at.source), "identity": at.identity, "code": at.code, "out_dtypes": out_dtypes,
              "bf16_kernels": [name for name, m in model.named_modules() if getattr(m, "bf16_kernel", False)],
              "report": report and {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}}
    tensors = {n: p.data for n, p in model.named_parameters()}  # (held by the thread until written)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        at.folder.parent.mkdir(parents=True, exist_ok=True)
        disk = shutil.disk_usage(at.folder.parent)
    except OSError as e:
        log.warning("mii: could not cache the packed weights in %s (%s); the next start packs them again", at.folder, e)
        return False
    if disk.free - size < max(MIN_FREE_BYTES, disk.total // 20):
        log.warning("mii: not caching the packed weights (%.1f GB) in %s: the disk has %.1f GB free; the next start "
                    "packs them again", size / 1e9, at.folder.parent, disk.free / 1e9)
        return False
    threading.Thread(target=_write, args=(at, tensors, record), name=_WRITER).start()
    return True


def wait_for_writes(timeout: Optional[float] = None) -> None:
    """Wait for the copies this process is writing (`save`)."""
    for writer in threading.enumerate():
        if writer.name == _WRITER:
            writer.join(timeout)


_WRITER = "mii-packed-cache"  # (the writing threads' name)


def _write(at: Entry, tensors: dict, record: dict) -> None:
    if _write_folder(at, tensors, record):
        _remove_stale(at, written=True)


def _write_folder(at: Entry, tensors: dict, record: dict) -> bool:
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=at.folder.parent))
        _write_aligned(tmp / WEIGHTS_FILE, tensors)
        (tmp / RECORD_FILE).write_text(json.dumps(record))
        os.replace(tmp, at.folder)
        return True
    except Exception as e:  # (a full disk, a lost race; never a failed load)
        if at.exists:  # (another process wrote the same folder first)
            return True
        log.warning("mii: could not cache the packed weights in %s (%s); the next start packs them again", at.folder, e)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # (gone once renamed)


_PAD = "__pad."  # (filler tensors, not parameters)
_ALIGN = 64
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.bool: "BOOL"}


def _write_aligned(path: Path, tensors: dict) -> None:
    """A safetensors file whose every tensor starts on a 64-byte boundary of the file, so of its mapping: the
    kernels' 64-byte loads then never straddle two cache lines (`safetensors.torch.save_file` packs them back to
    back, 8-byte aligned: a bf16 1B model's 512-token prompt ran ~1.35x slower from such a file's pages). The
    format has no gaps, so a U8 filler tensor (`_PAD`) takes each; the header is padded with spaces."""
    header, parts, at = {}, [], 0
    for name, t in tensors.items():
        if at % _ALIGN:
            pad = _ALIGN - at % _ALIGN
            header[f"{_PAD}{len(parts)}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [at, at + pad]}
            parts.append(torch.zeros(pad, dtype=torch.uint8))
            at += pad
        t = t.detach().contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        parts.append(t.reshape(-1).view(torch.uint8))
        at += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for part in parts:
            f.write(part.numpy().data)


def _remove_stale(kept: Entry, written: bool) -> None:
    """Remove the cached copies that can no longer be read or were not read for UNUSED_DAYS: those of checkpoints
    that are gone, those nobody read for that long, writes that died a day ago or more, and, after a write, this
    checkpoint's copies from before its files or the code changed (another mii version may be reading its own copy
    of the same files: that is left alone on reads). Other quantizations and dtypes of the same files stay."""
    now = time.time()
    for folder in kept.folder.parent.iterdir():
        try:
            if folder == kept.folder or not folder.is_dir():
                continue
            if folder.name.startswith("."):
                if folder.name.startswith(".writing-") and folder.stat().st_mtime < now - 86400:
                    shutil.rmtree(folder, ignore_errors=True)
                continue
            record_file = folder / RECORD_FILE
            record = json.loads(record_file.read_text())
            source = Path(record["source"])
            changed = source == kept.source and (record.get("identity"), record.get("code")) != (kept.identity,
                                                                                                kept.code)
            if (not source.exists() or record_file.stat().st_mtime < now - UNUSED_DAYS * 86400
                    or (written and changed)):
                shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue
