"""Our Triton paged-attention kernels against a plain torch reference, on small shapes.

Without a GPU the kernels run in Triton's CPU interpreter (`TRITON_INTERPRET=1`, set by `tests/conftest.py`
before Triton is imported); with one they run compiled on it. Skipped when Triton cannot be imported (`pip install triton`).
"""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the `gpu` extra)")

from mii.kernels import paged_attention_cuda as ta  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows(cache, slots):
    """The [n, kvh, d] rows of cache slots `slots` in a head-major cache [blocks, kvh, block_size, d]."""
    bs = cache.shape[2]
    return cache[slots // bs, :, slots % bs]


def reference(q, k_cache, v_cache, tables, seq_lens, q_lens, scale, window):
    """Per sequence: gather its keys from the block table, masked softmax in float64."""
    bs = k_cache.shape[2]
    h, kvh = q.shape[1], k_cache.shape[1]
    out, t = torch.zeros_like(q, dtype=torch.float64), 0
    for s, (L, n) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(L)
        slots = tables[s][pos // bs].long() * bs + pos % bs
        k = rows(k_cache, slots).double().repeat_interleave(h // kvh, 1)  # [L, h, d]
        v = rows(v_cache, slots).double().repeat_interleave(h // kvh, 1)
        qs = q[t: t + n].double()                                                                   # [n, h, d]
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale
        qpos = torch.arange(L - n, L).view(n, 1)
        allowed = pos.view(1, L) <= qpos
        if window:
            allowed &= pos.view(1, L) > qpos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[t: t + n] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
        t += n
    return out


def make_batch(q_lens, seq_lens, h, kvh, d, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-L // block_size) for L in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered over the cache, in no order
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, L in enumerate(seq_lens):
        n = -(-L // block_size)
        tables[s, :n] = perm[used: used + n].to(torch.int32)
        used += n
    k_cache = torch.randn(num_blocks, kvh, block_size, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, kvh, block_size, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), h, d, generator=g).to(dtype)
    qs = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qs[1:] = torch.tensor(q_lens).cumsum(0)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qs


CASES = [
    # (query lengths, keys per sequence): decode sequences first, then prompt chunks (some after a context)
    pytest.param([1, 1, 1], [1, 17, 40], id="decode-only"),
    pytest.param([1, 1, 23, 7], [5, 33, 23, 50], id="mixed"),
    pytest.param([37], [37], id="one-prompt"),
    pytest.param([1, 20, 16], [70, 45, 16], id="chunk-after-context"),
]


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("h,kvh", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(q_lens, seq_lens, h, kvh, block_size):
    d, scale = 16, 0.3
    q, kc, vc, tables, lens, qs = make_batch(q_lens, seq_lens, h, kvh, d, block_size, torch.float32)
    n_dec = sum(1 for n in q_lens if n == 1) if q_lens[0] == 1 else 0
    dev = lambda x: x.to(DEVICE)
    out = ta.paged_attention(dev(q), dev(kc), dev(vc), dev(tables), dev(lens), dev(qs), max(q_lens), n_dec,
                             len(q_lens), scale)
    ref = reference(q, kc, vc, tables, seq_lens, q_lens, scale, None)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_sliding_window(window, block_size):
    q_lens, seq_lens = [1, 1, 30, 9], [3, 45, 30, 77]
    q, kc, vc, tables, lens, qs = make_batch(q_lens, seq_lens, 4, 2, 32, block_size, torch.float32, seed=3)
    dev = lambda x: x.to(DEVICE)
    out = ta.paged_attention(dev(q), dev(kc), dev(vc), dev(tables), dev(lens), dev(qs), 30, 2, 4, 0.2, window)
    ref = reference(q, kc, vc, tables, seq_lens, q_lens, 0.2, window)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)


def test_bf16_and_odd_head_dim():
    """bf16 inputs (fp32 accumulation) and a head size that is not a power of two (Phi-2's 80)."""
    q_lens, seq_lens = [1, 12], [33, 12]
    q, kc, vc, tables, lens, qs = make_batch(q_lens, seq_lens, 4, 2, 80, 16, torch.bfloat16, seed=5)
    dev = lambda x: x.to(DEVICE)
    out = ta.paged_attention(dev(q), dev(kc), dev(vc), dev(tables), dev(lens), dev(qs), 12, 1, 2, 80 ** -0.5)
    ref = reference(q, kc, vc, tables, seq_lens, q_lens, 80 ** -0.5, None)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=2e-2)


def test_write_kv_skips_negative_slots():
    kvh, d, bs = 2, 16, 16
    kc = torch.zeros(4, kvh, bs, d, device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, kvh, d, device=DEVICE)
    v = torch.randn(3, kvh, d, device=DEVICE)
    slots = torch.tensor([5, -1, 40], device=DEVICE)
    ta.write_kv(k, v, kc, vc, slots)
    written = torch.tensor([5, 40], device=DEVICE)
    assert torch.equal(rows(kc, written), k[[0, 2]]) and torch.equal(rows(vc, written), v[[0, 2]])
    assert int((kc != 0).sum()) == 2 * kvh * d  # the -1 row wrote nothing


def test_padding_rows_are_zero():
    """CUDA-graph padding: a sequence with one query and no keys gives a zero row, not NaN."""
    q, kc, vc, tables, lens, qs = make_batch([1, 1], [9, 1], 4, 2, 16, 16, torch.float32)
    lens[1] = 0
    out = ta.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE),
                             qs.to(DEVICE), 1, 2, 2, 0.25)
    assert torch.isfinite(out).all() and out[1].abs().sum() == 0


def test_op_kernel_writes_then_attends():
    """The CUDA implementation of `mii::paged_attention` (called directly here): K/V written to their slots, then
    one launch for a mixed step (decode rows in prompt-sized tiles)."""
    q_lens, seq_lens, h, kvh, d, bs = [1, 1, 14], [20, 3, 14], 4, 2, 16, 16
    q, kc, vc, tables, lens, qs = make_batch(q_lens, seq_lens, h, kvh, d, bs, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    k_new, v_new = torch.randn(16, kvh, d, generator=g), torch.randn(16, kvh, d, generator=g)
    slots = torch.cat([tables[s][(torch.arange(L - n, L) // bs)].long() * bs + torch.arange(L - n, L) % bs
                       for s, (L, n) in enumerate(zip(seq_lens, q_lens))])
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k[slots // bs, :, slots % bs], ref_v[slots // bs, :, slots % bs] = k_new, v_new
    ref = reference(q, ref_k, ref_v, tables, seq_lens, q_lens, 0.25, None)
    dev = lambda x: x.to(DEVICE)
    kc, vc = dev(kc), dev(vc)
    out = ta._op_cuda(dev(q), dev(k_new), dev(v_new), kc, vc, dev(slots), dev(qs), dev(lens), dev(tables), 14,
                      0.25, 0)
    assert out.shape == (16, h * d)
    torch.testing.assert_close(out.cpu().double().view(16, h, d), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kc.cpu(), ref_k)


def test_tiny_mistral_through_the_kernel_matches_transformers(tmp_path, tokenizer_dir, monkeypatch):
    """The whole engine (chunked prompts, decode, sliding window, GQA) with attention done by these kernels."""
    from transformers import MistralConfig

    from mii.layers.attention import PagedAttention
    from tests.reference import TINY, assert_matches_transformers, tiny_checkpoint

    def forward(self, q, k, v, ctx):
        return ta._op_cuda(q, k, v, self.k_cache, self.v_cache, ctx.slot_mapping, ctx.query_start, ctx.seq_lens,
                           ctx.block_tables, ctx.max_query_len, self.scale, self.window or 0)

    monkeypatch.setattr(PagedAttention, "forward", forward)
    cfg = MistralConfig(vocab_size=49152, sliding_window=16, **TINY)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir), new_tokens=12,
                                device="cuda" if torch.cuda.is_available() else "cpu")
