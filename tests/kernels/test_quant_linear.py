"""Weight-only int8/int4 linears (`mii.layers.quant.quant_linear`: mii::linear_quant on CPU) against dequantize
then matmul in float64, on random shapes: 1-70 rows, several groups per row, with and without bias, int8 per
output channel and grouped, int4 in groups of 32, 64 and 128, fp32 and bf16 activations."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mii import kernels
from mii.envs import cpu_flags
from mii.layers.quant import (dequantize, dequantize_rows, dequantize_rows_reference, pack_int4, quant_linear,
                              quant_linear_reference, quantize_int4, quantize_int8, round_activations_int8)

# (rows N, inputs K, scheme, group): several groups per row; N not a multiple of 4 or 8 for the kernels' tails
CASES = [(96, 64, "int8", None), (130, 256, "int8", 32), (66, 576, "int8", None), (64, 96, "int4", 32),
         (98, 384, "int4", 64), (34, 1024, "int4", 128), (576, 1536, "int4", 32)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 33, 70]  # 1-8: the decode kernels, one instantiation each


def _weight(n, k, scheme, group, g):
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : k // 3] *= 4  # groups of different ranges
    return quantize_int8(w, group) if scheme == "int8" else quantize_int4(w, group)


def _check(out, x, w, bias, tol):
    """|out - x @ W.T - b| within `tol` of what the products' magnitudes allow (bf16-level rounding of them)."""
    wd = dequantize(w).double()
    ref = x.double() @ wd.T + (0 if bias is None else bias.double())
    bound = tol * (x.double().abs() @ wd.abs().T) + 1e-5
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g} where the bound is {bound[err > bound].min():.3g}"


def test_the_kernel_is_what_runs():
    assert kernels.load_cpu_kernels() is None, kernels.load_cpu_kernels()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mii::linear_quant", "CPU")


@pytest.mark.parametrize("n,k,scheme,group", CASES)
def test_matches_dequantized_matmul(n, k, scheme, group):
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(n * 7 + k)
    w = _weight(n, k, scheme, group, g)
    b = torch.randn(n, generator=g)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            out = quant_linear(x, w, bias)
            assert out.shape == (m, n) and out.dtype == torch.float32
            _check(out, x, w, bias, 2 ** -12)
            _check(quant_linear_reference(x, w, bias), x, w, bias, 2 ** -12)


@pytest.mark.parametrize("m", [1, 5, 40])
def test_bf16_activations(m):
    """Where the plan computes in bf16 the linear takes and returns bf16 (fp32 math inside)."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(m)
    for n, k, scheme, group in CASES[:5]:
        w = _weight(n, k, scheme, group, g)
        x = torch.randn(m, k, generator=g).bfloat16()
        out = quant_linear(x, w, None)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        _check(out, x, w, None, 2 ** -7)


def test_full_int4_range_and_extreme_scales():
    """Every 4-bit value, negative scales and offsets, a zero group: what GGUF files hold, not only what
    quantize_int4 makes."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    n, k = 32, 256
    q = torch.randint(0, 16, (n, k), generator=g)
    q[0, :32] = torch.arange(32) % 16
    scale = torch.randn(n, k // 32, generator=g) * 0.01
    offset = torch.randn(n, k // 32, generator=g) * 0.1
    scale[1, 2] = offset[1, 2] = 0
    w = pack_int4(q, scale, offset)
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=g)
        _check(quant_linear(x, w, None), x, w, None, 2 ** -12)


@pytest.mark.parametrize("n,k,scheme,group", CASES)
def test_int8_activations(n, k, scheme, group):
    """`act8` (quantize_activations): an int4 weight multiplies x rounded to int8 per 32 columns, exactly as
    round_activations_int8 rounds it (then only fp32 summation differs), in the streaming kernel (up to 32 rows)
    and the blocked GEMM (more); an int8 weight ignores it."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(n * 5 + k)
    w = _weight(n, k, scheme, group, g)
    b = torch.randn(n, generator=g)
    for m in (1, 3, 4, 17, 33, 70):
        x = torch.randn(m, k, generator=g)
        x[:, :32] *= 30  # a chunk of a much larger range
        out = quant_linear(x, w, b, act8=True)
        rounded = round_activations_int8(x) if scheme == "int4" else x
        _check(out, rounded, w, b, 2 ** -12)
        _check(quant_linear_reference(x, w, b, act8=True), rounded, w, b, 2 ** -12)
        if scheme == "int4":
            assert not torch.equal(rounded, x) and not torch.allclose(out, quant_linear(x, w, b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("m", [1, 5, 12, 40, 70])
def test_bf16_rows_multiply_the_exact_weights(m):
    """bf16 x against int4 weights (the plan's case on native-bf16 CPUs): the weights the file holds, never rounded
    to bf16. Rows whose products cancel out make the check sharp: rounding the weights to bf16 would leave an error
    near 2^-9 / sqrt(K) of sum |x * w| (~2^-14 here), where exact products leave fp32 summation (and, for decode
    rows, x's int16 rounding: ~2^-18) under the output's own bf16 rounding."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(11 + m)
    n, k = 80, 576
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    offset = -7.5 * scale  # weights centred on 0: the sums cancel
    w = pack_int4(q, scale, offset)
    x = torch.randn(m, k, generator=g).abs().bfloat16()
    out = quant_linear(x, w, None).double()
    wd = dequantize(w).double()
    ref = x.double() @ wd.T
    bound = 2 ** -8 * ref.abs() + 2 ** -16 * (x.double().abs() @ wd.abs().T)
    err = (out - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g} where the bound is {bound[err > bound].min():.3g}"
    rounded = x.double() @ wd.bfloat16().double().T  # what bf16-rounded weights would give
    assert ((rounded - ref).abs() > 2 ** -16 * (x.double().abs() @ wd.abs().T)).any()


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int8", 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_does_not_depend_on_its_block(scheme, group, dtype):
    """From 9 rows on, x's rows go through register blocks of 4 and 3 (2 and 1 only below 6 rows): whichever block
    a row lands in, its sums are the same, in the same order. On CPUs with the tile path (AVX-512 VNNI and VBMI)
    the same bits; elsewhere ATen's fp32 GEMM is only as close as its summation order."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    w = _weight(100, 576, scheme, group, g)
    x = torch.randn(40, 576, generator=g).to(dtype)
    full = quant_linear(x, w, None)
    exact = {"avx512_vnni", "avx512vbmi"} <= cpu_flags()  # (cpuinfo spells VBMI without "_")
    for m in (9, 10, 11, 13, 17, 33):
        part = quant_linear(x[:m], w, None)
        if exact:
            assert torch.equal(part, full[:m]), m
        else:  # (bf16 y: fp32 sums that differ in their last bits can round one bf16 step apart)
            torch.testing.assert_close(part, full[:m], rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", None)])
def test_blocks_of_six_rows_are_the_blocks_of_four(scheme, group, monkeypatch):
    """bf16 x from 17 rows goes through blocks of 6 rows (12 chains of vdpbf16ps, their running sums in L1) where
    this CPU runs 12 chains faster than 8 (Zen 5), else of 4 (mii::tile_block_rows, measured once per process;
    MII_TILE_ROWS overrides): the same arithmetic a row, so the same bits either way, at every row count's mix of
    blocks (6 and 5, then 4 and 3 below 20 rows; 5-16 rows take rows_tile either way)."""
    kernels.load_cpu_kernels()
    assert torch.ops.mii.tile_block_rows() in (4, 6)
    monkeypatch.setenv("MII_AMX", "0")
    if not _few_row_tiles():
        pytest.skip("the tiles' bf16 path needs AVX512-BF16, VNNI and VBMI")
    g = torch.Generator().manual_seed(11)
    w = _weight(100, 576, scheme, group, g)
    x = torch.randn(70, 576, generator=g).bfloat16()
    out = {}
    for rows in ("4", "6"):
        monkeypatch.setenv("MII_TILE_ROWS", rows)
        assert torch.ops.mii.tile_block_rows() == int(rows)
        out[rows] = {m: quant_linear(x[:m], w, None) for m in (5, 8, 11, 12, 16, 17, 19, 20, 23, 25, 30, 37, 70)}
    for m, y in out["4"].items():
        assert torch.equal(out["6"][m], y), m
        _check(y, x[:m], w, None, 2 ** -7)
        assert torch.equal(y[:5], out["4"][5]), m  # a row is the same in any mix of blocks


@pytest.mark.parametrize("n,k,scheme,group", [(100, 576, "int4", 32), (48, 1536, "int8", 32), (98, 384, "int4", 64)])
def test_amx_and_vdpbf16ps_tiles_agree(n, k, scheme, group, monkeypatch):
    """Where the CPU has AMX, bf16 rows from 9 on multiply the unpacked tiles with AMX (MII_AMX=0: `vdpbf16ps`): the
    same exact products and per-group scaling, other fp32 sums; both within bf16-level rounding of the exact
    product, and of each other. A row's result does not depend on the rows beside it within the path."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(n + k)
    w = _weight(n, k, scheme, group, g)
    x = torch.randn(70, k, generator=g).bfloat16()
    out = {}
    for amx in ("1", "0"):
        monkeypatch.setenv("MII_AMX", amx)
        out[amx] = quant_linear(x, w, None)
        _check(out[amx], x, w, None, 2 ** -7)
        assert torch.equal(quant_linear(x[:33], w, None), out[amx][:33]), amx
    torch.testing.assert_close(out["1"], out["0"], rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int8", 32)])
def test_tile_rows_written_in_bf16_round_as_torch(scheme, group):
    """bf16 x from 9 rows on, without a bias: on CPUs with AMX the kernel rounds its sums to bf16 as it stores them
    (no fp32 copy); with a zero bias the fp32 sums go through linear_output's rounding. The same bits, whatever the
    rows (partial tiles of 32) and columns (a partial tile of 16) at the edges. Elsewhere both take linear_output."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(21)
    w = _weight(200, 576, scheme, group, g)
    zero = torch.zeros(200).bfloat16()
    for m in (9, 32, 37, 70):
        x = torch.randn(m, 576, generator=g).bfloat16()
        out = quant_linear(x, w, None)
        assert out.dtype == torch.bfloat16 and out.shape == (m, 200)
        assert torch.equal(out, quant_linear(x, w, zero)), m
    x = torch.randn(2, 20, 576, generator=g).bfloat16()  # leading dims kept
    assert torch.equal(quant_linear(x, w, None), quant_linear(x.view(40, 576), w, None).view(2, 20, 200))


def _few_row_tiles() -> bool:
    """Whether 5-16 bf16 rows of x take the tiles' arithmetic (rows_tile): CPUs with AVX512-BF16, VNNI and VBMI,
    where AMX does not run (no AMX, or MII_AMX=0)."""
    flags = cpu_flags()
    amx = "amx_bf16" in flags and os.environ.get("MII_AMX") != "0"
    return {"avx512_bf16", "avx512_vnni", "avx512vbmi"} <= flags and not amx


def test_bf16_rows_in_and_out_round_as_torch():
    """Decode rows of bf16 x (up to 8: the streaming kernels, but for 5-8 rows where the few-row tiles run):
    widened and rounded (bias added first) by the kernel itself, not by Tensor.to: the same bits as the fp32 call's
    result rounded by torch. A single row without a bias is written in bf16 by the kernel directly (any
    leading shape, int8 activations too)."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(9)
    for n, k, scheme, group in CASES[:5]:
        w = _weight(n, k, scheme, group, g)
        b = torch.randn(n, generator=g)
        for m in (1, 4, 5, 8):
            if m >= 5 and _few_row_tiles():
                continue  # (test_few_bf16_rows_take_the_tiles_arithmetic)
            x = torch.randn(m, k, generator=g).bfloat16()
            for bias in (None, b):
                out = quant_linear(x, w, bias)
                assert out.dtype == torch.bfloat16
                assert torch.equal(out, quant_linear(x.float(), w, bias).bfloat16())
        x = torch.randn(1, 1, k, generator=g).bfloat16()
        for act8 in (False, True) if scheme == "int4" else (False,):
            out = quant_linear(x, w, None, act8)
            assert out.shape == (1, 1, n) and out.dtype == torch.bfloat16
            assert torch.equal(out, quant_linear(x.float(), w, None, act8).bfloat16())


@pytest.mark.parametrize("n,k,scheme,group", [(64, 96, "int4", 32), (98, 384, "int4", 64), (34, 1024, "int4", 128),
                                              (576, 1536, "int4", 32), (130, 256, "int8", 32), (66, 576, "int8", None)])
def test_few_bf16_rows_take_the_tiles_arithmetic(n, k, scheme, group, monkeypatch):
    """5-16 bf16 rows of x (decode steps of 5-16 streams, short prompts): each 16-row tile's chunks unpacked once and
    taken by every row (rows_tile), where the decode kernels multiplied a row at a time. The tiles' arithmetic in
    their order (bf16 x exact, a group's sums scaled once): bit for bit the rows of a 40-row call through the tiles
    (MII_AMX=0 where the CPU has AMX), whatever the rows, partial tiles of 16 columns, groups of several chunks (int8
    per output channel: one group of K) and a bias; written in bf16 as linear_output rounds; within bf16-level
    rounding of the exact product. 1-4 rows keep the decode kernels."""
    kernels.load_cpu_kernels()
    monkeypatch.setenv("MII_AMX", "0")
    if not _few_row_tiles():
        pytest.skip("the few-row tiles need AVX512-BF16, VNNI and VBMI")
    g = torch.Generator().manual_seed(n + k)
    w = _weight(n, k, scheme, group, g)
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(40, k, generator=g).bfloat16()
    full, full_b = quant_linear(x, w, None), quant_linear(x, w, b)
    _check(full, x, w, None, 2 ** -7)
    for m in range(1, 17):
        part = quant_linear(x[:m], w, None)
        if m >= 5:
            assert torch.equal(part, full[:m]), m
            assert torch.equal(quant_linear(x[:m], w, b), full_b[:m]), m
            assert torch.equal(part, quant_linear(x[:m], w, torch.zeros_like(b))), m
            assert torch.equal(quant_linear(x[m - 5:m], w, None), full[m - 5:m]), m  # rows are rows, wherever
        _check(part, x[:m], w, None, 2 ** -7)


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", None)])
def test_bf16_tiles_multiply_the_weights_rounded_to_bf16(scheme, group, monkeypatch):
    """MII_QUANT_TILES=bf16 (opt-in): where bf16 rows from 9 on take AMX tiles, the tiles hold the weights rounded
    to bf16 (as a bf16 model's are), so each output is x @ bf16(W).T to fp32 summation and the output's rounding, and
    measurably not the exact weights' product (rows whose products cancel, as in the exact test above). A row's
    result does not depend on the rows beside it; decode rows (1-8), MII_AMX=0 and CPUs without AMX ignore it."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(31)
    n, k = 80, 576
    if scheme == "int4":  # weights centred on 0 and x >= 0: the sums cancel
        q = torch.randint(0, 16, (n, k), generator=g)
        scale = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).half().float()
        w = pack_int4(q, scale, -7.5 * scale)
    else:
        w = _weight(n, k, scheme, group, g)
    x = torch.randn(70, k, generator=g).abs().bfloat16()
    wd = dequantize(w).double()
    exact = quant_linear(x, w, None)
    decode = {m: quant_linear(x[:m], w, None) for m in (1, 5, 8)}
    monkeypatch.setenv("MII_QUANT_TILES", "bf16")
    out = quant_linear(x, w, None)
    for m, rows in decode.items():  # the decode kernels: exact weights either way
        assert torch.equal(quant_linear(x[:m], w, None), rows), m
    if "amx_bf16" not in cpu_flags():
        assert torch.equal(out, exact)
        return
    magnitude = x.double().abs() @ wd.abs().T
    rounded = x.double() @ wd.bfloat16().double().T
    err = (out.double() - rounded).abs()
    bound = 2 ** -8 * rounded.abs() + 2 ** -16 * magnitude
    assert (err <= bound).all(), f"max error {err.max():.3g} where the bound is {bound[err > bound].min():.3g}"
    assert ((out.double() - x.double() @ wd.T).abs() > 2 ** -16 * magnitude).any()  # not the exact weights
    assert not torch.equal(out, exact)
    for m in (9, 15, 16, 17, 33):  # blocks of 16 and 32 rows
        assert torch.equal(quant_linear(x[:m], w, None), out[:m]), m
    monkeypatch.setenv("MII_AMX", "0")
    monkeypatch.delenv("MII_QUANT_TILES")
    off = quant_linear(x, w, None)
    monkeypatch.setenv("MII_QUANT_TILES", "bf16")
    assert torch.equal(quant_linear(x, w, None), off)


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 32), ("int8", None)])
def test_rows_are_the_dequantized_rows(scheme, group):
    """mii::quant_rows (the embedding lookup of a tied, quantized LM head): bit for bit the rows of the Python
    dequantization, for ids of any shape (both rows of a pair, repeats, none), and a typed error for a bad id."""
    kernels.load_cpu_kernels()
    g = torch.Generator().manual_seed(11)
    n, k = 50, 256
    w = _weight(n, k, scheme, group, g)
    for ids in (torch.tensor([0, 1, 49, 48, 7, 7]), torch.randint(0, n, (3, 4), generator=g)):
        out = dequantize_rows(w, ids)
        assert out.shape == (*ids.shape, k) and out.dtype == torch.float32
        assert torch.equal(out, dequantize_rows_reference(w, ids))
        assert torch.equal(out.reshape(-1, k), dequantize(w)[ids.reshape(-1)])
        # written in the model's dtype by the lookup itself: the fp32 rows rounded as .to rounds them
        for dtype in (torch.bfloat16, torch.float16):
            cast = dequantize_rows(w, ids, dtype)
            assert cast.dtype == dtype and torch.equal(cast, out.to(dtype))
    assert dequantize_rows(w, torch.zeros(0, dtype=torch.long)).shape == (0, k)
    with pytest.raises(IndexError, match="out of range"):
        dequantize_rows(w, torch.tensor([3, n]))
    with pytest.raises(IndexError, match="out of range"):
        dequantize_rows(w, torch.tensor([-1]), torch.bfloat16)


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="needs a CPU above the one it stands in for")
def test_kernels_for_an_avx512_cpu_without_bf16():
    """MII_CPU_ISA=avx512 builds the kernels and makes the plan as for an AVX-512 CPU without AVX512-BF16 or AMX
    (an Ice Lake), in a process of its own: this file's references hold there too. (bf16 x at 9+ rows of an
    int4/int8 linear once took the bf16 tiles into the int16 kernel on such CPUs and crashed.)"""
    env = dict(os.environ, MII_CPU_ISA="avx512")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not for_an_avx512_cpu"], env=env, capture_output=True, text=True, timeout=900,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def test_an_unknown_cpu_isa_is_refused(monkeypatch):
    monkeypatch.setenv("MII_CPU_ISA", "sse4")
    with pytest.raises(ValueError, match=r"MII_CPU_ISA='sse4': expected native, avx512 .* or avx2"):
        cpu_flags()
    monkeypatch.setenv("MII_CPU_ISA", "avx2")
    assert not any(f.startswith(("avx512", "amx")) for f in cpu_flags())
