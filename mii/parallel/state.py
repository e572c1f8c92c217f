"""Process-wide tensor-parallel rank and size, set once when a worker joins its group."""
from __future__ import annotations

import torch

_RANK, _SIZE = 0, 1


def set_tp(rank: int, size: int) -> None:
    global _RANK, _SIZE
    _RANK, _SIZE = rank, size


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _SIZE > 1:
        torch.distributed.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice along the last dimension."""
    if _SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
