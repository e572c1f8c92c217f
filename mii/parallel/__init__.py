"""Tensor parallelism: which rank this process is and the collectives the layers call (`state`); how the ranks
of a group meet, hand steps from rank 0 to the others and fail loudly (`group`); the spawned rank (`worker`);
which GPUs the ranks of each replica take, after MII's `device_map` (`placement`).

With one rank (the default) every collective is a no-op, so the layers need no special case.
"""
from mii.parallel.state import all_gather_last, all_reduce, tp_rank, tp_size, set_tp

__all__ = ["all_gather_last", "all_reduce", "tp_rank", "tp_size", "set_tp"]
