"""`mii serve` as a newcomer runs it (README): the embedded default model, a streamed chat answer over HTTP,
`mii.client` over gRPC, and SIGTERM taking every child process with it."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

import mii
from mii.serving import records
from tests.serving.conftest import end_serve, free_port, unique_name

MII = str(Path(sys.executable).parent / "mii")


def test_help_lists_serve():
    out = subprocess.run([MII, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "serve" in out.stdout and "--grpc-port" in subprocess.run(
        [MII, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout


def test_serve_default_model_then_sigterm(tmp_path):
    port, grpc_port, name = free_port(), free_port(), unique_name("test-cli")
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([MII, "serve", "--port", str(port), "--grpc-port", str(grpc_port), "--deployment-name",
                             name, "--max-batch-tokens", "64", "--stream-interval-ms", "10000",
                             "--itl-target-ms", "50"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    replica_pids = []
    try:
        statuses = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and 200 not in statuses:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                statuses.append(httpx.get(f"{base}/health", timeout=5).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert statuses[-1] == 200 and 503 in statuses  # 503 while the model loads

        question = "What is the capital of France? Answer in one sentence."  # (tests/api/test_cli.py: QUESTION)
        body = {"messages": [{"role": "user", "content": question}], "stream": True, "max_tokens": 32,
                "temperature": 0}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        pieces = [json.loads(line[6:])["choices"][0]["delta"].get("content") for line in lines[:-1]
                  if json.loads(line[6:])["choices"]]
        text = "".join(p or "" for p in pieces)
        assert "Paris" in text
        # --stream-interval-ms 10000: the first token at once, the rest with the finished sequence
        sent = [p for p in pieces if p]
        assert len(sent) == 2 and len(sent[1]) > len("Paris"), pieces

        # the engine took the token budget and the latency target asked for (its plan, logged by the replica)
        plan = (tmp_path / "serve.log").read_text()
        assert re.search(r"token budget\s+64\b", plan)
        assert re.search(r"prompt chunks\s+beside running streams, .* within 50 ms", plan)

        client = mii.client(name)
        replica_pids = [r["pid"] for r in client.record["replicas"]]
        assert client.generate("Hello", max_new_tokens=3)[0].generated_length == 3
    finally:
        rc = end_serve(proc, replica_pids)
        log.close()
    assert rc == 0
    assert replica_pids and not any(records.pid_alive(p) for p in replica_pids)
    assert records.read(name) is None
