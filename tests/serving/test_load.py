"""Under load and failure: API key, a full queue refused at once, a dead replica out of rotation, and a
terminate that leaves no process behind. Runs in file order on its own deployment (the last test stops it)."""
import os
import signal
import time

import grpc
import httpx
import openai
import pytest

import mii
from mii.errors import DeploymentNotFoundError, ServerOverloadedError
from mii.serving import records
from mii.serving.protocol import make_request, pb2_grpc
from tests.serving.conftest import KV, deployment_pids, free_port, stop, unique_name, wait_until

KEY = "sekret"


@pytest.fixture(scope="module")
def limited(tiny_model):
    """Two replicas that each run one sequence at a time and let one more wait; an API key on HTTP."""
    ie = {"state_manager": {**KV["state_manager"], "max_ragged_sequence_count": 1}}
    client = mii.serve(tiny_model, deployment_name=unique_name("test-limited"), port_number=free_port(),
                       replica_num=2, enable_restful_api=True, restful_api_port=free_port(), dtype="float32",
                       max_waiting_requests=1, api_key=KEY, inference_engine_config=ie)
    yield client
    stop(client)


@pytest.fixture(scope="module")
def url(limited):
    return f"http://127.0.0.1:{limited.record['http_port']}"


def test_api_key_on_every_route_but_health(url, tiny_model):
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(f"{url}{path}", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert oai.completions.create(model=tiny_model, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_full_queue_is_refused_at_once(limited, url):
    stub = pb2_grpc.ModelResponseStub(grpc.insecure_channel(limited.address))
    long = make_request(["go on"], {"max_new_tokens": 900, "ignore_eos": True})
    calls = []
    try:
        for _ in range(2):  # one running sequence per replica (least outstanding sends the second elsewhere)
            calls.append(stub.GeneratorReplyStream(long, timeout=120))
            next(calls[-1])
        for _ in range(2):  # one waiting sequence per replica
            calls.append(stub.GeneratorReplyStream(long, timeout=120))
        assert wait_until(lambda: sum(s.num_waiting for s in limited.engine_stats()) == 2, timeout=10)
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 429 and "max_waiting_requests=1" in r.json()["error"]["message"]
        with pytest.raises(ServerOverloadedError):
            limited.generate("x", max_new_tokens=2)
        assert time.monotonic() - t < 5
    finally:
        for c in calls:
            c.cancel()
    assert wait_until(lambda: all(s.kv_blocks_used == 0 and s.num_waiting == 0 for s in limited.engine_stats()))
    assert limited.generate("x", max_new_tokens=2)[0].generated_length == 2


def test_dead_replica_leaves_rotation(limited, url):
    victim = limited.record["replicas"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    outs = [limited.generate(f"after {i}", max_new_tokens=3) for i in range(4)]  # none fails
    assert all(o[0].generated_length == 3 for o in outs)
    stats = {s.replica: s for s in limited.engine_stats()}
    assert not stats[victim["index"]].alive and stats[1 - victim["index"]].alive
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["replicas"] == 1
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    assert f'mii_replica_up{{replica="{victim["index"]}"}} 0.0' in metrics


def test_terminate_leaves_no_process(limited):
    pids = deployment_pids(limited)
    assert records.pid_alive(pids[0])
    limited.terminate_server()
    assert not any(records.pid_alive(p) for p in pids)
    with pytest.raises(DeploymentNotFoundError):
        mii.client(limited.deployment_name)
