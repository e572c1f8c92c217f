"""mii::linear_bf16w (bf16 weights, fp32 math) against a float64 reference, and the engine that keeps its weights in
bf16 on CPUs without native bf16 matmul against transformers on the same (bf16-valued) weights."""
import pytest
import torch
from transformers import LlamaConfig, PhiConfig

import mii
from mii import kernels
from mii.errors import ValidationError
from mii.engine import plan as plan_module
from mii.layers.linear import tile_bf16_kpairs, tile_bf16w, tiled_rows, tiled_rows_reference
from tests.reference import TINY, compare_greedy, hf_greedy, prompts_for, tiny_checkpoint

pytestmark = pytest.mark.skipif(kernels.load_cpu_kernels() is not None,
                                reason=f"CPU kernels not built: {kernels.load_cpu_kernels()}")


def _reference(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


# rows 1-16 take the streaming kernel (in groups of 4 rows against 4 or 2 weight rows, or a tile group of 8
# rows), more the blocked GEMM; K not a multiple of 8 and N not a multiple of the row group exercise the tails of
# the row-major layout; sides that are multiples of 8 also run tiled
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 17, 70])
@pytest.mark.parametrize("n,k", [(96, 64), (131, 100), (3, 7), (300, 576), (8, 8), (392, 1536)])
def test_matches_float64(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    layouts = [w] + ([tile_bf16w(w)] if n % 8 == 0 and k % 8 == 0 else [])
    for weight in layouts:
        for bias in (None, b):
            out = torch.ops.mii.linear_bf16w(x, weight, bias)
            assert out.dtype == torch.float32 and out.shape == (m, n)
            torch.testing.assert_close(out.double(), _reference(x, w, bias), rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_tiled_layout_and_its_rows():
    """The tiled layout holds every element once, where the kernel reads it, and an embedding tied to a tiled
    LM head reads its rows back exactly (any leading dims of the ids)."""
    w = torch.arange(24 * 16, dtype=torch.float32).view(24, 16).bfloat16()
    t = tile_bf16w(w)
    assert t.shape == (3, 2, 64)
    # tile (group 1, columns 8-15): element p*16 + j*2 + s is row 8 + 2p + s, column 8 + j
    assert t[1, 1, 2 * 16 + 5 * 2 + 1] == w[8 + 5, 8 + 5] and t[2, 0, 3 * 16 + 7 * 2] == w[16 + 6, 7]
    assert sorted(t.float().flatten().tolist()) == sorted(w.float().flatten().tolist())
    ids = torch.tensor([[0, 23, 7], [8, 9, 15]])
    assert torch.equal(tiled_rows(t, ids), w[ids])


def test_bf16_activations_and_leading_dims():
    """bf16 activations are widened too and the result rounded once; any leading dims are kept."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g).bfloat16()
    x = torch.randn(2, 3, 72, generator=g).bfloat16()
    out = torch.ops.mii.linear_bf16w(x, w, None)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 40)
    torch.testing.assert_close(out, _reference(x, w, None).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    assert torch.ops.mii.linear_bf16w(x[:0], w, None).shape == (0, 3, 40)


@pytest.mark.parametrize("m", [1, 5, 33, 70, 300])
def test_bf16_activations_every_row_count(m):
    """bf16 x, tiled and row-major weights, with a bias: decode rows (the streaming kernel) and prompt chunks
    (blocks of the weight widened to fp32 for ATen's GEMM), fp32 math both, each within one bf16 rounding of the
    exact product, and a row's result the same whatever rows share its call (up to fp32 summation order: a bf16
    ulp at most)."""
    g = torch.Generator().manual_seed(m)
    n, k = 392, 576
    w = torch.randn(n, k, generator=g).bfloat16()
    x, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    ref = _reference(x, w, b)
    for weight in (w, tile_bf16w(w)):
        out = torch.ops.mii.linear_bf16w(x, weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-3 * k ** 0.5)
        alone = torch.cat([torch.ops.mii.linear_bf16w(x[i:i + 1], weight, b) for i in range(0, m, max(1, m // 4))])
        torch.testing.assert_close(alone.double(), out[::max(1, m // 4)].double(), rtol=2 ** -7, atol=1e-3 * k ** 0.5)


@pytest.mark.parametrize("tiles", ["row-major", "tiled", "kpairs"])
def test_bf16_rows_in_and_out_round_as_torch(tiles):
    """bf16 x is widened and the result rounded (bias added first) by the kernel itself, not by Tensor.to: the
    same bits as the fp32 call's result rounded by torch, leading dimensions kept."""
    g = torch.Generator().manual_seed(5)
    n, k = 96, 64
    w = torch.randn(n, k, generator=g).bfloat16()
    wt = {"row-major": w, "tiled": tile_bf16w(w), "kpairs": tile_bf16_kpairs(w)}[tiles]
    b = torch.randn(n, generator=g)
    for m in (1, 5, 17, 40):
        x = torch.randn(2, m, k, generator=g).bfloat16()
        for bias in (None, b):
            out = torch.ops.mii.linear_bf16w(x, wt, bias)
            assert out.dtype == torch.bfloat16 and out.shape == (2, m, n)
            assert torch.equal(out, torch.ops.mii.linear_bf16w(x.float(), wt, bias).bfloat16())


def test_a_kpair_row_does_not_depend_on_its_block(monkeypatch):
    """k-pair tiles take x's rows in register blocks of 4 and 3 (2 and 1 only below 6 rows), streamed up to 64
    rows and from L2 beyond (there in slices of 64 or, where that evens out the threads' shares, 32 weight rows:
    [576, K] with 2 threads); on an AMX CPU, from 5 rows, in tiles of 32 rows. Each row's sums are the same, in the
    same order, whichever block it takes within a path: 1-4 rows against one 4-row call, 5-70 against a 70-row call
    (AMX), and with AMX off (MII_AMX=0) 5-64 against a 64-row call and 65-70 against the 70-row one."""
    g = torch.Generator().manual_seed(4)
    wb = torch.randn(576, 576, generator=g).bfloat16()
    w = tile_bf16_kpairs(wb)
    x = torch.randn(70, 576, generator=g).bfloat16()
    for amx in ("1", "0"):
        monkeypatch.setenv("MII_AMX", amx)
        full = torch.ops.mii.linear_bf16w(x, w, None)
        torch.testing.assert_close(full.double(), _reference(x, wb, None), rtol=2 ** -8, atol=1e-3 * 576 ** 0.5)
        four = torch.ops.mii.linear_bf16w(x[:4], w, None)
        assert all(torch.equal(torch.ops.mii.linear_bf16w(x[:m], w, None), four[:m]) for m in (1, 2, 3))
        sixty_four = torch.ops.mii.linear_bf16w(x[:64], w, None)
        for m in (5, 9, 10, 11, 13, 33, 64, 65):
            whole = sixty_four if amx == "0" and m <= 64 else full
            assert torch.equal(torch.ops.mii.linear_bf16w(x[:m], w, None), whole[:m]), (amx, m)


def test_amx_and_vdpbf16ps_agree(monkeypatch):
    """Where the CPU has AMX, rows of x from 5 on take AMX tiles (MII_AMX=0: the vdpbf16ps kernel): other fp32 sums,
    the same products; both within bf16's rounding of the float64 reference, and of each other."""
    g = torch.Generator().manual_seed(6)
    for n, k, m in ((96, 64, 7), (576, 1536, 37), (3072, 576, 130)):
        wb = torch.randn(n, k, generator=g).bfloat16()
        w, x = tile_bf16_kpairs(wb), torch.randn(m, k, generator=g).bfloat16().float()
        out = {}
        for amx in ("1", "0"):
            monkeypatch.setenv("MII_AMX", amx)
            out[amx] = torch.ops.mii.linear_bf16w(x, w, None)
            torch.testing.assert_close(out[amx].double(), _reference(x.bfloat16(), wb, None), rtol=1e-5,
                                       atol=1e-5 * k ** 0.5)
        torch.testing.assert_close(out["1"], out["0"], rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_amx_rows_written_in_bf16_round_as_torch():
    """bf16 x without a bias against k-pair tiles: on CPUs with AMX (5+ rows) the kernel rounds its sums to bf16 as
    it stores them; with a zero bias the fp32 sums go through linear_output's rounding. The same bits, partial
    blocks of 32 rows and an odd number of 16-row groups included. Elsewhere both take linear_output."""
    g = torch.Generator().manual_seed(8)
    for n, k, m in ((96, 64, 7), (208, 576, 37), (576, 1536, 64)):
        w = tile_bf16_kpairs(torch.randn(n, k, generator=g).bfloat16())
        x = torch.randn(m, k, generator=g).bfloat16()
        out = torch.ops.mii.linear_bf16w(x, w, None)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        assert torch.equal(out, torch.ops.mii.linear_bf16w(x, w, torch.zeros(n).bfloat16())), (n, k, m)
        assert torch.equal(torch.ops.mii.linear_bf16w(x.view(1, m, k), w, None), out.view(1, m, n))


@pytest.mark.parametrize("tile", [tile_bf16w, tile_bf16_kpairs])
def test_tiled_rows_kernel_reads_what_the_views_read(tile):
    """mii::tiled_rows against the torch indexing of the tiles on a real-sized tied LM head (any ids' shape, an
    empty one), and an id out of range is an IndexError that names it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(49152, 576, generator=g).bfloat16()
    t = tile(w)
    ids = torch.randint(0, 49152, (3, 5), generator=g)
    ids[0, 0], ids[0, 1] = 0, 49151
    assert torch.equal(torch.ops.mii.tiled_rows(t, ids), w[ids])
    assert torch.equal(torch.ops.mii.tiled_rows(t, ids), tiled_rows_reference(t, ids))
    assert torch.ops.mii.tiled_rows(t, ids[:0]).shape == (0, 5, 576)
    with pytest.raises(IndexError, match="49152 is out of range"):
        torch.ops.mii.tiled_rows(t, torch.tensor([3, 49152]))


def test_kpair_layout_and_its_rows():
    """k-pair tiles (CPUs with native bf16 dot products): tile j of a 16-row group holds columns 2j, 2j+1 of its
    rows, every element once; a tied embedding reads its rows back exactly."""
    w = torch.arange(32 * 6, dtype=torch.float32).view(32, 6).bfloat16()
    t = tile_bf16_kpairs(w)
    assert t.shape == (2, 3, 32)
    # group 1, tile 2: element r*2 + s is row 16 + r, column 4 + s
    assert t[1, 2, 5 * 2 + 1] == w[16 + 5, 5] and t[0, 0, 15 * 2] == w[15, 0]
    assert sorted(t.float().flatten().tolist()) == sorted(w.float().flatten().tolist())
    ids = torch.tensor([[0, 31, 17], [16, 9, 15]])
    assert torch.equal(tiled_rows(t, ids), w[ids])


@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 33, 130])
@pytest.mark.parametrize("n,k", [(64, 32), (80, 34), (48, 576), (320, 1536)])
def test_kpair_tiles_match_float64(m, n, k):
    """bf16 x against k-pair tiles (`vdpbf16ps` where the CPU has it, else the portable loop): within fp32
    summation error of the exact product for every row count (the rows of x four at a time, and the tails) and
    for widths of 1-5 groups of 16 rows (four a step, and the rest), with and without a bias; a row's result
    does not depend on the rows beside it within a path."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    t = tile_bf16_kpairs(w)
    for bias in (None, b):
        out = torch.ops.mii.linear_bf16w(x.float(), t, bias if bias is None else bias.float())  # fp32 out
        assert out.dtype == torch.float32 and out.shape == (m, n)
        torch.testing.assert_close(out.double(), _reference(x, w, bias), rtol=1e-5, atol=1e-4 * k ** 0.5)
        y = torch.ops.mii.linear_bf16w(x, t, bias)
        assert y.dtype == torch.bfloat16 and torch.equal(y, out.to(torch.bfloat16))
    # (1-4 rows and 5+ rows may take different paths: vdpbf16ps and AMX tiles)
    tail = torch.ops.mii.linear_bf16w(x[-(1 if m < 5 else 5):].float(), t, None)
    assert torch.equal(tail[-1:], torch.ops.mii.linear_bf16w(x.float(), t, None)[-1:])


def _bf16_values(model):
    for name, p in model.named_parameters():
        if name.endswith("bias"):  # (Phi-2's biases start at 0: make them matter)
            torch.nn.init.normal_(p, std=0.3)
        p.data = p.data.bfloat16().float()


FAMILIES = {"llama-tied": LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **TINY),
            "phi2-biases": PhiConfig(vocab_size=49152, partial_rotary_factor=0.5,
                                     **{k: v for k, v in TINY.items() if k != "num_key_value_heads"})}


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_keeps_bf16_weights_and_matches_transformers(tmp_path, tokenizer_dir, monkeypatch, family):
    """On a CPU without native bf16 matmul (forced here), the auto dtype keeps activations in fp32 and the weights
    in bf16. On a checkpoint whose weights are bf16 values, that is exactly the fp32 model: greedy tokens
    identical to transformers and logprobs within 2e-3, for decode rows (the streaming kernel) and prompt
    chunks (the blocked GEMM) alike; with biases (Phi-2: every linear and the LM head) and a tied LM head. (The
    KV cache kept in fp32 here: the auto bf16 cache is the next test's.)"""
    monkeypatch.setattr(plan_module, "cpu_has_fast_bf16", lambda: False)
    path = tiny_checkpoint(FAMILIES[family], tmp_path, tokenizer_dir, post_init=_bf16_values)
    prompts = prompts_for(49152, lengths=(5, 37, 90, 3, 12))
    ref = hf_greedy(path, prompts, 16)
    pipe = mii.pipeline(str(path), kv_cache_dtype="float32", inference_engine_config={
        "state_manager": {"max_ragged_batch_size": 48, "kv_block_size": 8}})
    try:
        plan = pipe.engine_plan
        assert (plan.dtype, plan.weight_dtype, plan.linear_backend) == ("float32", "bfloat16", "kernel")
        model = pipe.engine.loaded.model
        head, embed = model.lm_head, model.model.embed_tokens
        assert head.bf16_kernel and head.weight.dtype == embed.weight.dtype == torch.bfloat16
        assert (head.weight is embed.weight) == (family == "llama-tied")
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.bf16_kernel and qkv.weight.dtype == torch.bfloat16
        assert model.model.norm.weight.dtype == torch.float32  # norms (and everything else) stay fp32
        compare_greedy(pipe, prompts, ref, 16, atol=2e-3)
    finally:
        pipe.destroy()


@pytest.mark.parametrize("use_kernels", [True, False])
def test_bf16_kv_cache_matches_transformers_with_its_cache_rounded(tmp_path, tokenizer_dir, monkeypatch, use_kernels):
    """The auto plan's KV cache is bf16 under fp32 math: keys and values rounded to bf16 as they are written,
    attention in fp32 over them. That is transformers in fp32 with every key and value its cache returns rounded
    to bf16: greedy tokens identical and logprobs within 2e-3, on the kernels and on the torch reference
    backend, with a sliding window (Mistral) and chunked prompts."""
    from transformers import MistralConfig
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    monkeypatch.setattr(plan_module, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setenv("MII_KERNELS", "1" if use_kernels else "0")
    cfg = MistralConfig(vocab_size=49152, sliding_window=16, **TINY)
    path = tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=_bf16_values)
    prompts = prompts_for(49152, lengths=(5, 37, 90, 3, 12))
    for layer in (DynamicLayer, DynamicSlidingWindowLayer):
        update = layer.update
        monkeypatch.setattr(layer, "update", lambda self, k, v, *a, _update=update, **kw: _update(
            self, k.bfloat16().float(), v.bfloat16().float(), *a, **kw))
    ref = hf_greedy(path, prompts, 16)
    monkeypatch.undo()  # (the plan's CPU probe and MII_KERNELS again, transformers' cache as it was)
    monkeypatch.setattr(plan_module, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setenv("MII_KERNELS", "1" if use_kernels else "0")
    kw = {} if use_kernels else {"kv_cache_dtype": "bfloat16", "dtype": "float32"}  # torch: fp32 weights
    pipe = mii.pipeline(str(path), inference_engine_config={"state_manager": {"max_ragged_batch_size": 48,
                                                                              "kv_block_size": 8}}, **kw)
    try:
        plan = pipe.engine_plan
        assert (plan.dtype, plan.kv_dtype) == ("float32", "bfloat16")
        assert pipe.engine.runner.kv_cache.dtype == torch.bfloat16
        assert plan.attention == ("kernel" if use_kernels else "torch")
        compare_greedy(pipe, prompts, ref, 16, atol=2e-3)
    finally:
        pipe.destroy()


def test_kv_cache_dtype_choices(tmp_path, tokenizer_dir, monkeypatch, capsys):
    """auto: bf16 under bf16 weights with fp32 math, the compute dtype otherwise; an explicit one is taken on CPU
    under fp32 math and refused where no attention reads it (a fp32 cache under bf16 math); the same through
    `mii explain --kv-cache-dtype`."""
    from mii.cli import main

    monkeypatch.setattr(plan_module, "cpu_has_fast_bf16", lambda: False)
    path = tiny_checkpoint(LlamaConfig(vocab_size=49152, **TINY), tmp_path, tokenizer_dir)
    for kw, want in (({}, "bfloat16"), ({"dtype": "float32"}, "float32"), ({"dtype": "bfloat16"}, "bfloat16"),
                     ({"dtype": "float32", "kv_cache_dtype": "float16"}, "float16"),
                     ({"kv_cache_dtype": "float32"}, "float32")):
        pipe = mii.pipeline(str(path), **kw)
        try:
            assert pipe.engine_plan.kv_dtype == want, kw
            assert pipe.engine.runner.kv_cache.dtype == getattr(torch, want)
            assert f"kv dtype             {want}" in pipe.engine_plan.describe()
            assert len(pipe(prompts_for(49152, lengths=(40,)), max_new_tokens=4)[0].token_ids) == 4
        finally:
            pipe.destroy()
    with pytest.raises(ValidationError, match="kv_cache_dtype: float32 under bfloat16 math"):
        mii.pipeline(str(path), dtype="bfloat16", kv_cache_dtype="float32")
    capsys.readouterr()
    assert main(["explain", str(path), "--dtype", "float32", "--kv-cache-dtype", "float16"]) == 0
    assert "kv dtype             float16  (kv_cache_dtype=float16)" in capsys.readouterr().out
    assert main(["explain", str(path), "--dtype", "bfloat16", "--kv-cache-dtype", "float32"]) == 2
    assert "kv_cache_dtype: float32 under bfloat16 math" in capsys.readouterr().err


def test_explicit_float32_keeps_float32_weights(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(plan_module, "cpu_has_fast_bf16", lambda: False)
    path = tiny_checkpoint(LlamaConfig(vocab_size=49152, **TINY), tmp_path, tokenizer_dir)
    pipe = mii.pipeline(str(path), dtype="float32")
    try:
        assert (pipe.engine_plan.weight_dtype, pipe.engine_plan.linear_backend) == ("float32", "torch")
        assert pipe.engine.loaded.model.lm_head.weight.dtype == torch.float32
    finally:
        pipe.destroy()
