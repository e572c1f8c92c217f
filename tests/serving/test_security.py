"""Security defaults on real processes: the API key on every HTTP route but /health and /metrics and on every
gRPC method but the health service (Terminate included; the replicas' ports too), `mii.client` sending it, the gRPC port on loopback,
the request size limit on both protocols, and `mii serve` binding 127.0.0.1 and warning when it is exposed."""
import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

import mii
from mii.cli import build_parser
from mii.errors import AuthenticationError
from mii.serving.auth import exposure_warnings
from mii.serving.protocol import make_request, pb2_grpc
from tests.serving.conftest import KV, free_port, stop, unique_name

KEY = "s3cret-key"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def keyed(tiny_model):
    """One replica behind an API key, taking requests of at most 64 KiB, without the chat page."""
    client = mii.serve(tiny_model, deployment_name=unique_name("test-keyed"), port_number=free_port(),
                       enable_restful_api=True, restful_api_port=free_port(), dtype="float32", api_key=KEY,
                       max_request_bytes=LIMIT, inference_engine_config=KV, enable_chat_ui=False)
    yield client
    stop(client)


@pytest.fixture(scope="module")
def url(keyed):
    return f"http://127.0.0.1:{keyed.record['http_port']}"


def test_http_needs_the_key_but_on_health_and_metrics(url, tiny_model):
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert "mii_replica_up" in httpx.get(f"{url}/metrics", timeout=10).text  # Prometheus scrapes without a key
    for method, path in (("GET", "/v1/models"), ("GET", "/openapi.json"), ("POST", "/v1/completions"),
                         ("POST", "/tokenize"), ("GET", "/no/such/route"), ("GET", "/engine_plan"), ("GET", "/")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            r = httpx.request(method, f"{url}{path}", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"] == tiny_model
    # enable_chat_ui=False (mii serve --no-ui): no page at /, and /openapi.json does not list it
    r = httpx.get(f"{url}/", headers=auth, timeout=10)
    assert r.status_code == 404 and r.json()["error"] == {"message": "no route /", "type": "not_found_error",
                                                          "param": None, "code": None}
    assert "/" not in httpx.get(f"{url}/openapi.json", headers=auth, timeout=10).json()["paths"]
    assert build_parser().parse_args(["serve", "--no-ui"]).no_ui
    # the size limit (64 KiB here) is checked once the key is
    r = httpx.post(f"{url}/v1/completions", headers=auth, json={"prompt": "x" * LIMIT}, timeout=10)
    assert r.status_code == 413 and f"larger than {LIMIT} bytes" in r.json()["error"]["message"]


def test_grpc_needs_the_key_on_every_method_but_health(keyed):
    request = make_request(["hello"], {"max_new_tokens": 2})
    with grpc.insecure_channel(keyed.address) as channel:
        stub = pb2_grpc.ModelResponseStub(channel)
        calls = {"GeneratorReply": lambda md: stub.GeneratorReply(request, timeout=30, metadata=md),
                 "GeneratorReplyStream": lambda md: list(stub.GeneratorReplyStream(request, timeout=30, metadata=md)),
                 "EngineStats": lambda md: stub.EngineStats(empty_pb2.Empty(), timeout=30, metadata=md),
                 "Terminate": lambda md: stub.Terminate(empty_pb2.Empty(), timeout=30, metadata=md)}
        for name, call in calls.items():
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
                with pytest.raises(grpc.RpcError) as e:
                    call(metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # and Terminate did not stop it
        reply = stub.GeneratorReply(request, timeout=30, metadata=(("authorization", f"Bearer {KEY}"),))
        assert reply.response[0].generated_tokens == 2
        # the replicas' own ports (loopback, reachable by anyone on this host) want the key too
        with grpc.insecure_channel(keyed.record["replicas"][0]["address"]) as replica:
            replica_stub = pb2_grpc.ModelResponseStub(replica)
            for call in (lambda md: replica_stub.GeneratorReply(request, timeout=30, metadata=md),
                         lambda md: replica_stub.Terminate(empty_pb2.Empty(), timeout=30, metadata=md)):
                with pytest.raises(grpc.RpcError) as e:
                    call(())
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert replica_stub.EngineStats(empty_pb2.Empty(), timeout=30,
                                            metadata=(("authorization", f"Bearer {KEY}"),)).replicas[0].alive
        # a message over the limit is refused by gRPC itself
        with pytest.raises(grpc.RpcError) as e:
            stub.GeneratorReply(make_request(["x" * LIMIT], {}), timeout=30,
                                metadata=(("authorization", f"Bearer {KEY}"),))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_mii_client_sends_the_key(keyed):
    assert keyed.generate("hello", max_new_tokens=3)[0].generated_length == 3  # mii.serve's client has it
    found = mii.client(keyed.deployment_name, api_key=KEY)
    chunks = []
    assert found.generate("hello", streaming_fn=chunks.append, max_new_tokens=3)[0].generated_length == 3
    assert chunks and asyncio.run(found.agenerate("hello", max_new_tokens=2))[0].generated_length == 2
    assert found.engine_stats()[0].alive
    with pytest.raises(AuthenticationError, match="invalid or missing API key"):
        mii.client(keyed.deployment_name).generate("hello", max_new_tokens=2)


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                out.add(address)
    return out


def test_ports_listen_on_loopback_only(keyed):
    assert keyed.record["host"] == "127.0.0.1"
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1 (little-endian), as IPv4 or mapped IPv6
    for port in (keyed.port_number, keyed.record["http_port"]):
        assert _listening(port) and _listening(port) <= loopback, _listening(port)


def test_serve_binds_loopback_and_warns_when_exposed(tmp_path):
    args = build_parser().parse_args(["serve"])
    assert args.host == args.grpc_host == "127.0.0.1" and args.api_key is None and not args.metrics_need_key
    assert exposure_warnings("127.0.0.1", "localhost", None) == []
    assert exposure_warnings("0.0.0.0", "::1", "key") == []
    assert len(exposure_warnings("0.0.0.0", "0.0.0.0", None)) == 2
    assert len(exposure_warnings(None, "10.1.2.3", None)) == 1
    # the warnings come from the deployment itself, before any model loads (this one cannot load)
    def serve(*extra: str) -> str:
        out = subprocess.run([str(Path(sys.executable).parent / "mii"), "serve", str(tmp_path / "no-model"),
                              "--host", "0.0.0.0", "--grpc-host", "0.0.0.0", "--port", str(free_port()),
                              "--grpc-port", str(free_port()), "--deployment-name", unique_name("test-exposed"),
                              *extra], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "model path not found" in out.stderr, out.stderr
        return out.stderr

    err = serve()
    assert "HTTP API listens on 0.0.0.0 without an API key" in err
    assert "gRPC service listens on 0.0.0.0 without an API key" in err
    (tmp_path / "key").write_text(KEY + "\n")  # a key from a file, out of the process list: no warning
    assert "without an API key" not in serve("--api-key-file", str(tmp_path / "key"))
