"""Our Triton kernels of mii::rms_norm, mii::rotary_ and mii::silu_and_mul (the GPU's fused element-wise ops)
against the eager torch code they replace (mii/layers), in fp32, fp16 and bf16.

Without a GPU they run in Triton's CPU interpreter (`TRITON_INTERPRET=1`, set by tests/conftest.py), with one compiled
on it. They round to the dtype where the eager code does: fp16 (rounded to nearest by the interpreter as by a GPU)
checks those points, a value differing by at most one step and rarely. The interpreter truncates fp32 to bf16
instead of rounding it, so there bf16 is checked to within three steps (RMSNorm rounds three times: the
residual sum, the normalized value, its product with the weight)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the `gpu` extra)")

from mii.kernels import fused_cuda, paged_attention_cuda  # noqa: E402
from mii.layers.norm import RMSNorm  # noqa: E402
from mii.layers.rotary import RotaryEmbedding, _rotate  # noqa: E402
from tests.kernels.rounding import assert_rounded_close, values  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    truncated = ref.dtype == torch.bfloat16 and paged_attention_cuda.interpreted()
    assert_rounded_close(ours, ref, steps=3 if truncated else 1)


def _values(*shape, dtype, seed):
    return values(*shape, dtype=dtype, seed=seed, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 100])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_eager(dtype, n, offset):
    norm = RMSNorm(n, 1e-5, offset).to(DEVICE)
    norm.weight.data = _values(n, dtype=dtype, seed=1)
    x, res = _values(7, n, dtype=dtype, seed=2), _values(7, n, dtype=dtype, seed=3)
    y, empty = fused_cuda.rms_norm(x, None, norm.weight, 1e-5, offset)
    y2, res2 = fused_cuda.rms_norm(x, res, norm.weight, 1e-5, offset)
    y2_ref, res_ref = norm(x, res)
    _close(y, norm(x))
    _close(y2, y2_ref)
    assert empty.numel() == 0
    _close(res2, res_ref)  # x + residual, rounded once either way


def test_rms_norm_reads_rows_apart_and_keeps_nan_to_its_row():
    """x and the residual as rows of wider tensors (views, not copies); a NaN makes its row NaN, the others stay."""
    norm = RMSNorm(64, 1e-5, 0.0).to(DEVICE)
    norm.weight.data = _values(64, dtype=torch.float32, seed=5)
    wide, res = _values(3, 96, dtype=torch.float32, seed=6), _values(3, 80, dtype=torch.float32, seed=7)
    x, r = wide[:, 16:80], res[:, :64]
    x[1, 5] = float("nan")
    y, res2 = fused_cuda.rms_norm(x, r, norm.weight, 1e-5, 0.0)
    y_ref, res_ref = norm(x, r)
    assert torch.equal(y.isnan(), y_ref.isnan()) and y[1].isnan().all()
    _close(y[[0, 2]], y_ref[[0, 2]])
    _close(res2[[0, 2]], res_ref[[0, 2]])
    for op in (fused_cuda.rms_norm(x[:0], None, norm.weight, 1e-5, 0.0)[0], fused_cuda.silu_and_mul(wide[:0])):
        assert op.shape[0] == 0  # an empty step launches nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rot_dim", [(64, 64), (128, 64), (64, 40)])
def test_rotary_in_place_on_the_qkv_projection_as_eager(dtype, d, rot_dim):
    """q and k as the attention layer has them: views of one qkv row per token (GQA: 9 query heads, 3 key
    heads); partial rotary leaves the features past rot_dim alone; v is not touched."""
    T, h, kvh = 6, 9, 3
    rotary = RotaryEmbedding(d, rot_dim, 1024, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 1, 5, 17, 300, 1023], device=DEVICE)
    qkv = _values(T, (h + 2 * kvh) * d, dtype=dtype, seed=8)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = q.view(T, h, d), k.view(T, kvh, d)
    c, s = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    q_ref, k_ref, v_before = _rotate(q, c, s, rot_dim), _rotate(k, c, s, rot_dim), v.clone()
    fused_cuda.rotary_(q, k, positions, rotary.cos, rotary.sin)
    _close(q, q_ref)
    _close(k, k_ref)
    assert torch.equal(v, v_before)
    assert torch.equal(q[..., rot_dim:], q_ref[..., rot_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1536, 40, 2500])
def test_silu_and_mul_matches_eager(dtype, n):
    x = _values(5, 2 * n, dtype=dtype, seed=4)
    gate, up = x.chunk(2, dim=-1)
    _close(fused_cuda.silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy, under the interpreter: exp overflows, inf / inf)
def test_silu_and_mul_non_finite_and_extreme_values_as_eager():
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 100.0, -100.0, 88.0, -88.0, -104.5,
                            1e-30, -1e-30, 3e38, -3e38, 20.0, -20.0])
    gate = torch.cat([special, special.flip(0)])
    up = torch.cat([torch.ones(16), special])
    ours = fused_cuda.silu_and_mul(torch.cat([gate, up]).view(1, -1).to(DEVICE)).cpu()
    ref = (F.silu(gate) * up).view(1, -1)
    assert torch.equal(ours.isnan(), ref.isnan()), (ours, ref)
    torch.testing.assert_close(ours[~ref.isnan()], ref[~ref.isnan()], rtol=1e-5, atol=1e-30)


def test_registered_as_the_ops_cuda_kernels():
    """`load_cuda_kernels` (the plan's, when Triton imports) gives each op its CUDA kernel: these functions."""
    assert paged_attention_cuda.load_cuda_kernels() is None
    for name in ("rms_norm", "rotary_", "silu_and_mul", "paged_attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mii::{name}", "CUDA"), name
