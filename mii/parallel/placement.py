"""Where the ranks of a model go on this host's GPUs: MII's `device_map` read into one list of GPU ids per replica
(one id per tensor-parallel rank), checked so that no two ranks share a GPU (each engine plans its KV cache from
all of its GPU's free memory). A deployment gives replica i's process only its GPUs (`CUDA_VISIBLE_DEVICES`);
`mii.pipeline` (one replica) takes its device from it. Pure Python: tested without a GPU by passing the count."""
from __future__ import annotations

import socket
from typing import Optional

from mii.config import DEVICE_MAP_DEFAULT
from mii.errors import ValidationError


def gpu_count() -> int:
    """GPUs visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device_map_lists(device_map) -> Optional[list[list[int]]]:
    """MII's `device_map` forms as one list of GPU-id lists (one per replica); None for "auto"."""
    if device_map == DEVICE_MAP_DEFAULT:
        return None
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return [[device_map]]
    if isinstance(device_map, dict):
        here = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
        others = sorted(str(h) for h in device_map if h not in here)
        if others:
            raise ValidationError("device_map", f"names host(s) {', '.join(others)}: a deployment runs on this host "
                                                "only (key it by 'localhost')")
        lists = [x for v in device_map.values() for x in (v if isinstance(v, list) else [v])]
    elif isinstance(device_map, list) and device_map and all(isinstance(x, int) for x in device_map):
        lists = [device_map]
    elif isinstance(device_map, list):
        lists = device_map
    else:
        raise ValidationError("device_map", f"expected 'auto', a GPU id, a list of GPU ids (one replica), a list of "
                                            f"such lists (one per replica) or {{host: lists}}; got {device_map!r}")
    if not all(isinstance(ids, list) and ids and all(isinstance(d, int) and not isinstance(d, bool) for d in ids)
               for ids in lists):
        raise ValidationError("device_map", f"each replica needs a non-empty list of GPU ids; got {device_map!r}")
    return lists


def replica_devices(mc, gpus: int) -> list[Optional[list[int]]]:
    """The GPU ids (indices among the visible GPUs) of each replica, one per tensor-parallel rank, following
    `device_map` (MII's meaning; "auto": replica i takes GPUs i*tp .. (i+1)*tp-1), or None per replica when the
    deployment runs on CPU or on the one GPU `device="cuda:N"` names. A layout that would put two ranks on one GPU,
    or that this host cannot hold, is refused: each engine plans its KV cache from all of its GPU's free memory."""
    n, tp = mc.replica_num, mc.tensor_parallel
    lists = _device_map_lists(mc.device_map)
    on_gpu = mc.device.startswith("cuda") or (mc.device == "auto" and gpus > 0)
    if not on_gpu:
        if lists is not None:
            raise ValidationError("device_map", f"{mc.device_map!r} names GPUs, but this deployment runs on the CPU "
                                                f"(device={mc.device!r}, {gpus} GPU(s) visible); leave it 'auto'")
        return [None] * n
    if ":" in mc.device:  # one named GPU
        if lists is not None or n > 1:
            raise ValidationError("device", f"{mc.device!r} puts every replica on one GPU; with replica_num={n} "
                                            "leave device 'cuda' or 'auto' and give each replica its GPUs with "
                                            "device_map" if n > 1 else
                                            f"{mc.device!r} and device_map={mc.device_map!r} both place the model: "
                                            "give one of them")
        return [None]
    if lists is None:
        if n * tp > gpus:
            raise ValidationError("replica_num", f"{n} replica(s) x tensor_parallel={tp} need {n * tp} GPUs (one per "
                                                 f"rank), and {gpus} are visible; lower replica_num or "
                                                 "tensor_parallel")
        lists = [list(range(i * tp, (i + 1) * tp)) for i in range(n)]
    if len(lists) != n:
        raise ValidationError("device_map", f"has {len(lists)} replica placement(s) for replica_num={n}: give one "
                                            "list of GPU ids per replica")
    seen: set[int] = set()
    for i, ids in enumerate(lists):
        if len(ids) != tp:
            raise ValidationError("device_map", f"replica {i} has {len(ids)} GPU(s) {ids}, and tensor_parallel={tp} "
                                                "needs one per rank")
        bad = [d for d in ids if not 0 <= d < gpus]
        if bad:
            raise ValidationError("device_map", f"replica {i}: GPU id(s) {bad} are not among the {gpus} visible GPUs "
                                                f"(0..{gpus - 1})")
        shared = sorted(seen.intersection(ids)) + sorted({d for d in ids if ids.count(d) > 1})
        if shared:
            raise ValidationError("device_map", f"GPU(s) {sorted(set(shared))} appear twice: each rank needs a GPU of "
                                                "its own (every engine plans its KV cache from the whole GPU)")
        seen.update(ids)
    return lists


def pipeline_device(mc, gpus: int) -> str:
    """The device of `mii.pipeline` (one replica) after `device_map`: "cuda:N" for one rank. Tensor-parallel ranks
    take GPUs 0..N-1 of those this process sees, so a map naming others is refused, saying how to get them."""
    if mc.device_map == DEVICE_MAP_DEFAULT:
        return mc.device
    [ids] = replica_devices(mc.model_copy(update={"replica_num": 1}), gpus)
    tp = mc.tensor_parallel
    if tp == 1:
        return f"cuda:{ids[0]}"
    if ids != list(range(tp)):
        raise ValidationError("device_map", f"{ids}: the ranks of mii.pipeline(tensor_parallel={tp}) take GPUs "
                                            f"0..{tp - 1}; to use others, start the program with "
                                            f"CUDA_VISIBLE_DEVICES={','.join(str(i) for i in ids)}")
    return "cuda"
