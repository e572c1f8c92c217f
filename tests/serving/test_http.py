"""MII's REST gateway, health, tokenize and Prometheus metrics with httpx; a client leaving mid-stream."""
import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.serving.conftest import wait_until


def test_rest_gateway(base_url, deployment):
    url = f"{base_url}/mii/{deployment.deployment_name}"
    r = httpx.post(url, json={"prompts": "DeepSpeed is", "max_new_tokens": 4, "do_sample": False}, timeout=60)
    assert r.status_code == 200
    [one] = r.json()
    assert one["generated_length"] == 4 and one["finish_reason"] == "length" and one["prompt_length"] > 0
    r = httpx.post(url, json={"prompts": ["a", "b", "c"], "max_new_tokens": [1, 2, 3]}, timeout=60)
    assert [x["generated_length"] for x in r.json()] == [1, 2, 3]
    r = httpx.post(url, json={"prompts": ["a"], "max_new_tokenz": 3}, timeout=60)
    assert r.status_code == 400 and "max_new_tokenz" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/mii/other-deployment", json={"prompts": ["a"]}, timeout=60)
    assert r.status_code == 404


def test_health_and_tokenize(base_url):
    r = httpx.get(f"{base_url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["replicas"] == 2
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": "hello world"}, timeout=10)
    assert r.json()["count"] == len(r.json()["tokens"]) == 2 and r.json()["max_model_len"] == 1024
    r = httpx.post(f"{base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert r.json()["count"] > 3


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_both_replicas_serve_and_metrics(base_url, deployment):
    def one(i):
        return httpx.post(f"{base_url}/v1/completions", timeout=120,
                          json={"prompt": f"request {i}", "max_tokens": 24, "ignore_eos": True}).status_code

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [200] * 6
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for replica in ("0", "1"):
        assert _metric(text, "mii_requests_total", replica=replica) > 0, text
        assert _metric(text, "mii_generation_tokens_total", replica=replica) > 0
        assert _metric(text, "mii_replica_up", replica=replica) == 1
        for gauge in ("mii_num_requests_running", "mii_num_requests_waiting", "mii_kv_cache_usage_perc"):
            assert re.search(rf'^{gauge}{{replica="{replica}"}} ', text, re.M), gauge
    assert _metric(text, "mii_prompt_tokens_total") > 0
    for hist in ("mii_time_to_first_token_seconds", "mii_inter_token_latency_seconds",
                 "mii_e2e_request_latency_seconds"):
        assert _metric(text, f"{hist}_count") > 0, hist


def test_client_leaving_mid_stream_aborts_its_sequence(base_url, deployment):
    body = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    before = sum(s.generation_tokens_total for s in deployment.engine_stats())
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert sum(s.kv_blocks_used for s in deployment.engine_stats()) > 0
    # the connection is closed here, long before 900 tokens
    freed = wait_until(lambda: all(s.kv_blocks_used == 0 and s.num_running == 0 for s in deployment.engine_stats()),
                       timeout=15)
    assert freed, deployment.engine_stats()
    assert sum(s.generation_tokens_total for s in deployment.engine_stats()) - before < 900  # aborted, not finished


def test_client_leaving_a_blocking_request_aborts_it(base_url, deployment):
    before = sum(s.generation_tokens_total for s in deployment.engine_stats())
    try:
        httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 900, "ignore_eos": True},
                   timeout=1.0)
    except httpx.TimeoutException:
        pass
    freed = wait_until(lambda: all(s.kv_blocks_used == 0 and s.num_running == 0 for s in deployment.engine_stats()),
                       timeout=15)
    assert freed and sum(s.generation_tokens_total for s in deployment.engine_stats()) - before < 900


def test_http_connections_send_without_delay():
    """The gateway's accepted connections have TCP_NODELAY set: without it, a keep-alive connection's first SSE
    chunk waits for the client's delayed ACK (asyncio sets it only on sockets made with IPPROTO_TCP)."""
    import asyncio
    import socket

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from mii.serving.deployment import http_listener, http_server

    app = FastAPI()

    @app.get("/stream")
    async def stream():
        return StreamingResponse(iter(["data: a\n\n", "data: b\n\n"]), media_type="text/event-stream")

    async def main() -> list[int]:
        sock = http_listener("127.0.0.1", 0)
        server = http_server(app)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=10) as client:
                for _ in range(2):  # one keep-alive connection, two responses
                    async with client.stream("GET", "/stream") as r:
                        assert [line async for line in r.aiter_lines() if line] == ["data: a", "data: b"]
                connections = list(server.server_state.connections)
                return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                        for c in connections]
        finally:
            server.should_exit = True
            await task

    nodelay = asyncio.run(main())
    assert len(nodelay) == 1 and nodelay[0] != 0, nodelay
