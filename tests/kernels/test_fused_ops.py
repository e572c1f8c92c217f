"""mii's fused element-wise CPU ops (rms_norm with the residual add, rotary_, silu_and_mul) against the eager
torch code they replace (mii/layers), in fp32 and bf16, on widths the vectorized bf16 loops take (multiples of 16)
and widths they leave to the scalar loops. They round to the dtype at the same points as the eager code, so a
bf16 value may differ only where an fp32 intermediate lands next to a rounding boundary (another summation order
of the sum of squares, another exp): by at most one bf16 step, and rarely."""
import pytest
import torch
import torch.nn.functional as F

from mii import kernels
from mii.layers.norm import RMSNorm
from mii.layers.rotary import _rotate
from tests.kernels.rounding import assert_rounded_close as _close
from tests.kernels.rounding import values as _values


@pytest.fixture(autouse=True)
def _built():
    if kernels.load_cpu_kernels() is not None:
        pytest.skip(f"CPU kernels not built: {kernels.load_cpu_kernels()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [576, 100])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_eager(dtype, n, offset):
    norm = RMSNorm(n, 1e-5, offset)
    norm.weight.data = _values(n, dtype=dtype, seed=1)
    x, res = _values(7, n, dtype=dtype, seed=2), _values(7, n, dtype=dtype, seed=3)
    y_ref = norm(x)
    y2_ref, res_ref = norm(x, res)
    y, _ = torch.ops.mii.rms_norm(x, None, norm.weight, 1e-5, offset)
    y2, res2 = torch.ops.mii.rms_norm(x, res, norm.weight, 1e-5, offset)
    _close(y, y_ref)
    _close(y2, y2_ref)
    assert torch.equal(res2, res_ref)  # x + residual, rounded once either way


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rotary_keep_nan_as_eager(dtype):
    """A NaN in a row makes that row NaN, as eager (the bf16 loops round without a NaN check: every NaN they see
    comes from bf16 inputs); the other rows as eager; rotary carries a NaN to its pair."""
    norm = RMSNorm(64, 1e-5, 0.0)
    norm.weight.data = _values(64, dtype=dtype, seed=5)
    x, res = _values(3, 64, dtype=dtype, seed=6), _values(3, 64, dtype=dtype, seed=7)
    x[1, 5] = float("nan")
    y, res2 = torch.ops.mii.rms_norm(x, res, norm.weight, 1e-5, 0.0)
    y_ref, res_ref = norm(x, res)
    assert torch.equal(y.isnan(), y_ref.isnan()) and y[1].isnan().all()
    assert torch.equal(res2.isnan(), res_ref.isnan())
    _close(y[[0, 2]], y_ref[[0, 2]])
    q, k = _values(2, 2, 64, dtype=dtype, seed=8), _values(2, 1, 64, dtype=dtype, seed=9)
    q[0, 1, 3] = float("nan")
    cos, sin = torch.rand(4, 32), torch.rand(4, 32)
    positions = torch.tensor([1, 3])
    q_ref = _rotate(q, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), 64)
    torch.ops.mii.rotary_(q, k, positions, cos, sin)
    assert torch.equal(q.isnan(), q_ref.isnan()) and q[0, 1, [3, 35]].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1536, 40])
def test_silu_and_mul_matches_eager(dtype, n):
    x = _values(5, 2 * n, dtype=dtype, seed=4)
    gate, up = x.chunk(2, dim=-1)
    _close(torch.ops.mii.silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_non_finite_and_extreme_values_as_eager(dtype):
    """NaN, infinities, zeros and values whose exp over- or underflows in fp32: NaN where eager gives NaN, the same
    infinities, and the finite values close."""
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 100.0, -100.0, 88.0, -88.0, -104.5,
                            1e-30, -1e-30, 3e38, -3e38, 20.0, -20.0])
    gate = torch.cat([special, special.flip(0)]).to(dtype)
    up = torch.cat([torch.ones(16), special]).to(dtype)
    ours = torch.ops.mii.silu_and_mul(torch.cat([gate, up]).view(1, -1)).float()
    ref = (F.silu(gate) * up).float()
    assert torch.equal(ours.isnan(), ref.view(1, -1).isnan()), (ours, ref)
    finite = ~ref.isnan().view(1, -1)
    torch.testing.assert_close(ours[finite], ref.view(1, -1)[finite], rtol=2 ** -7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,rot_dim", [(64, 64), (128, 64), (64, 40)])
def test_rotary_matches_eager(dtype, d, rot_dim):
    T, h, kvh = 6, 9, 3
    positions = torch.tensor([0, 1, 5, 17, 300, 1023])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    angles = torch.arange(1024).float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    q, k = _values(T, h, d, dtype=dtype, seed=5), _values(T, kvh, d, dtype=dtype, seed=6)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_ref, k_ref = _rotate(q, c, s, rot_dim), _rotate(k, c, s, rot_dim)
    torch.ops.mii.rotary_(q, k, positions, cos, sin)
    _close(q, q_ref)
    _close(k, k_ref)
