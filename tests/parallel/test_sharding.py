"""How each parallel layer shards a checkpoint tensor, checked with recognisable values (weights = arange) in one
process: `set_tp(rank, size)` makes the layers build and load rank `rank`'s shard, no process group needed.
Partial outputs of row-parallel layers and MoE experts are summed by hand where the all-reduce would sum them."""
import pytest
import torch
import torch.nn.functional as F

from mii.errors import ModelLoadError
from mii.layers import moe as moe_module
from mii.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mii.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                               RowParallelLinear)
from mii.layers.moe import DOWN, GATE, UP, FusedMoE
from mii.parallel import set_tp


@pytest.fixture(autouse=True)
def one_rank_after():
    yield
    set_tp(0, 1)


def ar(*shape) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).view(*shape)


def build(rank: int, size: int, make):
    set_tp(rank, size)
    return make()


def load(layer, name: str, tensor, shard=None):
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard)


def test_column_parallel_keeps_its_rows():
    w, b = ar(6, 4), ar(6) + 100
    for r in range(2):
        layer = build(r, 2, lambda: ColumnParallelLinear(4, 6, bias=True))
        load(layer, "weight", w)
        load(layer, "bias", b)
        assert torch.equal(layer.weight, w[3 * r: 3 * r + 3])
        assert torch.equal(layer.bias, b[3 * r: 3 * r + 3])


def test_row_parallel_keeps_its_columns_and_partials_sum_to_the_full_output(monkeypatch):
    monkeypatch.setattr("mii.layers.linear.all_reduce", lambda y: y)  # summed by hand below
    w, b, x = ar(4, 6), ar(4) + 100, torch.randn(3, 6)
    out = 0
    for r in range(2):
        layer = build(r, 2, lambda: RowParallelLinear(6, 4, bias=True))
        load(layer, "weight", w)
        load(layer, "bias", b)
        assert torch.equal(layer.weight, w[:, 3 * r: 3 * r + 3])
        assert torch.equal(layer.bias, b)  # replicated, added once after the sum
        out = out + F.linear(x[:, 3 * r: 3 * r + 3], layer.weight)
    torch.testing.assert_close(out + b, F.linear(x, w, b))


def test_merged_gate_up_each_part_split_at_its_offset():
    gate, up = ar(4, 2), ar(4, 2) + 100
    for r in range(2):
        for fused in (False, True):
            layer = build(r, 2, lambda: MergedColumnParallelLinear(2, [4, 4]))
            if fused:  # Phi-3's gate_up_proj: the parts concatenated in the checkpoint
                load(layer, "weight", torch.cat([gate, up]), "all")
            else:
                load(layer, "weight", gate, 0)
                load(layer, "weight", up, 1)
            assert torch.equal(layer.weight, torch.cat([gate[2 * r: 2 * r + 2], up[2 * r: 2 * r + 2]]))


def test_qkv_heads_and_kv_heads_split():
    d = 2  # head_dim; 4 query heads, 2 key/value heads
    q, k, v = ar(4 * d, 3), ar(2 * d, 3) + 100, ar(2 * d, 3) + 200
    for r in range(2):
        for fused in (False, True):
            layer = build(r, 2, lambda: QKVParallelLinear(3, d, n_heads=4, n_kv_heads=2, bias=False))
            assert (layer.n_heads, layer.n_kv_heads) == (2, 1)
            if fused:
                load(layer, "weight", torch.cat([q, k, v]), "qkv")
            else:
                for sid, t in zip("qkv", (q, k, v)):
                    load(layer, "weight", t, sid)
            want = torch.cat([q[2 * d * r: 2 * d * (r + 1)], k[d * r: d * (r + 1)], v[d * r: d * (r + 1)]])
            assert torch.equal(layer.weight, want)


def test_qkv_kv_heads_replicated_when_fewer_than_ranks():
    d = 2
    q, k, v = ar(4 * d, 3), ar(d, 3) + 100, ar(d, 3) + 200  # multi-query: one key/value head (Falcon-7B)
    for r in range(2):
        layer = build(r, 2, lambda: QKVParallelLinear(3, d, n_heads=4, n_kv_heads=1, bias=True))
        assert (layer.n_heads, layer.n_kv_heads, layer.kv_replicas) == (2, 1, 2)
        for sid, t in zip("qkv", (q, k, v)):
            load(layer, "weight", t, sid)
            load(layer, "bias", t[:, 0], sid)
        assert torch.equal(layer.weight, torch.cat([q[2 * d * r: 2 * d * (r + 1)], k, v]))
        assert torch.equal(layer.bias, torch.cat([q[2 * d * r: 2 * d * (r + 1), 0], k[:, 0], v[:, 0]]))
    # 2 key/value heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    k2 = ar(2 * d, 3) + 100
    for r in range(4):
        layer = build(r, 4, lambda: QKVParallelLinear(3, d, n_heads=4, n_kv_heads=2))
        load(layer, "weight", k2, "k")
        assert torch.equal(layer.weight[d: 2 * d], k2[d * (r // 2): d * (r // 2 + 1)])


@pytest.mark.parametrize("heads, kv, size, what", [(4, 2, 3, r"attention heads \(4\) does not divide by "
                                                                 r"tensor_parallel=3"),
                                                   (4, 3, 2, r"key/value heads \(3\) does not divide by "
                                                             r"tensor_parallel=2")])
def test_heads_that_do_not_divide_are_a_clear_error(heads, kv, size, what):
    set_tp(0, size)
    with pytest.raises(ModelLoadError, match=what):
        QKVParallelLinear(8, 2, n_heads=heads, n_kv_heads=kv)


def test_vocab_parallel_embedding_and_lm_head():
    V, D = 5, 3  # 5 rows over 2 ranks: 3 + 2
    w, b = ar(V, D), ar(V) + 100
    ids = torch.tensor([0, 2, 3, 4])
    emb_sum, logits = 0, []
    for r in range(2):
        emb = build(r, 2, lambda: VocabParallelEmbedding(V, D))
        load(emb, "weight", w)
        rows = slice(3 * r, min(3 * r + 3, V))
        assert torch.equal(emb.weight, w[rows])
        # what the forward does before its all-reduce: this rank's rows, zeros for the others' ids
        local = ids - emb.start
        inside = (local >= 0) & (local < emb.weight.shape[0])
        emb_sum = emb_sum + F.embedding(local.clamp(0, emb.weight.shape[0] - 1), emb.weight) * inside.unsqueeze(-1)
        head = build(r, 2, lambda: ParallelLMHead(V, D, bias=True))
        load(head, "weight", w)
        load(head, "bias", b)
        assert torch.equal(head.bias, b[rows])
        logits.append(F.linear(torch.ones(1, D), head.weight, head.bias))
    assert torch.equal(emb_sum, w[ids])
    torch.testing.assert_close(torch.cat(logits, -1), F.linear(torch.ones(1, D), w, b))


def test_moe_experts_split_over_the_intermediate_size(monkeypatch):
    monkeypatch.setattr(moe_module, "all_reduce", lambda y: y)
    E, H, I = 3, 2, 4
    gate = [ar(I, H) / 10 + e for e in range(E)]
    up = [ar(I, H) / 10 - e for e in range(E)]
    down = [ar(H, I) / 10 + 2 * e for e in range(E)]
    x, router = torch.randn(5, H), torch.randn(5, E)
    out = 0
    for r in range(2):
        m = build(r, 2, lambda: FusedMoE(E, 2, H, I, "silu", renormalize=True))
        for e in range(E):
            load(m, "w13", gate[e], (e, GATE))
            load(m, "w13", up[e], (e, UP))
            load(m, "w2", down[e], (e, DOWN))
            assert torch.equal(m.w13[e], torch.cat([gate[e][2 * r: 2 * r + 2], up[e][2 * r: 2 * r + 2]]))
            assert torch.equal(m.w2[e], down[e][:, 2 * r: 2 * r + 2])
        out = out + m(x, router)
    full = build(0, 1, lambda: FusedMoE(E, 2, H, I, "silu", renormalize=True))
    for e in range(E):
        load(full, "w13", gate[e], (e, GATE))
        load(full, "w13", up[e], (e, UP))
        load(full, "w2", down[e], (e, DOWN))
    torch.testing.assert_close(out, full(x, router))
