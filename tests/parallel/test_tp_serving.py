"""`mii.serve(..., tensor_parallel=2, replica_num=2)`: each replica is a group of 2 processes (its engine process is
rank 0 and starts rank 1), so the deployment is 1 front + 2 x 2 engine processes, with the cores divided between
the 4 ranks. Requests are served with the TP=1 greedy output; a rank that dies takes its replica out of rotation
(the other keeps serving) and the deployment starts the replica again as a whole group (new rank 0, new rank 1);
terminating stops every process, ranks included."""
from __future__ import annotations

import os
import signal

from transformers import LlamaConfig

import mii
from tests.parallel.conftest import KV, children, free_port, wait_gone
from tests.reference import TINY, prompts_for, tiny_checkpoint
from tests.serving.conftest import stop, unique_name, wait_until

VOCAB = 49152


def test_tp2_replicas2_serve_and_survive_a_dead_rank(tmp_path, tokenizer_dir):
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path, tokenizer_dir)
    prompts = prompts_for(VOCAB, lengths=(5, 37, 90, 12))
    pipe = mii.pipeline(str(path), dtype="float32", inference_engine_config=KV)
    want = [r.token_ids for r in pipe(prompts, max_new_tokens=16, do_sample=False, ignore_eos=True)]
    pipe.destroy()

    client = mii.serve(str(path), deployment_name=unique_name("test-tp"), port_number=free_port(),
                       tensor_parallel=2, replica_num=2, torch_dist_port=free_port(), dtype="float32",
                       inference_engine_config=KV)
    replicas = [r["pid"] for r in client.record["replicas"]]
    ranks = {pid: children(pid) for pid in replicas}
    try:
        assert len(replicas) == 2 and all(len(ranks[p]) == 1 for p in replicas), ranks  # rank 1 of each replica
        for _ in range(2):  # least-outstanding routing spreads the calls over both replicas
            out = client.generate(prompts, max_new_tokens=16, do_sample=False, ignore_eos=True)
            assert [r.token_ids for r in out] == want
        # a dead rank takes its replica down (not a hang), and the deployment keeps serving on the other
        (rank1,) = ranks[replicas[0]]
        os.kill(rank1, signal.SIGKILL)
        assert not wait_gone([replicas[0]], timeout=20), "the replica whose rank died is still running"
        for _ in range(3):
            out = client.generate(prompts[:2], max_new_tokens=16, do_sample=False, ignore_eos=True)
            assert [r.token_ids for r in out] == want[:2]
        # ... and is started again as a whole group: a new rank 0 with a new rank 1, serving the same output
        assert wait_until(lambda: all(s.alive for s in client.engine_stats()), timeout=120), client.engine_stats()
        client.record = mii.client(client.deployment_name).record
        restarted = next(r["pid"] for r in client.record["replicas"] if r["index"] == 0)
        ranks[restarted] = children(restarted)
        assert restarted != replicas[0] and len(ranks[restarted]) == 1 and rank1 not in ranks[restarted]
        replicas.append(restarted)
        for _ in range(2):  # both replicas again
            out = client.generate(prompts, max_new_tokens=16, do_sample=False, ignore_eos=True)
            assert [r.token_ids for r in out] == want
        assert all(s.requests_total > 0 for s in client.engine_stats())
    finally:
        stop(client)
        everything = set(replicas) | {p for s in ranks.values() for p in s}
        left = wait_gone(everything)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {sorted(left)}"
