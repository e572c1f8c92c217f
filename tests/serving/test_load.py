"""Under load and at the edges of admission, on real processes and sockets:

- the API key;
- a burst into an idle deployment up to its queue limit is accepted; past it a request is refused at once (HTTP 429
  with Retry-After, gRPC RESOURCE_EXHAUSTED);
- a load of a few hundred requests from tens of concurrent clients (OpenAI and gRPC, streamed and not), about a
  third cancelled at random points (stream closed, client gone, deadline): every other request gets exactly its
  tokens (the greedy reference), and afterwards no sequence and no KV block is left (read from /metrics);
- terminate under a stream: new requests refused while it drains, the stream ended with a clear error once the
  drain timeout passed, no process and no record left.

The `limited` deployment's tests run in file order (the last one stops it).
"""
import asyncio
import random
import threading
import time

import grpc
import httpx
import openai
import pytest

import mii
from mii.errors import DeploymentNotFoundError, ServerOverloadedError
from mii.serving import records
from mii.serving.protocol import from_multi_reply, make_request, pb2_grpc
from tests.serving.conftest import (LONG_KV, LONG_TOKENS, deployment_pids, free_port, metric, stop, unique_name,
                                    wait_until)

KEY = "sekret"
DRAIN_S = 1.0


@pytest.fixture(scope="module")
def limited(long_model):
    """Two replicas that each run one sequence at a time and let one more wait; an API key on HTTP; a short
    drain on terminate."""
    ie = {"state_manager": {**LONG_KV["state_manager"], "max_ragged_sequence_count": 1}}
    client = mii.serve(long_model, deployment_name=unique_name("test-limited"), port_number=free_port(),
                       replica_num=2, enable_restful_api=True, restful_api_port=free_port(), dtype="float32",
                       max_waiting_requests=1, api_key=KEY, drain_timeout=DRAIN_S, inference_engine_config=ie)
    yield client
    stop(client)


@pytest.fixture(scope="module")
def url(limited):
    return f"http://127.0.0.1:{limited.record['http_port']}"


AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
LONG = {"max_new_tokens": LONG_TOKENS, "ignore_eos": True}  # 100,000 engine steps: far longer than any test waits


def test_api_key(url, long_model):
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    r = httpx.get(f"{url}/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert oai.completions.create(model=long_model, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_burst_up_to_the_limit_is_accepted(limited):
    """4 requests at once into the idle deployment: each replica starts one and queues one (its limit). Counting
    what arrived since the last step, as before, refused the second of each replica."""
    async def burst():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            stub = pb2_grpc.ModelResponseStub(channel)
            req = make_request(["burst"], {"max_new_tokens": 8, "ignore_eos": True})
            return await asyncio.gather(*(stub.GeneratorReply(req, timeout=120, metadata=GRPC_AUTH)
                                          for _ in range(4)),
                                        return_exceptions=True)

    replies = asyncio.run(burst())
    assert [from_multi_reply(r)[0].generated_length if not isinstance(r, Exception) else r for r in replies] == [8] * 4


def test_full_queue_is_refused_at_once(limited, url):
    stub = pb2_grpc.ModelResponseStub(grpc.insecure_channel(limited.address))
    long = make_request(["go on"], LONG)
    calls = []
    try:
        for _ in range(2):  # one running sequence per replica (least outstanding sends the second elsewhere)
            calls.append(stub.GeneratorReplyStream(long, timeout=120, metadata=GRPC_AUTH))
            next(calls[-1])
        for _ in range(2):  # one waiting sequence per replica
            calls.append(stub.GeneratorReplyStream(long, timeout=120, metadata=GRPC_AUTH))
        assert wait_until(lambda: sum(s.num_waiting for s in limited.engine_stats()) == 2, timeout=10)
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH, timeout=30)
        assert r.status_code == 429 and "max_waiting_requests=1" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        with pytest.raises(grpc.RpcError) as e:
            stub.GeneratorReply(make_request(["x"], {"max_new_tokens": 2}), timeout=30, metadata=GRPC_AUTH)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(ServerOverloadedError):
            limited.generate("x", max_new_tokens=2)
        assert time.monotonic() - t < 5
        assert sum(s.num_waiting for s in limited.engine_stats()) == 2  # the queue was full all along
    finally:
        for c in calls:
            c.cancel()
    assert wait_until(lambda: all(s.kv_blocks_used == 0 and s.num_waiting == 0 for s in limited.engine_stats()))
    assert limited.generate("x", max_new_tokens=2)[0].generated_length == 2
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    assert metric(text, "mii_request_errors_total", kind="overloaded") >= 3


def test_terminate_drains_then_leaves_no_process(limited, url):
    """terminate_server under a stream: /health and new requests answer 503 while it drains, the stream ends with
    an error naming the drain timeout once it passed, and nothing of the deployment is left."""
    pids = deployment_pids(limited)
    stub = pb2_grpc.ModelResponseStub(grpc.insecure_channel(limited.address))
    call = stub.GeneratorReplyStream(make_request(["go on"], LONG), timeout=120, metadata=GRPC_AUTH)
    next(call)
    t = time.monotonic()
    stopper = threading.Thread(target=limited.terminate_server)
    stopper.start()
    try:
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, timeout=5)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH, timeout=10)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"drain_timeout={DRAIN_S:g} s" in e.value.details()
        assert time.monotonic() - t >= DRAIN_S * 0.9
    finally:
        stopper.join(60)
    assert not any(records.pid_alive(p) for p in pids)
    with pytest.raises(DeploymentNotFoundError):
        mii.client(limited.deployment_name)


# --- load with cancellations (the shared two-replica deployment) ---------------------------------------------------

PROMPTS = ["The quick brown fox", "Once upon a time", "DeepSpeed is", "1 2 3 4", "Hello there"]
LENGTHS = (3, 6, 10)
CLIENTS, PER_CLIENT = 32, 10
CANCELLED_LEN = 1000  # tokens of the requests that are cancelled: the tiny model's context (1024) less the prompt


def test_load_with_cancellations(deployment, base_url):
    """320 requests from 32 concurrent clients, a third cancelled; the others match the greedy reference."""
    want = {}  # (prompt, max_tokens) -> (text, token ids), computed on the idle deployment
    for p in PROMPTS:
        for n in LENGTHS:
            [r] = deployment.generate(p, max_new_tokens=n, do_sample=False, ignore_eos=True)
            want[p, n] = (r.generated_text, r.token_ids)
    model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(0)
    kinds = ["openai", "openai_stream", "grpc", "grpc_stream"]
    cancels = ["stream_closed", "client_gone", "deadline"]
    plan = [(rng.choice(PROMPTS), rng.choice(LENGTHS), rng.choice(kinds),
             rng.choice(cancels) if rng.random() < 1 / 3 else None, rng.random()) for _ in range(CLIENTS * PER_CLIENT)]
    results = []

    async def one(oai, http, stub, prompt, n, kind, cancel, at):
        grpc_kwargs = {"max_new_tokens": n, "do_sample": False, "ignore_eos": True}
        oai_kwargs = dict(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
        long = make_request([prompt], {**grpc_kwargs, "max_new_tokens": CANCELLED_LEN})
        if cancel == "stream_closed":  # a long stream closed after a few chunks
            if kind.startswith("openai"):
                stream = await oai.completions.create(**{**oai_kwargs, "max_tokens": CANCELLED_LEN}, stream=True)
                async for i, _ in _enumerate(stream):
                    if i >= int(at * 5):
                        break
                await stream.close()
            else:
                call = stub.GeneratorReplyStream(long)
                async for i, _ in _enumerate(call):
                    if i >= int(at * 5):
                        break
                call.cancel()
            return "cancelled"
        if cancel == "client_gone":  # the client drops the connection mid-request (1,000 tokens take longer)
            body = {"prompt": prompt, "max_tokens": CANCELLED_LEN, "temperature": 0, "ignore_eos": True,
                    "stream": kind.endswith("stream")}
            gone = (http.post(f"{base_url}/v1/completions", json=body) if kind.startswith("openai")
                    else stub.GeneratorReply(long))
            # cancelled within 0.15 s: a fast machine finished the tiny model's 400 tokens in 0.1 s (CI, 2026-12-07)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(gone, 0.02 + at * 0.13)
            return "cancelled"
        if cancel == "deadline":  # a gRPC deadline that passes mid-request
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GeneratorReply(long, timeout=0.02 + at * 0.13)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            return "cancelled"
        text, ids = want[prompt, n]
        if kind == "openai":
            r = await oai.completions.create(**oai_kwargs)
            assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, "length")
        elif kind == "openai_stream":
            stream = await oai.completions.create(**oai_kwargs, stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text
            assert chunks[-1].usage.completion_tokens == n
        elif kind == "grpc":
            [r] = from_multi_reply(await stub.GeneratorReply(make_request([prompt], grpc_kwargs), timeout=300))
            assert (r.generated_text, r.token_ids, r.generated_length) == (text, ids, n)
        else:
            got = [from_multi_reply(c)[0] async for c in stub.GeneratorReplyStream(make_request([prompt], grpc_kwargs),
                                                                                    timeout=300)]
            assert "".join(r.generated_text for r in got) == text
            assert [t for r in got for t in r.token_ids] == ids
        return "done"

    async def client(i, oai, http, stub):
        for job in plan[i::CLIENTS]:
            results.append(await one(oai, http, stub, *job))

    async def main():
        async with httpx.AsyncClient() as http, grpc.aio.insecure_channel(deployment.address) as channel:
            oai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
            stub = pb2_grpc.ModelResponseStub(channel)
            t = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*(client(i, oai, http, stub) for i in range(CLIENTS))), 240)
            return time.monotonic() - t

    elapsed = asyncio.run(main())
    done, cancelled = results.count("done"), results.count("cancelled")
    print(f"\nload: {len(results)} requests ({done} complete, {cancelled} cancelled) from {CLIENTS} concurrent "
          f"clients in {elapsed:.1f} s: {len(results) / elapsed:.1f} requests/s")
    assert len(results) == CLIENTS * PER_CLIENT and 0.2 < cancelled / len(results) < 0.45

    def clean():
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        return all(metric(text, g) == 0 for g in ("mii_num_requests_running", "mii_num_requests_waiting",
                                                 "mii_kv_cache_blocks_used")) and text
    text = wait_until(clean, timeout=20)
    assert text, httpx.get(f"{base_url}/metrics", timeout=10).text
    assert metric(text, "mii_kv_cache_blocks_total") == 2 * 512
    stats = deployment.engine_stats()
    assert all(s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0 for s in stats)
    # the threads each replica's steps take now (its pace's count; the plan's, one each here, unless a busy CPU took
    # one away) and how often its pace dropped one
    assert all(s.threads >= 1 for s in stats) and metric(text, "mii_engine_threads") == sum(s.threads for s in stats)
    assert metric(text, "mii_engine_thread_drops_total") == sum(s.thread_drops for s in stats)


async def _enumerate(aiter):
    i = 0
    async for x in aiter:
        yield i, x
        i += 1
