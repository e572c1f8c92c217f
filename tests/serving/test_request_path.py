"""One request path: the same prompts and parameters give the same `Response`s (texts, token ids, logprobs, finish
reasons, n samples, seeds) through `mii.pipeline`, `mii.client` over gRPC (blocking and streamed), MII's REST
route and the OpenAI API; and a request from DeepSpeed-MII's own client (which puts `stream` among the generation
arguments) is served."""
import json

import httpx
import openai
import pytest

import mii
from mii.serving.protocol import pb2, pb2_grpc, to_value
from tests.serving.conftest import KV

PROMPTS = ["DeepSpeed is", "Seattle is", [1, 2, 3]]
SAMPLED = dict(max_new_tokens=[6, 9, 4], n=2, seed=11, do_sample=True, temperature=0.8, top_p=0.95, logprobs=2)


@pytest.fixture(scope="module")
def pipe(tiny_model, deployment):
    from mii.serving.deployment import replica_threads

    # as many threads as a replica: float results (logprobs) are compared to the last bit
    p = mii.pipeline(tiny_model, dtype="float32", inference_engine_config=KV,
                     num_threads=replica_threads(deployment.mii_config))
    yield p
    p.destroy()


def _whole(responses) -> list[tuple]:
    """Everything a Response carries (token ids and logprobs are not part of its ==)."""
    return [(r.generated_text, r.prompt_length, r.generated_length, str(r.finish_reason), r.token_ids,
             json.loads(json.dumps(r.logprobs))) for r in responses]


@pytest.fixture(scope="module")
def greedy_with_stop(pipe):
    """Greedy parameters where prompt 0 ends at a stop token id (its 3rd token) and the others by length."""
    first = pipe(PROMPTS, max_new_tokens=8, do_sample=False)
    stop = first[0].token_ids[2]
    kwargs = dict(max_new_tokens=8, do_sample=False, stop_token_ids=[[stop], [], []], return_full_text=True)
    out = pipe(PROMPTS, **kwargs)
    assert out[0].finish_reason == "stop" and out[0].generated_length <= 3
    return kwargs, out


def test_pipeline_and_grpc_client_agree(pipe, deployment, greedy_with_stop):
    expected = pipe(PROMPTS, **SAMPLED)
    assert len(expected) == 6 and expected[0].generated_text != expected[1].generated_text  # seed + j per sample
    assert all(r.logprobs and len(r.logprobs) == r.generated_length for r in expected)
    assert _whole(deployment.generate(PROMPTS, **SAMPLED)) == _whole(expected)
    chunks = []
    assert _whole(deployment.generate(PROMPTS, streaming_fn=chunks.append, **SAMPLED)) == _whole(expected)
    assert len(chunks) > 1
    streamed = list(pipe.stream(PROMPTS, **SAMPLED))
    assert [len(c) for c in streamed] == [6] * len(streamed)
    for i, r in enumerate(expected):  # the pipeline's chunks join to the same text
        assert "".join(c[i].generated_text for c in streamed) == r.generated_text
    kwargs, greedy = greedy_with_stop
    assert _whole(deployment.generate(PROMPTS, **kwargs)) == _whole(greedy)
    assert greedy[1].generated_text.startswith("Seattle is")


def test_mii_rest_route_agrees(pipe, deployment, base_url, greedy_with_stop):
    url = f"{base_url}/mii/{deployment.deployment_name}"
    for kwargs, expected in ((SAMPLED, pipe(PROMPTS, **SAMPLED)), greedy_with_stop):
        body = httpx.post(url, json={"prompts": PROMPTS, **kwargs}, timeout=120).raise_for_status().json()
        assert body == json.loads(json.dumps([r.to_msg_dict() for r in expected]))


def test_openai_api_agrees(pipe, deployment, base_url):
    prompts = PROMPTS[:2]
    expected = pipe(prompts, max_new_tokens=7, n=2, seed=5, temperature=0.8, top_p=0.95, logprobs=2)
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = oai.completions.create(model=deployment.deployment_name, prompt=prompts, max_tokens=7, n=2, seed=5,
                               temperature=0.8, top_p=0.95, logprobs=2)
    tok = pipe.tokenizer
    assert len(r.choices) == len(expected)
    for choice, want in zip(r.choices, expected):
        assert choice.text == want.generated_text and choice.finish_reason == want.finish_reason
        assert choice.logprobs.token_logprobs == [x["logprob"] for x in want.logprobs]
        assert choice.logprobs.tokens == [tok.decode([t]) for t in want.token_ids]
        assert [sorted(t.values()) for t in choice.logprobs.top_logprobs] == [
            sorted(x["top_logprobs"].values()) for x in want.logprobs]
    assert r.usage.completion_tokens == sum(x.generated_length for x in expected)
    assert r.usage.prompt_tokens == expected[0].prompt_length + expected[2].prompt_length


def test_deepspeed_mii_client_request_is_served(deployment):
    """DeepSpeed-MII's client sends `request` strings with `stream: True` among the query kwargs."""
    import grpc

    kwargs = {"max_new_tokens": 5, "do_sample": False, "stream": True}
    request = pb2.MultiStringRequest(request=["DeepSpeed is"], query_kwargs={k: to_value(v) for k, v in kwargs.items()})
    with grpc.insecure_channel(deployment.address) as channel:
        stub = pb2_grpc.ModelResponseStub(channel)
        text = "".join(c.response[0].response for c in stub.GeneratorReplyStream(request))
        whole = stub.GeneratorReply(request).response[0]
    expected = deployment.generate("DeepSpeed is", max_new_tokens=5, do_sample=False)[0]
    assert text == whole.response == expected.generated_text and whole.finish_reason == "length"


def test_balancer_weighs_prompts_times_n():
    from mii.serving.protocol import make_request, num_sequences

    assert num_sequences(make_request(["a", "b"], {})) == 2
    assert num_sequences(make_request(["a", "b"], {"n": 3})) == 6
    assert num_sequences(make_request(["a", [1, 2]], {"n": [1, 4]})) == 5


def test_the_engine_thread_wakes_a_unary_call_per_finished_sequence_and_a_stream_per_interval(pipe):
    """The replica's engine thread holds a unary call's outputs until one of its sequences finishes (and notes each
    sequence's first and last token times); a stream's handler gets the first step's outputs at once, then at most
    one delivery per interval and each finished sequence's at once (interval 0: every step). The same tokens."""
    import asyncio

    from mii.engine.requests import InputProcessor
    from mii.serving.replica import EngineLoop, _Sink

    prompts, kwargs = ["DeepSpeed is", "Seattle is"], dict(max_new_tokens=[3, 9], do_sample=False, ignore_eos=True)
    inputs = InputProcessor(pipe.tokenizer, pipe.engine.limits)
    engine_loop = EngineLoop(pipe.engine)

    async def call(hold: bool, interval: float = 0.0):
        sink = _Sink(asyncio.get_running_loop(), hold=hold, interval=interval)
        engine_loop.submit(inputs.process(prompts, kwargs)[0], sink)
        kind, uids = await asyncio.wait_for(sink.queue.get(), 60)
        assert kind == "added"
        tokens, done, wakes = {u: [] for u in uids}, set(), 0
        while len(done) < len(uids):
            kind, outs = await asyncio.wait_for(sink.queue.get(), 60)
            assert kind == "out"
            wakes += 1
            for o in outs:
                tokens[o.uid] += o.token_ids
                if o.finished:
                    done.add(o.uid)
        return [tokens[u] for u in uids], wakes, [sink.token_times.get(u) for u in uids]

    engine_loop.start()
    try:
        held, streamed, spaced = asyncio.run(call(True)), asyncio.run(call(False)), asyncio.run(call(False, 60.0))
    finally:
        engine_loop.stop()
    assert held[0] == streamed[0] == spaced[0] == [r.token_ids for r in pipe(prompts, **kwargs)]
    # a wake per finished sequence; one per step; the first step's, then the finished sequences'
    assert (held[1], streamed[1], spaced[1]) == (2, 9, 3)
    (first0, last0), (first1, last1) = held[2]
    assert first0 < last0 < last1 and first1 < last1 and streamed[2] == spaced[2] == [None, None]


def test_a_stream_sends_what_it_holds_when_due_even_in_a_step_without_its_outputs(monkeypatch):
    """A stream's sink (engine thread): the first outputs at once, then held until the interval passed; a step in
    which the call had no outputs (a sequence preempted, or waiting for room) sends them once due. (On a clock of
    the test's own: a busy machine's stall between two lines must not make "held" due.)"""
    import asyncio

    from mii.engine.engine import RequestOutput
    from mii.response import FinishReason
    from mii.serving.replica import _Sink

    now = [1000.0]
    monkeypatch.setattr("mii.serving.replica.time.perf_counter", lambda: now[0])
    loop = asyncio.new_event_loop()
    try:
        sink = _Sink(loop, interval=0.2)

        def out(text, finished=False):
            return RequestOutput(1, text, [5], finished, FinishReason.STOP if finished else FinishReason.NONE, 1, 1)

        assert sink.deliver([out("a")]) is False  # the first at once
        assert sink.deliver([out("b")]) is True and sink.deliver([]) is True  # held, not due
        now[0] += 0.19
        assert sink.deliver([]) is True  # still held
        now[0] += 0.02
        assert sink.deliver([]) is False and sink.deliver([]) is False  # due: sent; then nothing to send
        assert sink.deliver([out("c")]) is True and sink.deliver([out("d", True)]) is False  # a finish: at once
        loop.run_until_complete(asyncio.sleep(0))
        sent = []
        while not sink.queue.empty():
            kind, outputs = sink.queue.get_nowait()
            sent.append((kind, [o.text for o in outputs]))
        assert sent == [("out", ["a"]), ("out", ["b"]), ("out", ["c", "d"])]
    finally:
        loop.close()
