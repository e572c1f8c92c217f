"""Reading checkpoint tensors: Hugging Face safetensors (single or sharded), or `*.bin` (weights only).

Each reader yields (Hugging Face parameter name, tensor) pairs; `loader.py` routes them to parameters.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from mii.errors import ModelLoadError


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
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
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
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
            with safe_open(f, framework="pt") as sf:
                total += len(list(sf.keys()))
    return total


def iter_folder(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        else:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
