"""CUDA-graph bucketing and replay logic, without a GPU: batch sizes, which steps fit, the padded static inputs,
and a whole engine whose decode steps go through the graph path (replayed eagerly on CPU, attention by our
Triton kernels in the interpreter) giving the same tokens as the eager path."""

import numpy as np
import pytest
import torch

from mii.engine.cuda_graphs import DecodeGraphs, EagerReplay, bucket, capture_decode_graphs, graph_batch_sizes
from mii.engine.model_runner import StepMeta


def test_graph_batch_sizes():
    assert graph_batch_sizes(512) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(100, limit=40) == [1, 2, 4, 8, 16, 32, 40]


def test_bucket():
    sizes = graph_batch_sizes(64)
    assert [bucket(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 32, 64]
    assert bucket(sizes, 65) is None


def meta(lengths, seq_lens, width=4):
    S, T = len(lengths), sum(lengths)
    return StepMeta(input_ids=np.arange(T) + 7, positions=np.array(seq_lens) - 1 if T == S else np.arange(T),
                    slots=np.arange(T) + 100, groups=[], logit_index=np.cumsum(lengths) - 1, sample_rows=np.arange(S),
                    query_start=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                    seq_lens=np.array(seq_lens, dtype=np.int32),
                    block_tables=np.arange(S * width, dtype=np.int32).reshape(S, width) + 1,
                    num_decode=int(np.argmin(np.array(lengths) == 1)) if max(lengths) > 1 else S)


class _Model(torch.nn.Module):
    """Records what the graph's forward saw; logits = a function of the inputs."""

    def forward(self, ids, pos, ctx):
        self.seen = (ids.clone(), pos.clone(), ctx.slot_mapping.clone(), ctx.seq_lens.clone(),
                     ctx.query_start.clone(), ctx.block_tables.clone())
        return (ids * 1000 + pos).float().unsqueeze(1)

    def compute_logits(self, hidden):
        return hidden.repeat(1, 3)


class _Runner:
    def __init__(self):
        self.model, self.device, self.block_size = _Model(), torch.device("cpu"), 16


def test_fits_decode_only_steps_up_to_the_largest_size():
    g = DecodeGraphs(_Runner(), [1, 2, 4], max_blocks_per_seq=8, graph_cls=EagerReplay)
    assert g.fits(meta([1, 1, 1], [5, 9, 30])) == 4
    assert g.fits(meta([1, 1, 3], [5, 9, 30])) is None           # a prompt chunk: eager
    assert g.fits(meta([1] * 5, [5] * 5)) is None                # more sequences than the largest graph
    assert g.fits(meta([1, 1], [5, 9], width=9)) is None         # a table wider than captured


def test_replay_pads_rows_that_write_nothing_and_see_no_keys():
    runner = _Runner()
    g = DecodeGraphs(runner, [1, 2, 4], max_blocks_per_seq=8, graph_cls=EagerReplay)
    m = meta([1, 1, 1], [5, 9, 30])
    logits = g.run(m)
    ids, pos, slots, lens, qs, tables = runner.model.seen
    assert ids.tolist() == [7, 8, 9, 0] and pos.tolist() == [4, 8, 29, 0]
    assert slots.tolist() == [100, 101, 102, -1] and lens.tolist() == [5, 9, 30, 0]
    assert qs.tolist() == [0, 1, 2, 3, 4]
    assert tables[:3, :4].tolist() == m.block_tables.tolist()
    assert logits.shape == (3, 3) and logits[:, 0].tolist() == [7004.0, 8008.0, 9029.0]
    # a smaller step after a larger one: stale rows are padding again
    g.run(meta([1], [3]))
    ids, pos, slots, lens, qs, tables = runner.model.seen
    assert ids.tolist() == [7] and slots.tolist() == [100] and lens.tolist() == [3]
    g.run(meta([1, 1], [3, 4]))
    assert runner.model.seen[2].tolist() == [100, 101] and runner.model.seen[3].tolist() == [3, 4]


def test_only_the_sampling_rows_come_back():
    g = DecodeGraphs(_Runner(), [4], max_blocks_per_seq=8, graph_cls=EagerReplay)
    m = meta([1, 1, 1], [5, 9, 30])
    m.logit_index, m.sample_rows = np.array([0, 2]), np.array([0, 2])  # row 1: a one-token prompt chunk, not final
    assert g.run(m)[:, 0].tolist() == [7004.0, 9029.0]


def test_engine_decode_through_graph_path_matches_eager(tmp_path, tokenizer_dir, monkeypatch):
    """On a GPU: real CUDA graphs. On CPU: the same path with graphs replayed eagerly and the Triton attention
    in its interpreter."""
    on_gpu = torch.cuda.is_available()  # (without a GPU, tests/conftest.py set TRITON_INTERPRET=1)
    pytest.importorskip("triton", reason="triton is not installed")
    from transformers import LlamaConfig

    import mii
    from mii.kernels import paged_attention_cuda as ta
    from mii.layers.attention import PagedAttention
    from tests.reference import TINY, tiny_checkpoint

    def forward(self, q, k, v, ctx):  # the GPU attention path, on CPU
        return ta._op_cuda(q, k, v, self.k_cache, self.v_cache, ctx.slot_mapping, ctx.query_start, ctx.seq_lens,
                           ctx.block_tables, ctx.max_query_len, self.scale, self.window or 0)

    if not on_gpu:
        monkeypatch.setattr(PagedAttention, "forward", forward)
    path = tiny_checkpoint(LlamaConfig(vocab_size=49152, **TINY), tmp_path, tokenizer_dir)
    prompts = [[5, 6, 7], list(range(100, 140)), [9] * 20]
    pipe = mii.pipeline(str(path), dtype="float32", device="cuda" if on_gpu else "cpu", cuda_graphs=False,
                        inference_engine_config={
        "state_manager": {"max_ragged_sequence_count": 4, "kv_block_size": 16, "max_ragged_batch_size": 32}})
    try:
        if not on_gpu:  # the CPU's one-call layer stack would skip the GPU attention path patched in above
            pipe.engine.loaded.model.model.stack = None
        kw = dict(max_new_tokens=10, do_sample=False, ignore_eos=True)
        eager = pipe(prompts, **kw)
        runner, plan = pipe.engine.runner, pipe.engine.plan
        assert runner.graphs is None
        graphs = capture_decode_graphs(runner, plan, graph_cls=None if on_gpu else EagerReplay)
        assert "3 decode batch sizes (1, 2, 4)" in plan.cuda_graphs and runner.graphs is graphs
        replays = []
        for size, g in graphs.graphs.items():
            g.replay = (lambda f, s: (lambda: replays.append(s) or f()))(g.replay, size)
        graphed = pipe(prompts, **kw)
        assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
        assert replays and set(replays) <= {1, 2, 4} and 4 in replays
    finally:
        pipe.destroy()
