"""Closeness for ops that round to the model's dtype where the eager code they replace does (the fused element-wise
kernels, CPU and GPU), and the values they are tried on."""
import torch


def assert_rounded_close(ours: torch.Tensor, ref: torch.Tensor, steps: int = 1) -> None:
    """Equal in fp32 up to fp32 rounding; in bf16 or fp16 within `steps` steps of the value (one step: where an fp32
    intermediate lands next to a rounding boundary, so all but a few exactly)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        return
    a, b = ours.float(), ref.float()
    step = 2.0 ** -(7 if ref.dtype == torch.bfloat16 else 10)
    torch.testing.assert_close(a, b, rtol=steps * step, atol=1e-30)
    if steps == 1:
        assert (a != b).float().mean() < 0.01


def values(*shape, dtype, seed, device="cpu"):
    """Random values of a wide range of magnitudes."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g) * 4).to(dtype).to(device)
