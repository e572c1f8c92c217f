"""Tensor parallelism across machines with torchrun's multi-node rendezvous, on one host: two torchrun agents, each
its own process as on two machines (`--nnodes 2 --nproc-per-node 1`, c10d rendezvous on loopback), run a script
that calls `mii.pipeline`. torchrun numbers the nodes; each rank sees LOCAL_RANK=0 and LOCAL_WORLD_SIZE=1, so it
plans every core of its "machine". The two-rank group's greedy output equals one rank's."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import LlamaConfig

import mii
from tests.parallel.conftest import KV, children, free_port, wait_gone
from tests.reference import TINY, prompts_for, tiny_checkpoint

VOCAB = 49152
NEW = 16
REPO = Path(__file__).resolve().parents[2]
AGENT_TIMEOUT_S = 300  # a bound on a hang: two agents, 4 ranks on 2 cores, a slow hour can take minutes
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

SCRIPT = """
import json, os, sys
import mii
pipe = mii.pipeline(sys.argv[1], dtype="float32", inference_engine_config=%r)
out = pipe(%r, max_new_tokens=%d, do_sample=False, ignore_eos=True)
print(json.dumps({"rank": pipe.tp_group.rank, "tp": pipe.engine_plan.tensor_parallel,
                  "threads": pipe.engine_plan.num_threads, "cores": len(os.sched_getaffinity(0)),
                  "env": {k: os.environ.get(k) for k in %r}, "ids": [r.token_ids for r in out]}), flush=True)
pipe.destroy()
"""


def descendants(pid: int) -> set[int]:
    found = children(pid)
    for c in list(found):
        found |= descendants(c)
    return found


def stop(agents: list[subprocess.Popen]) -> None:
    """SIGTERM the agents (torchrun then stops its ranks, which run in their own sessions), SIGKILL what is left."""
    pids = set().union(*(descendants(a.pid) for a in agents))
    for a in agents:
        if a.poll() is None:
            a.send_signal(signal.SIGTERM)
    for pid in wait_gone(pids | {a.pid for a in agents}, timeout=10):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for a in agents:
        a.wait()


def run_agents(script: Path, model: Path, logs: Path) -> list[subprocess.Popen]:
    """Run two torchrun agents that meet at one rendezvous, to their end; their output goes to `logs`/agentI.*"""
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "mii-test", str(script), str(model)]
    agents = []
    for i in range(2):  # files, not pipes: nothing blocks on a full pipe, and a hung run still leaves its output
        with open(logs / f"agent{i}.out", "w") as out, open(logs / f"agent{i}.err", "w") as err:
            agents.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err))
    deadline, timed_out = time.monotonic() + AGENT_TIMEOUT_S, False
    try:
        for a in agents:
            a.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        stop(agents)
    if timed_out:
        pytest.fail(f"the torchrun agents did not finish within {AGENT_TIMEOUT_S} s\n{report(logs, agents)}")
    return agents


def report(logs: Path, agents: list[subprocess.Popen]) -> str:
    return "\n".join(f"--- agent {i} (exit {a.returncode}) stdout:\n{(logs / f'agent{i}.out').read_text()[-2000:]}"
                     f"\n--- agent {i} stderr:\n{(logs / f'agent{i}.err').read_text()[-4000:]}"
                     for i, a in enumerate(agents))


def test_two_torchrun_nodes_equal_one_rank(tmp_path, tokenizer_dir):
    model = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    prompts = prompts_for(VOCAB, lengths=(5, 37))
    script = tmp_path / "script.py"
    script.write_text(SCRIPT % (KV, prompts, NEW, ENV_KEYS))

    agents = run_agents(script, model, tmp_path)
    logs = report(tmp_path, agents)
    assert all(a.returncode == 0 for a in agents), logs
    lines = [[json.loads(x) for x in (tmp_path / f"agent{i}.out").read_text().splitlines() if x.startswith("{")]
             for i in range(2)]
    assert all(len(x) == 1 for x in lines), logs
    by_rank = {x[0]["rank"]: x[0] for x in lines}
    assert sorted(by_rank) == [0, 1], logs

    for r, got in by_rank.items():
        env = got["env"]
        assert (env["RANK"], env["GROUP_RANK"], env["WORLD_SIZE"]) == (str(r), str(r), "2"), env
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1"), env  # one rank per "machine"
        assert env["MASTER_ADDR"] and env["MASTER_PORT"], env  # set by the rendezvous, not by mii
        assert got["tp"] == 2  # tensor_parallel defaults to WORLD_SIZE
        assert got["threads"] == got["cores"], got  # LOCAL_WORLD_SIZE=1: each rank plans its machine's cores
    assert by_rank[1]["ids"] == []  # only rank 0's call returns results

    pipe = mii.pipeline(str(model), dtype="float32", inference_engine_config=KV)
    try:
        want = [r.token_ids for r in pipe(prompts, max_new_tokens=NEW, do_sample=False, ignore_eos=True)]
    finally:
        pipe.destroy()
    assert by_rank[0]["ids"] == want, logs
