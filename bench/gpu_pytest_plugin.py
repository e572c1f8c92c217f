"""Loaded into the GPU check's pytest runs (`-p bench.gpu_pytest_plugin`). Tests keep several engines alive in one
process (a shared pipeline fixture plus the test's own), and on a GPU each engine's KV cache in `reserve` mode
takes all free memory but the reserve, so the second one would get none. Each engine here sees at most 8 GiB
free. (Product behaviour is unchanged: one engine per process takes the GPU, as vLLM's does.)"""
import torch

_real_mem_get_info = torch.cuda.mem_get_info


def _capped(device=None):
    free, total = _real_mem_get_info(device)
    return min(free, 8 << 30), total


torch.cuda.mem_get_info = _capped
