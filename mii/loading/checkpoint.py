"""Reading checkpoint tensors: Hugging Face safetensors (single or sharded), or `*.bin` (weights only).

Each reader yields (Hugging Face parameter name, tensor) pairs; `loader.py` routes them to parameters. Nothing in
a checkpoint is ever executed: `.bin` files are unpickled with `weights_only=True` (tensors and plain containers
only), and a file that cannot be read (truncated, damaged, or pickling anything else) is a `ModelLoadError` naming
it.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch

from mii.errors import ModelLoadError


@contextlib.contextmanager
def reading(path: Path):
    """Turn any failure to read `path` into a `ModelLoadError` that names it."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot read {path}: {type(e).__name__}: {e} (is the file complete? a truncated or "
                             "damaged download must be fetched again)") from None


def _weight_map(index: Path) -> dict:
    with reading(index):
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError("weight_map is not a map of tensor names to file names")
        return weight_map


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _weight_map(index)
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(_weight_map(index).values()))]
    files = sorted(folder.glob("*.bin"))
    files = [f for f in files if f.name not in ("training_args.bin",)]
    if files:
        return files
    raise ModelLoadError(f"no *.safetensors or *.bin weights in {folder}")


def count_tensors(files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for f in files:
        if f.suffix == ".safetensors":
            with reading(f), safe_open(f, framework="pt") as sf:
                total += len(list(sf.keys()))
    return total


def iter_folder(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        # (only GeneratorExit, not an Exception, is ever raised at a yield here)
        with reading(f):
            if f.suffix == ".safetensors":
                with safe_open(f, framework="pt") as sf:
                    for name in sf.keys():
                        yield name, sf.get_tensor(name)
            else:
                state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                    raise ValueError("not a state dict (a map of names to tensors)")
                yield from state.items()
