"""Changing the number of replicas of a live deployment (one host), under load: 1 -> 2 with `client.scale`, 2 -> 1
with `mii scale`, and not one request fails or changes its tokens; out-of-range requests are refused."""
import subprocess
import sys
import time

import httpx
import pytest

import mii
from mii.errors import ValidationError
from tests.serving.conftest import KV, free_port, stop, under_load, unique_name, wait_until

PROMPTS = ["one two three", "the cat sat on", "a b c d e f", "hello world"]
GREEDY = {"max_new_tokens": 12, "do_sample": False, "ignore_eos": True}


@pytest.fixture(scope="module")
def single(tiny_model):
    client = mii.serve(tiny_model, deployment_name=unique_name("test-scale"), port_number=free_port(), replica_num=1,
                       num_threads=1, enable_restful_api=True, restful_api_port=free_port(), dtype="float32",
                       inference_engine_config=KV)
    yield client
    stop(client)


def _health(client) -> dict:
    return httpx.get(f"http://127.0.0.1:{client.record['http_port']}/health", timeout=10).json()


def test_scale_under_load(single):
    want = [r.token_ids for r in single.generate(PROMPTS, **GREEDY)]
    with under_load(single, PROMPTS, GREEDY, threads=2) as results:
        assert single.scale(2) == 2
        health = _health(single)
        assert (health["status"], health["replicas"], health["configured"]) == ("ok", 2, 2)
        assert health["nodes"] == {"local": [0, 1]}
        # both replicas serve: the new one takes part of the load (its first request, however slow the machine)
        busy = wait_until(lambda: (b := [s.requests_total for s in single.engine_stats()])[1] > 0 and b, timeout=60)
        out = subprocess.run([sys.executable, "-m", "mii.cli", "scale", single.deployment_name, "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "1 replica(s), 1 serving" in out.stdout
        time.sleep(1.0)  # requests keep going to the one left
    assert busy, single.engine_stats()  # the new replica took part of the load
    failures = [r for _, r in results if isinstance(r, Exception)]
    assert not failures, failures[:3]
    assert len(results) > 8 and all(ids == want[i] for i, ids in results)
    health = _health(single)
    assert (health["replicas"], health["configured"], health["nodes"]) == (1, 1, {"local": [0]})
    assert [r["index"] for r in mii.client(single.deployment_name).record["replicas"]] == [0]


@pytest.mark.parametrize("bad", [0, -1, 10_000, "2", 1.5, True])
def test_bad_replica_counts_are_refused(single, bad):
    with pytest.raises(ValidationError, match="replicas"):
        single.scale(bad)
    assert _health(single)["replicas"] == 1
