"""Tensor parallelism: which rank this process is and the collectives the layers call.

With one rank (the default) every collective is a no-op, so the layers need no special case.
"""
from mii.parallel.state import all_gather_last, all_reduce, tp_rank, tp_size, set_tp

__all__ = ["all_gather_last", "all_reduce", "tp_rank", "tp_size", "set_tp"]
