"""mii::paged_attention (the CPU kernel that reads KV blocks in place) against a plain-torch reference: mixed
decode and prompt-chunk batches, GQA, sliding windows, block sizes 16/32, partial last blocks, fp32 and bf16, head
sizes that take each of its loops (64 and 128: whole 64-column passes; 80: a pass of 64 and one of 16; 36: the
plain loops), and a bf16 or fp16 cache under fp32 queries."""
import pytest
import torch

from mii import kernels
from mii.envs import cpu_flags

pytestmark = pytest.mark.skipif(kernels.load_cpu_kernels() is not None,
                                reason=f"CPU kernel not built: {kernels.load_cpu_kernels()}")


def reference(q, k_cache, v_cache, tables, specs, scale, window):
    """Each sequence's keys from its blocks (head-major: [kvh, block_size, d] each), causal (and windowed) softmax
    in float64."""
    h, kvh = q.shape[1], k_cache.shape[1]
    outs, t = [], 0
    for (prev, new), table in zip(specs, tables):
        L = prev + new
        keys = torch.cat([k_cache[b].transpose(0, 1) for b in table])[:L].double().repeat_interleave(h // kvh, 1)
        vals = torch.cat([v_cache[b].transpose(0, 1) for b in table])[:L].double().repeat_interleave(h // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q[t: t + new].double(), keys) * scale
        qpos, kpos = torch.arange(prev, L)[:, None], torch.arange(L)[None]
        allowed = kpos <= qpos
        if window:
            allowed &= kpos > qpos - window
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vals))
        t += new
    return torch.cat(outs).reshape(q.shape[0], -1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32, 24])  # 24: bf16 keys in place as rows, not paired
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)])
def test_matches_reference(dtype, tol, block_size, window, heads):
    _check(dtype, tol, block_size, window, heads, 64)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("d", [80, 36, 128])
def test_head_sizes(dtype, tol, window, d):
    _check(dtype, tol, 16, window, (6, 2), d)


# (tokens already cached, new tokens): decode rows first, then prompt chunks, some starting mid-sequence;
# short chunks (< 16 tokens) take the in-place loop, longer ones a contiguous copy and ATen's SDPA
MIXED = [(40, 1), (5, 1), (31, 1), (0, 37), (70, 20), (32, 35), (10, 5), (0, 9), (44, 15)]
# decode rows of 128+ keys: split into parts of 128 keys, each a work item, combined afterwards
LONG = [(300, 1), (127, 1), (128, 1), (40, 1), (0, 20), (200, 3)]
# prompt chunks whose keys cross AMX prompt tiles' spans of 256 keys (and a window across one: 300)
SPANS = [(0, 300), (250, 40), (500, 20), (5, 1), (240, 33)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size,window", [(16, 0), (32, 0), (16, 150), (32, 200)])
def test_long_decode_rows(dtype, tol, block_size, window):
    _check(dtype, tol, block_size, window, (6, 2), 64, LONG)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("specs", [MIXED, LONG])
@pytest.mark.parametrize("window", [0, 150])
def test_half_cache_under_fp32_queries(cache_dtype, specs, window):
    """The new keys and values are rounded to the cache's dtype as torch rounds them; the attention is then exact
    to fp32 over the values the cache holds."""
    _check(torch.float32, 1e-5, 32, window, (9, 3), 64, specs, cache_dtype)


def test_keys_paired_where_read_in_place_in_whole_groups():
    """bf16 queries on a bf16 cache, head size 64 or 128, blocks of whole 16-key groups, a CPU with AVX512-BF16: the
    kernel keeps each block's keys as pairs (lane u of group g's vector i: key 16g + u's values 2i, 2i + 1)."""
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 3, 32, 64, dtype=torch.bfloat16)
    assert torch.ops.mii.keys_paired(q, cache) == ("avx512_bf16" in cpu_flags())
    assert not torch.ops.mii.keys_paired(q, cache[:, :, :24])
    assert not torch.ops.mii.keys_paired(q.float(), cache)
    assert not torch.ops.mii.keys_paired(q[..., :48], torch.zeros(2, 3, 32, 48, dtype=torch.bfloat16))
    rows = torch.randn(2, 3, 32, 64).bfloat16()
    paired = kernels.paired_keys(rows)
    n, h, g, i, u = 1, 2, 1, 5, 7
    assert torch.equal(paired[n, h].view(-1, 16, 2)[g * 32 + i, u], rows[n, h, 16 * g + u, 2 * i: 2 * i + 2])
    assert torch.equal(kernels.paired_keys(paired, paired=False), rows)


def test_a_cache_of_another_dtype_is_refused():
    q = torch.randn(1, 2, 8, dtype=torch.bfloat16)
    cache = torch.zeros(2, 2, 16, 8)  # fp32 under bf16 queries: not a layout the kernel reads
    with pytest.raises(RuntimeError, match="caches must have q's dtype"):
        torch.ops.mii.paged_attention(q, q, q, cache, cache, torch.tensor([0]), torch.tensor([0, 1], dtype=torch.int32),
                                      torch.tensor([1], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32),
                                      1, 0.3, 0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_row_alone_equals_the_row_in_a_batch(dtype, tol):
    """A decode row's parts depend on its own sequence, not on the batch: alone or among others, the same bits."""
    out, (q, k, v, k_cache, v_cache, slots, query_start, seq_lens, block_tables) = _check(
        dtype, tol, 16, 0, (6, 2), 64, LONG)
    for i in (0, 2):  # 300 keys (3 parts), 128 keys (1 part, at the boundary)
        t = int(query_start[i])
        alone = torch.ops.mii.paged_attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], k_cache, v_cache, slots[t:t + 1],
                                              torch.tensor([0, 1], dtype=torch.int32), seq_lens[i:i + 1],
                                              block_tables[i:i + 1], 1, 64 ** -0.5, 0)
        assert torch.equal(alone, out[t:t + 1])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [0, 7, 300])
@pytest.mark.parametrize("specs", [MIXED, LONG, SPANS], ids=["mixed", "long", "spans"])
@pytest.mark.parametrize("amx", ["1", "0"])
def test_bf16_rows_in_place_round_correctly(d, window, specs, amx, monkeypatch):
    """bf16 queries on a bf16 cache, the rows the kernel computes in place (decode rows and chunks under 16 tokens;
    on CPUs with AVX512-BF16 every chunk, its keys multiplied by vdpbf16ps, its values widened in registers; on
    CPUs with AMX the chunks' tiles of 16 rows by tile products, MII_AMX=0 turning that off): within half a bf16
    step of the float64 attention (the output's own rounding), where the shape tolerance above allows 2e-2.
    (Elsewhere the longer chunks go through ATen's SDPA.)"""
    monkeypatch.setenv("MII_AMX", amx)
    out, (q, k, v, k_cache, v_cache, slots, query_start, seq_lens, block_tables) = _check(
        torch.bfloat16, 2e-2, 32, window, (9, 3), d, specs)
    tables = [row[: -(-(p + n) // 32)].tolist() for row, (p, n) in zip(block_tables, specs)]
    expected = reference(q, rows_layout(q, k_cache), v_cache, tables, specs, d ** -0.5, window)
    every = "avx512_bf16" in cpu_flags()
    rows = [r for i, (_, n) in enumerate(specs) if every or n < 16 for r in range(query_start[i], query_start[i + 1])]
    got, want = out[rows].double(), expected[rows]
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=2 ** -20))) - 7)  # a bf16 step at each value
    shown = want.abs() > 0.05  # away from zero, where an absolute error of the fp32 sums could dominate
    # half a step, and a little for the fp32 sums where the exact value sits next to a rounding boundary
    assert ((got - want).abs() <= 0.5 * step * (1 + 2 ** -5))[shown].all()


def _check(dtype, tol, block_size, window, heads, d, specs=MIXED, cache_dtype=None):
    torch.manual_seed(0)
    h, kvh = heads
    cache_dtype = cache_dtype or dtype
    num_blocks = sum(-(-(p + n) // block_size) for p, n in specs) + 8
    k_cache = torch.zeros(num_blocks, kvh, block_size, d, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    tables, slots = [], []
    for prev, new in specs:
        table = [free.pop() for _ in range(-(-(prev + new) // block_size))]
        tables.append(table)
        for p in range(prev):
            k_cache[table[p // block_size], :, p % block_size] = torch.randn(kvh, d).to(cache_dtype)
            v_cache[table[p // block_size], :, p % block_size] = torch.randn(kvh, d).to(cache_dtype)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(prev, prev + new)]
    T = sum(new for _, new in specs)
    q, k, v = (torch.randn(T, n, d).to(dtype) for n in (h, kvh, kvh))
    query_start = torch.tensor([0] + torch.tensor([n for _, n in specs]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([p + n for p, n in specs], dtype=torch.int32)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.tensor(slots)
    k_kernel = kernel_layout(q, k_cache)
    out = torch.ops.mii.paged_attention(q, k, v, k_kernel, v_cache, slots, query_start, seq_lens, block_tables,
                                        37, d ** -0.5, window)
    k_cache = rows_layout(q, k_kernel)
    # the new keys and values are in their slots
    new_k, new_v = (c[slots // block_size, :, slots % block_size] for c in (k_cache, v_cache))
    assert torch.equal(new_k, k.to(cache_dtype)) and torch.equal(new_v, v.to(cache_dtype))
    expected = reference(q, k_cache, v_cache, tables, specs, d ** -0.5, window)
    assert out.shape == (T, h * d) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    return out, (q, k, v, k_kernel, v_cache, slots, query_start, seq_lens, block_tables)


def kernel_layout(q, k_cache):
    """The key cache as the kernel keeps it (its keys paired where mii::keys_paired says so)."""
    return kernels.paired_keys(k_cache) if torch.ops.mii.keys_paired(q, k_cache) else k_cache


def rows_layout(q, k_cache):
    """The kernel's key cache with each block's keys as rows again, as reference() reads them."""
    return kernels.paired_keys(k_cache, paired=False) if torch.ops.mii.keys_paired(q, k_cache) else k_cache


def test_traceable_by_torch_compile():
    """The op has a fake implementation, so a compiled graph keeps it as one opaque call."""
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    kc, vc = torch.zeros(4, 2, 16, 8), torch.zeros(4, 2, 16, 8)
    args = (torch.tensor([0, 1, 2]), torch.tensor([0, 2, 3], dtype=torch.int32),
            torch.tensor([2, 1], dtype=torch.int32), torch.tensor([[0], [1]], dtype=torch.int32))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.mii.paged_attention(q, k, v, kc, vc, *args, 2, 0.3, 0)
    assert out.shape == (3, 32)


# (without AVX512-BF16 a bf16 prompt chunk of kPromptChunk tokens or more goes through ATen's SDPA over a gathered
# copy, whose bf16 rows do depend on the chunk: the dtype is fp32 there unless asked, see mii/engine/plan.py)
@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="prompt spans are the AVX512-BF16 and AMX kernels'")
@pytest.mark.parametrize("block_size", [16, 32, 48])  # 48: spans of 240 keys, their last tile step half empty
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (12, 12)])
@pytest.mark.parametrize("window", [0, 100])
def test_prompt_spans_agree_and_rows_do_not_depend_on_their_tile(block_size, heads, window, monkeypatch):
    """A bf16 prompt chunk's items (rows = query tokens x the heads of a kv head, 16 tokens at a time) take their
    keys a span of 256 at a time: where the CPU has AMX by tile products (the scores' exact products summed in AMX's
    order, the weights as hi + lo bf16, partial tiles padded), with MII_AMX=0 or without AMX by vdpbf16ps scores and
    fp32 weights (prompt_item_bf16). Both paths agree closely, and within a path a row's bits do not depend on the
    rows beside it (the chunk cut after a different token: its items hold other rows), over one span of keys or
    several."""
    specs = [(0, 300), (40, 1), (13, 22), (64, 5)]
    out = {}
    for amx in ("1", "0"):
        monkeypatch.setenv("MII_AMX", amx)
        out[amx], args = _check(torch.bfloat16, 2e-2, block_size, window, heads, 64, specs)
        q, k, v, k_cache, v_cache, slots, query_start, seq_lens, block_tables = args
        # the first sequence's tokens [a, b) alone (their keys are already in the cache): the same bits
        for a, b in ((0, 20), (270, 300), (9, 290)):
            alone = torch.ops.mii.paged_attention(q[a:b], k[a:b], v[a:b], k_cache, v_cache, slots[a:b],
                                                  torch.tensor([0, b - a], dtype=torch.int32),
                                                  torch.tensor([b], dtype=torch.int32), block_tables[:1], b - a,
                                                  64 ** -0.5, window)
            assert torch.equal(alone, out[amx][a:b]), (amx, a, b)
    torch.testing.assert_close(out["1"], out["0"], rtol=2 ** -7, atol=2 ** -9)


# --- an int8 cache (kv_cache_dtype="int8"): [blocks, kv_heads, block_size, d + 4] bytes per layer, each kv head's
# run in a block B rows of d int8 values (keys as quads offset by 128, values in the accumulators' order) then the
# rows' B fp32 scales

def int8_cache_rows(cache, keys: bool):
    """An int8 cache's keys or values as float64 rows [blocks, kv_heads, block_size, d] (values times scales)."""
    n, kvh, bs, row = cache.shape
    d = row - 4
    run = cache.reshape(n, kvh, bs * row)
    scales = run[..., bs * d:].contiguous().view(torch.float32).double()  # [n, kvh, bs]
    data = run[..., : bs * d]
    if keys:  # group g's quad i, lane u: key 16g + u's values 4i .. 4i + 3, offset by 128
        q = (data.view(torch.uint8).to(torch.int32) - 128).reshape(n, kvh, bs // 16, d // 4, 16, 4).transpose(3, 4)
    else:  # byte 32h + 16p + i: value 32h + 2i + p
        q = data.to(torch.int32).reshape(n, kvh, bs, d // 32, 2, 16).transpose(-1, -2)
    return q.reshape(n, kvh, bs, d).double() * scales[..., None]


def quantize_like_the_kernel(x):
    """Rows of x (last dim) as the kernel quantizes them: int8 values round(x * (127 / max|x|)) and the scale
    max|x| * (1 / 127), in fp32."""
    x = x.float()
    mx = x.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.full_like(mx, 127) / mx, torch.zeros_like(mx))  # (127 / mx: 127 * (1 / mx))
    return torch.round(x * inv), mx * torch.tensor(1 / 127, dtype=torch.float32)


def _check_int8(block_size, window, heads, d, specs):
    torch.manual_seed(0)
    h, kvh = heads
    num_blocks = sum(-(-(p + n) // block_size) for p, n in specs) + 8
    # every slot holds some key and value already (random bytes, scales 0.005-0.05); the step writes its own
    k_cache = torch.randint(-128, 128, (num_blocks, kvh, block_size, d + 4), dtype=torch.int8)
    v_cache = torch.randint(-128, 128, (num_blocks, kvh, block_size, d + 4), dtype=torch.int8)
    for c in (k_cache, v_cache):
        c.view(num_blocks, kvh, -1)[..., block_size * d:] = (
            torch.rand(num_blocks, kvh, block_size) * 0.045 + 0.005).view(torch.int8).view(num_blocks, kvh, -1)
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(p + n) // block_size))] for p, n in specs]
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size
                          for t, (prev, new) in zip(tables, specs) for p in range(prev, prev + new)])
    T = sum(new for _, new in specs)
    q, k, v = (torch.randn(T, n, d).bfloat16() for n in (h, kvh, kvh))
    query_start = torch.tensor([0] + torch.tensor([n for _, n in specs]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([p + n for p, n in specs], dtype=torch.int32)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = torch.ops.mii.paged_attention(q, k, v, k_cache, v_cache, slots, query_start, seq_lens, block_tables,
                                        37, d ** -0.5, window)
    keys, values = int8_cache_rows(k_cache, True), int8_cache_rows(v_cache, False)
    # the new keys and values are in their slots, quantized as torch quantizes them
    for cache_rows, x in ((keys, k), (values, v)):
        qx, scale = quantize_like_the_kernel(x)
        assert torch.equal(cache_rows[slots // block_size, :, slots % block_size], (qx.double() * scale.double()))
    qq, qs = quantize_like_the_kernel(q)  # the queries, per row, as the keys' dot products take them
    expected = reference(qq.double() * qs.double(), keys, values, tables, specs, d ** -0.5, window)
    return out, expected, (q, k, v, k_cache, v_cache, slots, query_start, seq_lens, block_tables)


needs_q8 = pytest.mark.skipif(not {"avx512_vnni", "avx512_bf16"} <= set(cpu_flags()),
                              reason="an int8 cache needs AVX512-VNNI and AVX512-BF16")


@needs_q8
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [0, 150])
@pytest.mark.parametrize("heads,d", [((9, 3), 64), ((8, 1), 64), ((6, 6), 128), ((6, 2), 128)])
@pytest.mark.parametrize("specs", [MIXED, LONG], ids=["mixed", "long"])
def test_int8_cache_matches_its_quantized_reference(block_size, window, heads, d, specs):
    """Decode rows and prompt chunks on an int8 cache: the step's keys and values quantized into their slots exactly
    as torch rounds them (per row, 127 / max|x|), and the attention within half a bf16 step of the float64
    attention over what the cache holds, the queries quantized per row as the kernel takes them."""
    out, want, _ = _check_int8(block_size, window, heads, d, specs)
    assert out.dtype == torch.bfloat16
    got = out.double()
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=2 ** -20))) - 7)
    shown = want.abs() > 0.05
    assert ((got - want).abs() <= 0.5 * step * (1 + 2 ** -5))[shown].all()


@needs_q8
def test_int8_cache_row_alone_equals_the_row_in_a_batch():
    out, _, (q, k, v, k_cache, v_cache, slots, query_start, seq_lens, block_tables) = _check_int8(
        16, 0, (9, 3), 64, LONG)
    for i in (0, 2):
        t = int(query_start[i])
        alone = torch.ops.mii.paged_attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], k_cache, v_cache, slots[t:t + 1],
                                              torch.tensor([0, 1], dtype=torch.int32), seq_lens[i:i + 1],
                                              block_tables[i:i + 1], 1, 64 ** -0.5, 0)
        assert torch.equal(alone, out[t:t + 1])


@needs_q8
def test_int8_cache_queries_quantized_cost_little():
    """What quantizing the queries per row costs: the output within 2% (as a whole: 0.85% measured) of the float64
    attention of the unquantized queries over the same cache, whose keys (random bytes, scales up to 0.05) make
    sharper scores than a model's."""
    out, _, (q, _k, _v, _kc, _vc, _s, _qs, _sl, block_tables) = _check_int8(32, 0, (9, 3), 64, MIXED)
    keys, values = int8_cache_rows(_kc, True), int8_cache_rows(_vc, False)
    tables = [row[: -(-(p + n) // 32)].tolist() for row, (p, n) in zip(block_tables, MIXED)]
    exact_q = reference(q.double(), keys, values, tables, MIXED, 64 ** -0.5, 0)
    assert (out.double() - exact_q).norm() < 2e-2 * exact_q.norm()


def test_int8_cache_refused_where_the_kernel_cannot_read_it():
    q = torch.randn(1, 2, 32, dtype=torch.bfloat16)
    cache = torch.zeros(2, 2, 16, 36, dtype=torch.int8)  # head size 32
    with pytest.raises(RuntimeError, match="an int8 cache needs bf16 queries, head size 64 or 128"):
        torch.ops.mii.paged_attention(q, q[:, :1], q[:, :1], cache, cache, torch.tensor([0]),
                                      torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                      torch.tensor([[0]], dtype=torch.int32), 1, 0.3, 0)
    assert not torch.ops.mii.keys_paired(q, cache)
