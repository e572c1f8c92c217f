"""Deployments shared by the serving tests: real processes on free loopback ports, stopped (and checked gone)
at the end even when a test fails.

- `deployment`: a tiny random Llama (SmolLM2's tokenizer and chat template; 1024-token context), two replicas,
  HTTP gateway on, a default `max_length` of 512 (MII's requests without a length stop there; OpenAI's use the
  rest of the context); started through MII's `mii_config={..., "model_config": {...}}` form.
- `long_deployment`: one replica of `long_model` (the tiny Llama with a 131,072-token context) and a KV cache
  that holds all of it: a request of 100,000 tokens runs for tens of seconds on the fastest machine, so a test that
  must act while a request runs never races the model's speed. (Give its requests a length: OpenAI's default,
  the rest of the context, is ~131,000 tokens.)
- `limited`: the same long model, two replicas that each run one sequence at a time and queue at most one more,
  behind an API key (tests/serving/test_load.py).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
import uuid

import pytest

from mii.serving import records

KV = {"state_manager": {"kv_block_size": 16, "memory_config": {"mode": "allocate", "size": 512}}}
LONG_CONTEXT = 131072
LONG_KV = {"state_manager": {"kv_block_size": 16, "max_context": LONG_CONTEXT,
                             "memory_config": {"mode": "allocate", "size": LONG_CONTEXT // 16}}}
"""`long_model`'s whole context (the engine's default `max_context` is 8,192) and a KV cache for one sequence of
it (64 MiB in float32)."""
LONG_TOKENS = 100_000
"""A request that outlasts any test's waits: the tiny model makes at most a few thousand tokens a second."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def deployment_pids(client) -> list[int]:
    return [client.record["pid"]] + [r["pid"] for r in client.record["replicas"]]


def stop(client) -> None:
    """Terminate a deployment; kill whatever is left (only our pids) so a failed test leaves nothing behind."""
    pids = deployment_pids(client)
    try:
        client.terminate_server(timeout=20)
    finally:
        for pid in pids:
            if records.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    records.log_path(client.deployment_name).unlink(missing_ok=True)


def end_serve(proc, replica_pids) -> int:
    """SIGTERM a `mii serve` process a test started and wait for it (its exit code); if it does not end, kill its
    process group and any of its replicas still alive (only those pids), so a failed test leaves nothing behind."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in replica_pids:
            if records.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples of `name` (with these labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


@contextlib.contextmanager
def under_load(client, prompts: list, kwargs: dict, threads: int):
    """While the block runs, `threads` threads each send prompt i (thread i) through `client.generate`, one request
    after another. Yields the list that gets (i, token ids) of every finished request and (i, exception) of every
    failed one; complete once the block is left."""
    results, done = [], threading.Event()

    def load(i):
        while not done.is_set():
            try:
                results.append((i, client.generate(prompts[i], **kwargs)[0].token_ids))
            except Exception as e:  # noqa: BLE001 - every failure is the caller's to report
                results.append((i, e))

    workers = [threading.Thread(target=load, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    try:
        yield results
    finally:
        done.set()
        for w in workers:
            w.join()


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer_dir) -> str:
    from transformers import LlamaConfig

    from tests.reference import TINY, tiny_checkpoint

    cfg = LlamaConfig(vocab_size=49152, **TINY)
    return str(tiny_checkpoint(cfg, tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir))


@pytest.fixture(scope="session")
def long_model(tmp_path_factory, tokenizer_dir) -> str:
    """The tiny Llama with a context of 131,072 tokens, for requests that must outlast a test's waits (1,000 tokens
    of the 1,024-token model took under 0.5 s on a fast CI machine)."""
    from transformers import LlamaConfig

    from tests.reference import TINY, tiny_checkpoint

    cfg = LlamaConfig(vocab_size=49152, **{**TINY, "max_position_embeddings": LONG_CONTEXT})
    return str(tiny_checkpoint(cfg, tmp_path_factory.mktemp("tiny-llama-long"), tokenizer_dir))


@pytest.fixture(scope="session")
def long_deployment(long_model):
    import mii

    client = mii.serve(long_model, deployment_name=unique_name("test-long"), port_number=free_port(),
                       enable_restful_api=True, restful_api_port=free_port(), dtype="float32",
                       inference_engine_config=LONG_KV)
    client.generate("warm", max_new_tokens=2)  # a test's deadline counts from a replica that has run a step
    yield client
    stop(client)


def generated(client) -> int:
    """Tokens a deployment's replicas have made so far."""
    return sum(s.generation_tokens_total for s in client.engine_stats())


@pytest.fixture(scope="session")
def deployment(tiny_model):
    import mii

    name = unique_name("test-mii")
    client = mii.serve(mii_config={
        "deployment_name": name, "deployment_type": "local", "port_number": free_port(),
        "enable_restful_api": True, "restful_api_port": free_port(),
        "model_config": {"model_name_or_path": tiny_model, "task": "text-generation", "device_map": "auto",
                         "tensor_parallel": 1, "replica_num": 2, "dtype": "float32", "inference_engine_config": KV,
                         "max_length": 512}})
    yield client
    stop(client)


@pytest.fixture(scope="session")
def base_url(deployment) -> str:
    return f"http://127.0.0.1:{deployment.record['http_port']}"


@pytest.fixture(scope="module")
def oai(base_url):
    """The official `openai` client on `deployment`'s gateway."""
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(oai):
    return oai.models.list().data[0].id
