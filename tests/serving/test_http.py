"""MII's REST gateway, health, tokenize and Prometheus metrics with httpx; a client leaving mid-stream."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.serving.conftest import LONG_TOKENS, generated, metric, wait_until


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


def test_both_replicas_serve_and_metrics(base_url, deployment):
    def one(i):
        return httpx.post(f"{base_url}/v1/completions", timeout=120,
                          json={"prompt": f"request {i}", "max_tokens": 24, "ignore_eos": True}).status_code

    hists = ("mii_time_to_first_token_seconds", "mii_inter_token_latency_seconds", "mii_e2e_request_latency_seconds")
    before = httpx.get(f"{base_url}/metrics", timeout=30).text
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [200] * 6
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for replica in ("0", "1"):
        assert metric(text, "mii_requests_total", replica=replica) > 0, text
        assert metric(text, "mii_generation_tokens_total", replica=replica) > 0
        assert metric(text, "mii_replica_up", replica=replica) == 1
        for gauge in ("mii_num_requests_running", "mii_num_requests_waiting", "mii_kv_cache_usage_perc"):
            assert re.search(rf'^{gauge}{{replica="{replica}"}} ', text, re.M), gauge
    assert metric(text, "mii_prompt_tokens_total") > 0

    def grew(name):
        return metric(text, name) - metric(before, name)

    # not streamed: each request one unary call, its latencies from the replica's token times
    assert grew("mii_generation_tokens_total") == 6 * 24
    ttft, itl, e2e = (grew(f"{h}_count") for h in hists)
    assert (ttft, itl, e2e) == (6, 6 * 23, 6)
    ttft, itl, e2e = (grew(f"{h}_sum") for h in hists)
    assert 0 < ttft < e2e and 0 < itl < e2e, (ttft, itl, e2e)


def _freed(client) -> bool:
    return all(s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0 for s in client.engine_stats())


def test_client_leaving_mid_stream_aborts_its_sequence(long_deployment):
    url = f"http://127.0.0.1:{long_deployment.record['http_port']}"
    body = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": LONG_TOKENS,
            "ignore_eos": True, "stream": True}
    before = generated(long_deployment)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert sum(s.kv_blocks_used for s in long_deployment.engine_stats()) > 0
    # the connection is closed here, long before the end
    assert wait_until(lambda: _freed(long_deployment), timeout=15), long_deployment.engine_stats()
    assert 0 < generated(long_deployment) - before < LONG_TOKENS  # aborted, not finished


def test_client_leaving_a_blocking_request_aborts_it(long_deployment):
    url = f"http://127.0.0.1:{long_deployment.record['http_port']}"
    before = generated(long_deployment)
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": LONG_TOKENS, "ignore_eos": True},
                       timeout=1.0)  # (the warm replica's first step comes well before)
        raise AssertionError(f"answered before the client left: {r.status_code} {r.text[:200]}")
    except httpx.TimeoutException:
        pass
    assert wait_until(lambda: _freed(long_deployment), timeout=15), long_deployment.engine_stats()
    assert 0 < generated(long_deployment) - before < LONG_TOKENS  # it ran, and stopped when the client left


def test_a_client_that_sent_a_byte_after_its_body_is_seen_leaving(long_deployment):
    """A stray CRLF after the body (some clients send one) pauses uvicorn's reading of the connection: the
    gateway's watch for the client's leaving asks again, and the request is still aborted."""
    import socket
    import time

    body = json.dumps({"prompt": "x", "max_tokens": LONG_TOKENS, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    before = generated(long_deployment)
    with socket.create_connection(("127.0.0.1", long_deployment.record["http_port"]), timeout=10) as s:
        s.sendall(head + body)
        assert wait_until(lambda: sum(x.num_running for x in long_deployment.engine_stats()) == 1, timeout=15)
        s.sendall(b"\r\n")  # while the gateway waits for the request's next message
        time.sleep(0.2)
    assert wait_until(lambda: _freed(long_deployment), timeout=15), long_deployment.engine_stats()
    assert 0 < generated(long_deployment) - before < LONG_TOKENS


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


def _error(r: httpx.Response, status: int, param=None) -> dict:
    """The error of an answer in OpenAI's shape, checked: status, exactly the four keys, the field it names."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if param is not None:
        assert error["param"] == param, error
    return error


def test_bad_bodies_get_400_in_openai_shape(base_url, deployment):
    url = f"{base_url}/v1/completions"
    assert "no route" in _error(httpx.get(f"{base_url}/no/such/route", timeout=10), 404)["message"]
    r = httpx.get(url, timeout=10)
    assert "not allowed" in _error(r, 405)["message"] and r.headers["allow"] == "POST"
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        r = httpx.post(url, content=b'{"prompt": "x", "temperature": ' + literal + b"}", timeout=10)
        assert "must be finite" in _error(r, 400)["message"]
    assert "not valid UTF-8" in _error(httpx.post(url, content=b'{"prompt": "\xff"}', timeout=10), 400)["message"]
    r = httpx.post(url, content=b'{"prompt": "a\\ud800"}', timeout=10)
    assert "surrogate" in _error(r, 400)["message"]
    assert _error(httpx.post(url, content=b"[" * 50_000, timeout=10), 400)["code"] == "invalid_json"
    assert _error(httpx.post(url, json=["x"], timeout=10), 400)["message"] == "the body must be a JSON object"
    _error(httpx.post(url, json={"prompt": 5}, timeout=10), 400, "prompt")
    _error(httpx.post(url, json={"prompt": "x", "max_tokens": "3"}, timeout=10), 400, "max_tokens")
    _error(httpx.post(url, json={"prompt": "x", "seed": 2 ** 64}, timeout=10), 400, "seed")
    mii_url = f"{base_url}/mii/{deployment.deployment_name}"
    _error(httpx.post(mii_url, json={"prompts": ["x"], "seed": 2 ** 64}, timeout=10), 400, "seed")
    _error(httpx.post(mii_url, json={"prompts": 5}, timeout=10), 400, "prompts")
    _error(httpx.post(mii_url, json={"prompts": ["x"] * 3000}, timeout=10), 400, "prompts")
    _error(httpx.post(f"{base_url}/detokenize", json={"tokens": [-1]}, timeout=10), 400, "tokens[0]")
    _error(httpx.post(f"{base_url}/detokenize", json={"tokens": [10 ** 9]}, timeout=10), 400, "tokens")
    # a body over the limit (4 MiB by default): refused from its Content-Length, or while read when chunked
    big = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
    assert _error(httpx.post(url, content=big, timeout=30), 413)["code"] == "request_too_large"
    _error(httpx.post(url, content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]), timeout=30), 413)
    r = httpx.post(url, json={"prompt": "still serving", "max_tokens": 2}, timeout=60)  # nothing above hurt it
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_refusals_name_the_field_and_what_is_wrong(base_url, deployment):
    """Inputs a robustness sweep found answered with a 500 or a vague or misplaced message."""
    url, chat = f"{base_url}/v1/completions", f"{base_url}/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    huge = "1" * 5000  # int() refuses 4,300+ digits: an internal error before
    assert "outside the vocabulary" in _error(httpx.post(url, json={"prompt": "x", "logit_bias": {huge: 1}},
                                                         timeout=30), 400, "logit_bias")["message"]
    mii_url = f"{base_url}/mii/{deployment.deployment_name}"
    _error(httpx.post(mii_url, json={"prompts": "x", "logit_bias": {huge: 1}}, timeout=30), 400, "logit_bias")
    # a tagged union's tag is not a field: response_format.json_schema, not response_format.json_schema.json_schema
    _error(httpx.post(url, json={"prompt": "x", "response_format": {"type": "json_schema"}}, timeout=10), 400,
           "response_format.json_schema")
    _error(httpx.post(url, json={"prompt": "x", "response_format": {"type": "json_object", "foo": 1}},
                      timeout=10), 400, "response_format.foo")
    for prompt, words in ((["a", [1]], "not text and a token-id list"), ([[[1]]], "holds integers"),
                          ([1.5], "item 0 is float"), ([True], "item 0 is bool"), ([[1], []], "item 1 is empty"),
                          ([-1], ">= 0, got -1")):
        assert words in _error(httpx.post(url, json={"prompt": prompt}, timeout=10), 400, "prompt")["message"]
    # the engine's own checks name the field as the route calls it
    _error(httpx.post(url, json={"prompt": [2 ** 63]}, timeout=10), 400, "prompt")
    _error(httpx.post(url, json={"prompt": [[1], [2 ** 63]]}, timeout=10), 400, "prompt[1]")
    _error(httpx.post(mii_url, json={"prompts": [10 ** 6]}, timeout=30), 400, "prompts[0]")
    bad_part = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    assert "must be a string (got int)" in _error(httpx.post(chat, json={"messages": bad_part}, timeout=10), 400,
                                                  "messages[0].content[0].text")["message"]
    _error(httpx.post(chat, json={"messages": [{"role": "", "content": "hi"}]}, timeout=10), 400, "messages[0].role")
    # a union names the member whose outer shape fits: the list's item, not the whole field
    _error(httpx.post(url, json={"prompt": "x", "stop": ["a", "b", 5]}, timeout=10), 400, "stop[2]")
    _error(httpx.post(url, json={"prompt": "x", "stop": 5}, timeout=10), 400, "stop")
    # /tokenize refuses what chat refuses, and fields it would ignore
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tok = f"{base_url}/tokenize"
    assert "does not render tools" in _error(httpx.post(tok, json={"messages": hi, "tools": [tool]}, timeout=10),
                                             400, "tools")["message"]
    _error(httpx.post(tok, json={"prompt": "x", "messages": hi}, timeout=10), 400, "prompt")
    _error(httpx.post(tok, json={"prompt": "x", "tools": [tool]}, timeout=10), 400, "tools")


def test_a_client_gone_before_its_body_is_no_error(base_url):
    """A client that closes the connection while sending its body is not an internal error (nor counted as one)."""
    import socket
    from urllib.parse import urlparse

    def internal() -> float:
        return metric(httpx.get(f"{base_url}/metrics", timeout=30).text, "mii_request_errors_total", kind="internal")

    before, u = internal(), urlparse(base_url)
    for _ in range(3):
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prom")
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and internal() == before


def test_every_refused_request_is_counted_once(base_url, deployment):
    """mii_request_errors_total{kind="invalid"} counts each 400/413 once, whether the gateway refused the request
    (its body, a field the API does not take, one over the size limit) or a replica did (its arguments, checked once
    there); a 404 or 405 is not a failed request and is not counted."""
    def invalid() -> float:
        return metric(httpx.get(f"{base_url}/metrics", timeout=30).text, "mii_request_errors_total", kind="invalid")

    url, chat = f"{base_url}/v1/completions", f"{base_url}/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    before = invalid()
    _error(httpx.post(url, content=b'{"prompt": ', timeout=10), 400)  # malformed JSON
    _error(httpx.post(url, json={"prompt": 5}, timeout=10), 400, "prompt")  # the gateway's schema
    _error(httpx.post(chat, json={"messages": user, "logprobs": True, "top_logprobs": 21}, timeout=10), 400)
    _error(httpx.post(chat, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, timeout=10), 400)
    _error(httpx.post(url, json={"prompt": "x", "max_tokens": 2, "min_p": 2.0}, timeout=60), 400)  # a replica's check
    _error(httpx.post(url, json={"prompt": "hi " * 2000, "max_tokens": 2}, timeout=60), 400)  # over the context
    big = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
    _error(httpx.post(url, content=big, timeout=30), 413)  # from its Content-Length, before the app
    _error(httpx.post(url, content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]), timeout=30), 413)
    assert invalid() - before == 8
    _error(httpx.post(url, json={"prompt": "x", "model": "no-such-model"}, timeout=10), 404)
    _error(httpx.get(url, timeout=10), 405)
    assert invalid() - before == 8


def test_internal_errors_say_only_that(caplog):
    """A route that fails in a way nobody planned answers 500 in OpenAI's shape without the exception's text (the
    log has it), before a stream starts and inside one: a real uvicorn server on a socket, a balancer that fails."""
    import asyncio

    from mii.serving.deployment import http_listener, http_server
    from mii.serving.gateway import build_app
    from mii.serving.http import ServedModel

    from mii.serving.metrics import Metrics

    class Failing:
        metrics = Metrics()

        async def generate(self, request):
            raise RuntimeError("secret detail")

        async def stream(self, request):
            yield _first_chunk()
            raise RuntimeError("secret detail")

    def _first_chunk():
        from mii.response import FinishReason, Response
        from mii.serving.protocol import to_multi_reply

        return to_multi_reply([Response("a", 1, 1, FinishReason.NONE, [5])])

    tok = type("Tok", (), {"decode": lambda self, ids: "a", "__len__": lambda self: 10})()
    app = build_app(Failing(), ServedModel("m", "d", tokenizer=tok, max_context=64, ready=True))

    async def main():
        sock = http_listener("127.0.0.1", 0)
        server = http_server(app)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=10) as c:
                whole = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                mii = await c.post("/mii/d", json={"prompts": "x"})
                streamed = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
                return whole, mii, streamed
        finally:
            server.should_exit = True
            await task

    with caplog.at_level("ERROR", logger="mii"):
        whole, mii, streamed = asyncio.run(main())
    for r in (whole, mii):
        error = _error(r, 500)
        assert error["type"] == "internal_error" and "secret" not in r.text
    # the two answered by the error handler are counted; the one inside a stream, whose 200 had gone, is logged
    assert Failing.metrics.errors.labels("internal")._value.get() == 2
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "internal_error"
    assert "secret" not in streamed.text and "secret detail" in caplog.text
