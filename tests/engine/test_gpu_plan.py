"""GPU choices of the engine plan, checked without a GPU: device strings, the auto dtype per compute capability,
and why CUDA graphs are on or off."""
import pytest

from mii.config import ModelConfig
from mii.engine.cuda_graphs import plan_cuda_graphs
from mii.engine.plan import EnginePlan, check_cuda_device, cuda_dtype
from mii.errors import UnknownArgument, ValidationError


@pytest.mark.parametrize("cap,dtype", [((7, 0), "float16"), ((7, 5), "float16"), ((8, 0), "bfloat16"),
                                       ((8, 6), "bfloat16"), ((9, 0), "bfloat16"), ((12, 0), "bfloat16")])
def test_auto_dtype_by_compute_capability(cap, dtype):
    assert cuda_dtype(cap) == dtype


def test_device_strings():
    for ok in ("auto", "cpu", "cuda", "cuda:0", "cuda:7"):
        assert ModelConfig(device=ok).device == ok
    for bad in ("gpu", "cuda:", "cuda:x", "CUDA", "cuda:1:2", "mps"):
        with pytest.raises((ValidationError, UnknownArgument, ValueError), match="device"):
            ModelConfig(device=bad)
    with pytest.raises((ValidationError, ValueError), match="one GPU"):
        ModelConfig(device="cuda:1", tensor_parallel=2)
    assert ModelConfig(device="cuda", tensor_parallel=2).device == "cuda"


def test_cuda_device_checked_against_visible_gpus():
    assert check_cuda_device("cuda", 1) == "cuda"
    assert check_cuda_device("cuda:1", 2) == "cuda:1"
    with pytest.raises(ValidationError, match="cuda:2: torch sees 2 GPU"):
        check_cuda_device("cuda:2", 2)
    with pytest.raises(ValidationError, match="sees no GPU"):
        check_cuda_device("cuda", 0)


def test_cuda_graphs_off_and_why():
    def plan(**kw):
        return EnginePlan(device="cuda", dtype="bfloat16", num_threads=1, attention=kw.pop("attention", "kernel"))

    p = plan()
    plan_cuda_graphs(None, p, enabled=False)
    assert p.cuda_graphs == "off: cuda_graphs=False"
    p = plan()
    plan_cuda_graphs(None, p, enabled=True, tp_group=object())
    assert "tensor parallelism" in p.cuda_graphs
    p = plan(attention="torch")
    plan_cuda_graphs(None, p, enabled=True)
    assert "Triton" in p.cuda_graphs
    assert "cuda graphs" in p.describe()


def test_the_plan_names_the_gpu_kernels():
    """On a GPU the kernel row names the Triton kernels (attention and the fused norm, rotary and SiLU·mul), not
    the CPU's decoder stack; the torch row stays as it is."""
    gpu = EnginePlan(device="cuda:0", dtype="bfloat16", num_threads=1, attention="kernel").describe()
    assert "fused rms_norm+residual, rotary, silu*mul (Triton" in gpu and "decoder_stack" not in gpu
    assert "decoder_stack" in EnginePlan(device="cpu", dtype="bfloat16", num_threads=1, attention="kernel").describe()
    torch_gpu = EnginePlan(device="cuda", dtype="bfloat16", num_threads=1, attention="torch").describe()
    assert "torch SDPA over gathered KV blocks" in torch_gpu
