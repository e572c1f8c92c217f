"""Tensor parallelism end to end on CPU (gloo, 2 ranks): greedy output of `mii.pipeline(..., tensor_parallel=2)`
equals the one-rank pipeline on tiny checkpoints of the four families whose sharding differs (GQA Llama: KV heads
split; Mixtral: experts split; Falcon-7B: one KV head, replicated; Phi-2: biases everywhere, LM head bias), with
close log-probabilities (the all-reduce sums in another order). Also: memory per rank, a rank that dies, heads
that do not divide, torchrun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import FalconConfig, LlamaConfig, MixtralConfig, PhiConfig

import mii
from mii.envs import cpu_flags
from mii.errors import ModelLoadError, TensorParallelError
from mii.loading import load_model, resolve_source
from mii.parallel import set_tp
from tests.models.test_falcon import BASE as FALCON_BASE, random_norms
from tests.models.test_phi import randomize as phi_randomize
from tests.parallel.conftest import KV, free_port
from tests.reference import TINY, prompts_for, tiny_checkpoint

VOCAB = 49152
NEW = 24
pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


def family(name: str):
    tiny_mha = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    return {
        "llama_gqa": (LlamaConfig(vocab_size=VOCAB, **TINY), None),
        "mixtral": (MixtralConfig(vocab_size=VOCAB, num_local_experts=8, num_experts_per_tok=2, **TINY), None),
        "falcon_multi_query": (FalconConfig(**FALCON_BASE, multi_query=True, parallel_attn=True,
                                            new_decoder_architecture=False, bias=False), random_norms),
        "phi2": (PhiConfig(vocab_size=VOCAB, partial_rotary_factor=0.5, **tiny_mha), phi_randomize),
    }[name]


def run(path, prompts, **kw):
    pipe = mii.pipeline(str(path), dtype="float32", inference_engine_config=KV, **kw)
    try:
        return pipe(prompts, max_new_tokens=NEW, do_sample=False, ignore_eos=True, logprobs=5)
    finally:
        pipe.destroy()


@pytest.mark.parametrize("name", ["llama_gqa", "mixtral", "falcon_multi_query", "phi2"])
def test_tp2_greedy_equals_tp1(tmp_path, tokenizer_dir, name):
    cfg, post_init = family(name)
    path = tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=post_init)
    prompts = prompts_for(VOCAB)  # 5, 37 and 90 tokens: chunked prompts next to decodes
    one = run(path, prompts)
    two = run(path, prompts, tensor_parallel=2, torch_dist_port=free_port())
    assert len(one) == len(two) == len(prompts)
    for i, (a, b) in enumerate(zip(one, two)):
        assert b.token_ids == a.token_ids, f"prompt {i}: TP=2 {b.token_ids} != TP=1 {a.token_ids}"
        assert b.generated_text == a.generated_text
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids) == NEW, f"prompt {i}: lengths"
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            assert x["token_id"] == y["token_id"] == a.token_ids[step]
            assert abs(x["logprob"] - y["logprob"]) < 1e-4, f"prompt {i} step {step}"
            assert len(x["top_logprobs"]) == len(y["top_logprobs"]) == 5, f"prompt {i} step {step}"
            # the five best values agree (ids may swap only between log-probabilities closer than the tolerance)
            xs, ys = (sorted(d.values(), reverse=True) for d in (x["top_logprobs"], y["top_logprobs"]))
            assert all(abs(u - v) < 1e-4 for u, v in zip(xs, ys)), f"prompt {i} step {step}: {xs} != {ys}"
            for tok in x["top_logprobs"].keys() & y["top_logprobs"].keys():
                assert abs(x["top_logprobs"][tok] - y["top_logprobs"][tok]) < 1e-4, f"prompt {i} step {step} {tok}"


@pytest.mark.skipif(not {"avx512_vnni", "avx512_bf16"} <= set(cpu_flags()),
                    reason="an int8 KV cache needs AVX512-VNNI and AVX512-BF16")
def test_tp2_int8_kv_cache_equals_tp1(tmp_path, tokenizer_dir):
    """kv_cache_dtype="int8" under bf16 math (4 heads of 64, 2 kv heads: one per rank): each rank's cache holds its
    kv head's int8 rows, and the tokens are the one-rank pipeline's."""
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **dict(TINY, hidden_size=256, intermediate_size=256)),
                           tmp_path, tokenizer_dir)
    prompts = prompts_for(VOCAB)
    kw = dict(dtype="bfloat16", kv_cache_dtype="int8", inference_engine_config={"state_manager": {"kv_block_size": 16}})
    outs = {}
    for tp in (1, 2):
        pipe = mii.pipeline(str(path), tensor_parallel=tp, **kw, **({"torch_dist_port": free_port()} if tp > 1 else {}))
        try:
            assert pipe.engine_plan.kv_dtype == "int8" and pipe.engine.runner.kv_cache.shape[-3:] == (2 // tp, 16, 68)
            outs[tp] = [o.token_ids for o in pipe(prompts, max_new_tokens=NEW, do_sample=False, ignore_eos=True)]
        finally:
            pipe.destroy()
    assert outs[2] == outs[1]


def param_bytes(model) -> dict[str, int]:
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name, kv_replicated", [("llama_gqa", False), ("falcon_multi_query", True)])
def test_each_rank_holds_only_its_shard(tmp_path, tokenizer_dir, name, kv_replicated):
    cfg, post_init = family(name)
    source = resolve_source(str(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=post_init)))
    full = param_bytes(load_model(source, torch.float32, torch.device("cpu")).model)
    try:
        ranks = []
        for r in range(2):
            set_tp(r, 2)
            ranks.append(param_bytes(load_model(source, torch.float32, torch.device("cpu")).model))
    finally:
        set_tp(0, 1)
    replicated = sum(b for n, b in full.items() if "norm" in n)  # norms: the only replicated parameters
    kv = 0
    if kv_replicated:  # one KV head, so each rank keeps the k and v rows whole: 2 * head_dim rows of qkv
        d = cfg.hidden_size // cfg.num_attention_heads
        kv = sum(2 * d * cfg.hidden_size * 4 for n in full if n.endswith("qkv_proj.weight"))
    for r, shard in enumerate(ranks):
        assert shard.keys() == full.keys()
        total, sharded = sum(shard.values()), sum(full.values()) - replicated
        assert total == replicated + (sharded - kv) // 2 + kv, f"rank {r}: {total} bytes"
    print(f"{name}: TP=1 {sum(full.values())} parameter bytes, TP=2 {sum(ranks[0].values())} per rank")


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_dir):
    cfg, _ = family("llama_gqa")
    return tiny_checkpoint(cfg, tmp_path_factory.mktemp("llama-tp"), tokenizer_dir)


@pytest.mark.parametrize("when", ["idle", "during a call"])
def test_a_rank_that_dies_is_a_clear_error(llama, when):
    pipe = mii.pipeline(str(llama), dtype="float32", inference_engine_config=KV, tensor_parallel=2,
                        torch_dist_port=free_port())
    try:
        worker = pipe.tp_group.workers[0]
        if when == "idle":  # the layers' rank is process-wide: no second pipeline next to a tensor-parallel one
            with pytest.raises(mii.errors.ValidationError, match="destroy"):
                mii.pipeline(str(llama), dtype="float32", inference_engine_config=KV)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {worker.pid}\) exited with code -9"):
            if when == "idle":
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait()
                pipe([[5, 6, 7]] * 4, max_new_tokens=100, do_sample=False, ignore_eos=True)
            else:
                for i, _ in enumerate(pipe.stream([[5, 6, 7]] * 4, max_new_tokens=100, ignore_eos=True)):
                    if i == 2:  # mid-generation: rank 0 is in a step or about to send one
                        os.kill(worker.pid, signal.SIGKILL)
        assert time.monotonic() - start < 30
        with pytest.raises(TensorParallelError):  # the group stays down
            pipe("again", max_new_tokens=2)
    finally:
        pipe.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        pipe("after", max_new_tokens=2)


def test_heads_that_do_not_divide_by_the_ranks(llama):
    with pytest.raises(ModelLoadError, match=r"attention heads \(4\) does not divide by tensor_parallel=3"):
        mii.pipeline(str(llama), dtype="float32", inference_engine_config=KV, tensor_parallel=3,
                     torch_dist_port=free_port())


def test_busy_rendezvous_port_is_a_clear_error(llama):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(mii.errors.ValidationError, match="torch_dist_port"):
            mii.pipeline(str(llama), dtype="float32", inference_engine_config=KV, tensor_parallel=2,
                         torch_dist_port=s.getsockname()[1])


SCRIPT = """
import json, sys
import mii
model, out = sys.argv[1], sys.argv[2]
pipe = mii.pipeline(model, dtype="float32", all_rank_output=True, inference_engine_config=%r)
first = pipe(%r, max_new_tokens=%d, do_sample=False, ignore_eos=True)
pipe.all_rank_output = False
second = pipe("Seattle is", max_new_tokens=3)
with open(f"{out}/rank{pipe.tp_group.rank}.json", "w") as f:
    json.dump({"first": [r.token_ids for r in first], "second": len(second), "tp": pipe.engine_plan.tensor_parallel}, f)
pipe.destroy()
"""


def test_under_torchrun(llama, tmp_path):
    prompts = prompts_for(VOCAB, lengths=(5, 40))
    script = tmp_path / "script.py"
    script.write_text(SCRIPT % (KV, prompts, NEW))
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(script), str(llama), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    want = [r.token_ids for r in run(llama, prompts)]
    assert ranks[0]["first"] == ranks[1]["first"] == want  # all_rank_output: every rank gets rank 0's results
    assert (ranks[0]["second"], ranks[1]["second"]) == (1, 0)  # otherwise only rank 0 does
    assert ranks[0]["tp"] == ranks[1]["tp"] == 2  # tensor_parallel defaults to WORLD_SIZE (MII)


DIE = """
import os, sys
import mii
pipe = mii.pipeline(sys.argv[1], dtype="float32", tensor_parallel=2, torch_dist_port=int(sys.argv[2]),
                    inference_engine_config=%r)
print(pipe.tp_group.workers[0].pid, flush=True)
os.kill(os.getpid(), 9)
"""


def test_workers_exit_when_rank_0_is_killed(llama, tmp_path):
    from tests.parallel.conftest import wait_gone

    script = tmp_path / "die.py"
    script.write_text(DIE % (KV,))
    proc = subprocess.run([sys.executable, str(script), str(llama), str(free_port())], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == -9, proc.stderr[-2000:]
    worker = int(proc.stdout.split()[0])
    left = wait_gone([worker], timeout=15)
    if left:
        os.kill(worker, signal.SIGKILL)
    assert not left, "a worker outlived its rank 0"
