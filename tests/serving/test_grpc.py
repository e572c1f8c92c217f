"""MII's gRPC service with a plain grpcio client (MII's message fields), grpc.health.v1, and cancellation."""
import grpc
import pytest
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mii.serving.protocol import pb2, pb2_grpc
from tests.serving.conftest import LONG_TOKENS, generated, wait_until


@pytest.fixture(scope="module")
def channel(deployment):
    with grpc.insecure_channel(deployment.address) as ch:
        yield ch


def _kwargs(**kw):
    """MII's encoding of query_kwargs (ints as ivalue, floats as fvalue, bools as bvalue)."""
    out = {}
    for k, v in kw.items():
        if isinstance(v, bool):
            out[k] = pb2.Value(bvalue=v)
        elif isinstance(v, int):
            out[k] = pb2.Value(ivalue=v)
        elif isinstance(v, float):
            out[k] = pb2.Value(fvalue=v)
        else:
            out[k] = pb2.Value(svalue=v)
    return out


def test_generator_reply_with_mii_fields(channel):
    stub = pb2_grpc.ModelResponseStub(channel)
    req = pb2.MultiStringRequest(request=["DeepSpeed is", "Seattle is"],
                                 query_kwargs=_kwargs(max_new_tokens=5, do_sample=False))
    reply = stub.GeneratorReply(req, timeout=60)
    assert len(reply.response) == 2
    for r in reply.response:
        assert r.finish_reason == "length" and r.generated_tokens == 5 and r.prompt_tokens >= 2
        assert r.response and r.time_taken > 0


def test_stream_concatenates_to_the_unary_reply(channel):
    stub = pb2_grpc.ModelResponseStub(channel)
    req = pb2.MultiStringRequest(request=["Hello there"], query_kwargs=_kwargs(max_new_tokens=12, do_sample=False))
    whole = stub.GeneratorReply(req, timeout=60).response[0]
    chunks = list(stub.GeneratorReplyStream(req, timeout=60))
    assert len(chunks) > 1
    assert "".join(c.response[0].response for c in chunks) == whole.response
    assert [c.response[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.response[0].finish_reason == "none" for c in chunks[:-1])


def test_health_service(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "modelresponse.ModelResponse"):
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_invalid_argument_names_the_field(channel):
    stub = pb2_grpc.ModelResponseStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.GeneratorReply(pb2.MultiStringRequest(request=["x"], query_kwargs=_kwargs(top_p=5.0)), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
    both = pb2.MultiStringRequest(request=["x"], prompts=[pb2.Prompt(text="y")], query_kwargs=_kwargs(max_new_tokens=2))
    with pytest.raises(grpc.RpcError) as e:  # (the text of one of them would be dropped)
        stub.GeneratorReply(both, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in e.value.details()


@pytest.fixture(scope="module")
def long_channel(long_deployment):
    """A channel to one replica of the 131,072-token model: its requests outlast the tests' waits."""
    with grpc.insecure_channel(long_deployment.address) as ch:
        yield ch


def test_cancelled_stream_frees_kv_blocks(long_channel, long_deployment):
    stub = pb2_grpc.ModelResponseStub(long_channel)
    half = LONG_TOKENS // 2  # both sequences fit in the cache at once
    req = pb2.MultiStringRequest(request=["a long story"] * 2,
                                 query_kwargs=_kwargs(max_new_tokens=half, ignore_eos=True))
    before = generated(long_deployment)
    call = stub.GeneratorReplyStream(req, timeout=120)
    for _ in range(3):
        next(call)
    stats = stub.EngineStats(empty_pb2.Empty()).replicas
    assert sum(s.kv_blocks_used for s in stats) > 0 and sum(s.num_running for s in stats) == 2
    call.cancel()

    def freed():
        s = stub.EngineStats(empty_pb2.Empty()).replicas
        return all(x.kv_blocks_used == 0 and x.num_running == 0 and x.num_waiting == 0 for x in s)

    assert wait_until(freed, timeout=15), stub.EngineStats(empty_pb2.Empty())
    assert 0 < generated(long_deployment) - before < 2 * half  # aborted, not run to the end


def test_deadline_aborts_the_request(long_channel, long_deployment):
    stub = pb2_grpc.ModelResponseStub(long_channel)
    req = pb2.MultiStringRequest(request=["x"], query_kwargs=_kwargs(max_new_tokens=LONG_TOKENS, ignore_eos=True))
    before = generated(long_deployment)
    with pytest.raises(grpc.RpcError) as e:
        stub.GeneratorReply(req, timeout=1.0)  # (the warm replica's first step comes well before)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def freed():
        return all(x.kv_blocks_used == 0 and x.num_running == 0 for x in stub.EngineStats(empty_pb2.Empty()).replicas)

    assert wait_until(freed, timeout=15)
    assert 0 < generated(long_deployment) - before < LONG_TOKENS  # it ran, and stopped at the deadline
