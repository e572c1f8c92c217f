"""Tool calling and reasoning on /v1/chat/completions through the real HTTP gateway and the `openai` client.

A random model cannot be made to write a tool call, so the answers of "auto" come from a scripted replica: the
gateway, the load balancer and the gRPC wire are the real ones (in this process), and the replica answers each
request with a fixed text cut into small pieces, and records the prompt and arguments it was sent. A real
deployment of a tiny random Qwen3 with a Qwen-style template (tools, tool results, `<think>`) checks rendering,
`chat_template_kwargs` and reasoning end to end, and, with the engine's JSON-schema constraint, that
`tool_choice="required"` and a named function always give calls whose arguments validate."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from typing import Optional

import httpx
import jsonschema
import openai
import pytest

from tests.serving.conftest import KV, free_port, stop, unique_name

TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Function signatures within <tools></tools>:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Return each call as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content.split('</think>')[-1] | trim }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
"""Qwen3's structure, and DeepSeek-R1's open `<think>` at the end of the prompt (so a random model's answer is
reasoning until it closes it); `enable_thinking=False` closes it in the prompt, as Qwen3's does."""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer, Qwen3Config

    from tests.reference import TINY, tiny_checkpoint

    path = tiny_checkpoint(Qwen3Config(vocab_size=49152, head_dim=16, **TINY), tmp_path_factory.mktemp("qwen3"),
                           tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


# --- a scripted replica behind the real gateway ------------------------------------------------------------------


class Scripted:
    """The gateway of `build_app` over a real `LoadBalancer` whose one replica is a gRPC servicer in this process
    that answers with `self.answers` (one text per choice, sent in pieces of 1-3 characters) and keeps each request's
    (prompts, kwargs) in `self.requests`."""

    def __init__(self, tokenizer, parser: str = "hermes", reasoning: Optional[str] = None):
        from mii.serving.http import ServedModel

        self.answers: list[str] = []
        self.requests: list = []
        self.model = ServedModel(name="scripted", deployment_name="scripted", tokenizer=tokenizer, max_context=1024,
                                 ready=True, tool_call_parser=parser, reasoning_parser=reasoning)
        self.port = free_port()
        self._server = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not (self._server is not None and self._server.started):
            assert time.monotonic() < deadline and self._thread.is_alive(), "the scripted gateway did not start"
            time.sleep(0.05)

    def servicer(self):
        from mii.engine.outputs import ResponseJoiner
        from mii.response import FinishReason, Response
        from mii.serving.protocol import from_multi_reply, pb2, pb2_grpc, read_request, to_multi_reply

        outer = self

        class Replica(pb2_grpc.ModelResponseServicer):
            async def GeneratorReplyStream(self, request, context):
                prompts, kwargs = read_request(request)
                outer.requests.append((prompts, kwargs))
                rng = random.Random(len(outer.requests))
                pieces = []
                for text in outer.answers[:kwargs.get("n", 1)]:
                    cut, i = [], 0
                    while i < len(text):
                        k = rng.randint(1, 3)
                        cut.append(text[i:i + k])
                        i += k
                    pieces.append(cut)
                for step in range(max(len(p) for p in pieces)):
                    yield to_multi_reply([Response(
                        p[step] if step < len(p) else "", 7, min(step + 1, len(p)),
                        FinishReason.STOP if step >= len(p) - 1 else FinishReason.NONE) for p in pieces])

            async def GeneratorReply(self, request, context):  # (a request that is not streamed)
                joined = ResponseJoiner()
                async for reply in self.GeneratorReplyStream(request, context):
                    joined.add(from_multi_reply(reply))
                return to_multi_reply(joined.responses())

            async def EngineStats(self, request, context):
                return pb2.EngineStatsReply(replicas=[pb2.ReplicaStats(replica=0, alive=True, max_context=1024)])

        return Replica()

    async def _main(self):
        import grpc
        import uvicorn

        from mii.serving.balancer import LoadBalancer, Replica
        from mii.serving.gateway import build_app
        from mii.serving.protocol import pb2_grpc

        grpc_server = grpc.aio.server()
        pb2_grpc.add_ModelResponseServicer_to_server(self.servicer(), grpc_server)
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        lb = LoadBalancer(expected=1)
        lb.add(Replica(0, f"127.0.0.1:{grpc_port}"))
        self._server = uvicorn.Server(uvicorn.Config(build_app(lb, self.model), host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off"))
        await self._server.serve()
        await lb.close()
        await grpc_server.stop(0)

    def close(self):
        self._server.should_exit = True
        self._thread.join(timeout=10)

    @contextlib.contextmanager
    def parsers(self, tools: Optional[str] = "hermes", reasoning: Optional[str] = None):
        """The deployment's parsers for a while (as `--tool-call-parser` / `--reasoning-parser` would set them)."""
        self.model.tool_call_parser, self.model.reasoning_parser = tools, reasoning
        try:
            yield
        finally:
            self.model.tool_call_parser, self.model.reasoning_parser = "hermes", None


@pytest.fixture(scope="module")
def scripted(tokenizer):
    s = Scripted(tokenizer)
    yield s
    s.close()


@pytest.fixture(scope="module")
def fake(scripted):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{scripted.port}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _calls(message) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _both(client, **kw):
    """The whole answer, and the streamed one as the openai client assembles it, plus the raw stream chunks."""
    whole = client.chat.completions.create(model="scripted", **kw)
    with client.chat.completions.stream(model="scripted", **kw) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        streamed = stream.get_final_completion()
    return whole, streamed, chunks


FORMATS = [
    ("hermes", 'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, '
               '"metric": true}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
               '</tool_call>', "I will look."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2, "metric": true}}; '
                    '{"name": "get_time", "parameters": {"tz": "CET"}}', None),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "metric": true}}, '
                '{"name": "get_time", "arguments": {"tz": "CET"}}]', None),
]


@pytest.mark.parametrize("parser, answer, content", FORMATS, ids=[f[0] for f in FORMATS])
def test_auto_tool_calls_in_each_format(scripted, fake, parser, answer, content):
    scripted.answers = [answer]
    with scripted.parsers(parser):
        whole, streamed, chunks = _both(fake, messages=HI, tools=TOOLS)
    want = [("get_weather", {"city": "Paris", "days": 2, "metric": True}), ("get_time", {"tz": "CET"})]
    for r in (whole, streamed):
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content == content and _calls(r.choices[0].message) == want
        ids = [c.id for c in r.choices[0].message.tool_calls]
        assert len(set(ids)) == 2 and all(i.startswith("call_") or parser == "mistral" for i in ids)
    # no markup leaks into the streamed content, and every call arrives as the client's deltas expect
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any("tool_call" in (d.content or "") or "[TOOL" in (d.content or "") for d in deltas)
    assert [tc.index for d in deltas for tc in d.tool_calls or []] == [0, 1]
    prompt, kwargs = scripted.requests[-1]
    assert '"name": "get_weather"' in prompt[0] and "The time in a time zone" in prompt[0]  # rendered by the template
    assert "json_schema" not in kwargs  # "auto": the model decides


def test_plain_answers_tool_choice_none_and_parallel_false(scripted, fake):
    scripted.answers = ["Just words, <tool_c no call."]
    whole, streamed, _ = _both(fake, messages=HI, tools=TOOLS)
    for r in (whole, streamed):
        assert r.choices[0].message.content == "Just words, <tool_c no call." and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
    scripted.answers = ['<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>']
    r = fake.chat.completions.create(model="scripted", messages=HI, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == scripted.answers[0] and r.choices[0].message.tool_calls is None
    assert "get_time" not in scripted.requests[-1][0][0]  # "none": the model is not told of the tools
    scripted.answers = [FORMATS[0][1]]
    r = fake.chat.completions.create(model="scripted", messages=HI, tools=TOOLS, parallel_tool_calls=False)
    assert [c[0] for c in _calls(r.choices[0].message)] == ["get_weather"]
    # an answer held to response_format's schema is content, even where it looks like a call
    scripted.answers = ['{"name": "get_time", "parameters": {"tz": "UTC"}}']
    with scripted.parsers("llama3_json"):
        r = fake.chat.completions.create(model="scripted", messages=HI, tools=TOOLS,
                                         response_format={"type": "json_object"})
    assert r.choices[0].message.content == scripted.answers[0] and r.choices[0].message.tool_calls is None
    assert "json_object" in scripted.requests[-1][1]


def test_named_function_arguments_stream_as_they_come(scripted, fake):
    scripted.answers = ['{"tz": "CET"}']
    named = {"type": "function", "function": {"name": "get_time"}}
    whole, streamed, chunks = _both(fake, messages=HI, tools=TOOLS, tool_choice=named)
    for r in (whole, streamed):
        assert _calls(r.choices[0].message) == [("get_time", {"tz": "CET"})]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(pieces) > 1 and pieces[0].id and pieces[0].function.name == "get_time"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == '{"tz": "CET"}'
    # the constraint sent (a schema travels as JSON text over gRPC, so its key order survives)
    assert json.loads(scripted.requests[-1][1]["json_schema"]) == TIME["function"]["parameters"]


def test_n_choices_stream_their_own_calls(scripted, fake):
    scripted.answers = [FORMATS[0][1], "<think>hmm</think>No call here."]  # the second opens <think> itself
    with scripted.parsers("hermes", "think"):
        whole, streamed, chunks = _both(fake, messages=HI, tools=TOOLS, n=2,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for r in (whole, streamed):
        first, second = sorted(r.choices, key=lambda c: c.index)
        assert [c[0] for c in _calls(first.message)] == ["get_weather", "get_time"]
        assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
        assert second.message.content == "No call here." and not second.message.tool_calls
        assert second.message.reasoning_content == "hmm"


def test_reasoning_split_whole_and_streamed(scripted, fake):
    scripted.answers = ["Paris is in France,\nso: Paris.</think>\n\nIt is sunny in Paris."]
    with scripted.parsers(reasoning="think"):
        whole, streamed, chunks = _both(fake, messages=HI)  # the prompt opened <think> (see TEMPLATE)
    for r in (whole, streamed):
        msg = r.choices[0].message
        assert msg.reasoning_content == "Paris is in France,\nso: Paris." and msg.content == "It is sunny in Paris."
    assert any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    assert not any("think>" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    # with thinking off the prompt closes the block: the answer is all content
    scripted.answers = ["Sunny, no </think> here."]
    with scripted.parsers(reasoning="think"):
        r = fake.chat.completions.create(model="scripted", messages=HI,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Sunny, no </think> here." and r.choices[0].message.reasoning_content is None
    assert scripted.requests[-1][0][0].endswith("<think>\n\n</think>\n\n")


def test_tool_results_go_back_through_the_template(scripted, fake):
    """The README's round trip: the answer's message itself (as the openai client returns it) and the tool's result
    go back, and the template renders both."""
    scripted.answers = ['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1, '
                        '"metric": true}}</tool_call>']
    messages = list(HI)
    r = fake.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    messages.append(r.choices[0].message)
    messages.append({"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id,
                     "content": '{"celsius": 21}'})
    scripted.answers = ["It is 21 degrees."]
    r = fake.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "It is 21 degrees."
    prompt = scripted.requests[-1][0][0]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1, "metric": true}}\n'
            '</tool_call>') in prompt  # arguments sent as JSON text reach the template as an object
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt


def _bad(call, param: str, *words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param, e.value.body
    assert all(w in e.value.body["message"] for w in words), e.value.body


def test_bad_tool_requests_are_400s_naming_the_field(scripted, fake):
    chat = fake.chat.completions.create
    _bad(lambda: chat(model="scripted", messages=HI, tools=TOOLS, tool_choice={"type": "function",
                                                                       "function": {"name": "nope"}}),
         "tool_choice", "no tool is named 'nope'")
    _bad(lambda: chat(model="scripted", messages=HI, tool_choice="required"), "tool_choice", "only allowed when tools")
    _bad(lambda: chat(model="scripted", messages=HI, tools=[WEATHER, WEATHER]), "tools", "two functions")
    _bad(lambda: chat(model="scripted", messages=HI, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}}]),
        "tools[0].function.parameters", "not a valid JSON Schema")
    _bad(lambda: chat(model="scripted", messages=HI, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "$schema": 5}}}]), "tools[0].function.parameters")
    _bad(lambda: chat(model="scripted", messages=HI, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]), "tools[0].function.parameters", "type object")
    _bad(lambda: chat(model="scripted", messages=HI, tools=[{"type": "function", "function": {"name": "bad name"}}]),
         "tools[0].function.name")
    _bad(lambda: chat(model="scripted", messages=HI, extra_body={"chat_template_kwargs": {"tools": []}}),
         "chat_template_kwargs", "tools")
    _bad(lambda: chat(model="scripted", messages=HI + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
        "messages[1].tool_calls[0].function.arguments", "JSON object")
    with scripted.parsers(None):
        _bad(lambda: chat(model="scripted", messages=HI, tools=TOOLS), "tools", "--tool-call-parser")
    scripted.answers = ["still serving"]
    assert chat(model="scripted", messages=HI).choices[0].message.content == "still serving"


def test_serve_options():
    from mii.cli import build_parser
    from mii.serving.launch import build_mii_config

    args = build_parser().parse_args(["serve", "--tool-call-parser", "mistral", "--reasoning-parser", "none"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("mistral", "none")
    cfg = build_mii_config("m", tool_call_parser="llama3_json", reasoning_parser="qwen3")
    assert (cfg.tool_call_parser, cfg.reasoning_parser) == ("llama3_json", "qwen3")
    with pytest.raises(Exception, match="tool_call_parser"):
        build_mii_config("m", tool_call_parser="xml")


# --- a real deployment of a tiny Qwen3 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_server(qwen_dir):
    import mii

    client = mii.serve(str(qwen_dir), deployment_name=unique_name("test-tools"), port_number=free_port(),
                       enable_restful_api=True, restful_api_port=free_port(), replica_num=1, dtype="float32",
                       inference_engine_config=KV)
    yield client
    stop(client)


@pytest.fixture(scope="module")
def real(qwen_server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{qwen_server.record['http_port']}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def _prompt_tokens(tokenizer, messages, **kw) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_real_model_renders_tools_and_splits_reasoning(real, qwen_server, tokenizer):
    """Tools and chat_template_kwargs reach the model's template (the prompt's length is the local rendering's), and
    a random model's answer, begun inside the prompt's open <think>, is all reasoning, streamed or not."""
    kw = dict(model=real.models.list().data[0].id, messages=HI, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    thinking = real.chat.completions.create(**kw)
    assert thinking.usage.prompt_tokens == _prompt_tokens(tokenizer, HI)
    msg = thinking.choices[0].message
    assert msg.content is None and msg.reasoning_content and thinking.choices[0].finish_reason == "length"
    deltas = [c.choices[0].delta for c in real.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert not any(d.content for d in deltas)  # (the openai client's stream() helper refuses a "length" finish)
    off = real.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                              "chat_template_kwargs": {"enable_thinking": False}}})
    assert off.usage.prompt_tokens == _prompt_tokens(tokenizer, HI, enable_thinking=False)
    assert off.choices[0].message.content and off.choices[0].message.reasoning_content is None
    with_tools = real.chat.completions.create(**{**kw, "tools": TOOLS})
    assert with_tools.usage.prompt_tokens == _prompt_tokens(tokenizer, HI, tools=TOOLS) > thinking.usage.prompt_tokens
    # /tokenize renders the same way
    r = httpx.post(f"http://127.0.0.1:{qwen_server.record['http_port']}/tokenize", timeout=30, json={
        "messages": HI, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}})
    text = tokenizer.apply_chat_template(HI, tools=TOOLS, enable_thinking=False, tokenize=False,
                                         add_generation_prompt=True)
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert '"description": "The time in a time zone"' in tokenizer.decode(r.json()["tokens"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_constrained_tool_calls_on_a_random_model(real, choice):
    """Only the constraint can make a random model's answer a call: every sample is one whose arguments validate
    against its function's schema, and the stream, assembled by the openai client, is the same answer."""
    kw = dict(model=real.models.list().data[0].id, messages=HI, tools=TOOLS, tool_choice=choice,
              parallel_tool_calls=False, n=4, seed=11, max_tokens=200)
    whole = real.chat.completions.create(**kw)
    with real.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for r in (whole, streamed):
        assert len(r.choices) == 4
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            assert call.function.name in (["get_weather"] if isinstance(choice, dict) else schemas)
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert [_calls(c.message) for c in sorted(streamed.choices, key=lambda c: c.index)] == \
        [_calls(c.message) for c in whole.choices]
    # a parameters schema the grammar engine cannot hold the output to is a 400 naming tools
    remote = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"$ref": "https://example.com/city.json"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        real.chat.completions.create(**{**kw, "tools": [remote]})
    assert e.value.body["param"] == "tools", e.value.body
