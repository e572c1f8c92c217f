"""`mii serve` under a deadline and stopped under load, as an operator runs it (a real process, real sockets):

- a request that runs past `--request-timeout` ends with 504 (OpenAI's error shape) and its KV blocks are freed;
- SIGTERM while streams are in flight: /health and new requests answer 503, a stream in flight finishes with all
  its tokens;
- a second SIGTERM stops at once: the stream still running ends with a clear error, the command exits within
  seconds, and no process and no deployment record is left.

(terminate_server with a stream outliving the drain timeout: tests/serving/test_load.py.)
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from mii.serving import records
from tests.serving.conftest import LONG_CONTEXT, LONG_TOKENS, free_port, metric, unique_name, wait_until

MII = str(Path(sys.executable).parent / "mii")
TIMEOUT_S = 8
"""Longer than the SIGTERM part takes (its long stream must still run at the second signal, not end at this
timeout); far shorter than the request that times out (16 sequences x 100,000 steps of the tiny model: minutes on
any machine here)."""


def _stream(base: str, max_tokens: int, out: dict) -> None:
    """An SSE completion; `out` gets its text, error events and whether it ended with [DONE]."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    out.update(text="", errors=[], done=False, first=threading.Event())
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["errors"].append(event["error"])
                else:
                    out["text"] += event["choices"][0]["text"]
                    out["first"].set()
    except httpx.TransportError as e:
        out["errors"].append({"message": f"transport: {e}"})
    finally:
        out["first"].set()


def test_request_timeout_and_two_signals(tmp_path, long_model):
    port, grpc_port, name = free_port(), free_port(), unique_name("test-shutdown")
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([MII, "serve", long_model, "--port", str(port), "--grpc-port", str(grpc_port),
                             "--deployment-name", name, "--dtype", "float32", "--request-timeout", str(TIMEOUT_S),
                             "--drain-timeout", "60", "--max-context", str(LONG_CONTEXT)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    replica_pids = []
    try:
        def up():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                return httpx.get(f"{base}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        assert wait_until(up, timeout=240, interval=0.3)
        replica_pids = [r["pid"] for r in records.read(name)["replicas"]]

        # past --request-timeout: 504, the sequences aborted
        t = time.monotonic()
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"prompt": "x", "max_tokens": LONG_TOKENS, "n": 16, "ignore_eos": True})
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "request_timeout" and "request_timeout" in r.json()["error"]["message"]
        assert TIMEOUT_S * 0.9 < time.monotonic() - t < TIMEOUT_S + 10
        assert wait_until(lambda: metric(httpx.get(f"{base}/metrics", timeout=10).text,
                                         "mii_kv_cache_blocks_used") == 0, timeout=10)

        # SIGTERM under two streams: the short one finishes, new requests are refused
        long, short = {}, {}
        threads = [threading.Thread(target=_stream, args=(base, LONG_TOKENS, long)),
                   threading.Thread(target=_stream, args=(base, 12, short))]
        threads[0].start()
        assert wait_until(lambda: long.get("first") and long["first"].is_set(), timeout=30)
        threads[1].start()
        assert wait_until(lambda: short.get("first") and short["first"].is_set(), timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503, timeout=5)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        threads[1].join(30)
        assert short["done"] and not short["errors"] and short["text"], short
        assert proc.poll() is None and long["errors"] == []  # still draining: the long stream goes on

        # a second signal: at once
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
        stopped_in = time.monotonic() - t
        threads[0].join(15)
        assert [e["message"] for e in long["errors"]] == [
            "the deployment was stopped at once before this request finished"], long  # not silently
        assert long["done"]
        assert stopped_in < 5, stopped_in
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = [p for p in replica_pids if records.pid_alive(p)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        log.close()
    assert rc == 0
    assert replica_pids and not left and wait_until(lambda: not any(records.pid_alive(p) for p in replica_pids), 5)
    assert records.read(name) is None
    records.log_path(name).unlink(missing_ok=True)
