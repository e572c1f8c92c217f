"""Structured outputs through a real deployment (two replicas of a tiny random Llama, whose output is noise: only the
constraint makes it valid): OpenAI's response_format with the official `openai` client (parse() included), vLLM's
guided_* and structured_outputs fields, streaming, logit_bias, errors that name the field, and the constraint
arguments over gRPC with mii.client."""
import json
import re

import httpx
import jsonschema
import pydantic
import pytest

from mii.errors import ValidationError
from mii.serving import structured
from mii.serving.http import APIError
from tests.engine.test_constraints import SCHEMA


CHAT = [{"role": "user", "content": "Describe a user as JSON."}]


def test_response_format_json_schema_20_samples(oai, model_id):
    r = oai.chat.completions.create(model=model_id, messages=CHAT, n=20, seed=11, max_tokens=300, response_format={
        "type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}})
    assert len(r.choices) == 20
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        value = json.loads(c.message.content)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == [k for k in SCHEMA["properties"] if k in value]  # the schema's order, kept on the wire
    assert len({c.message.content for c in r.choices}) > 10
    tokens = oai.completions.create(model=model_id, prompt="x", max_tokens=1)  # usage: the sum of what was made
    assert tokens.usage.completion_tokens == 1
    assert r.usage.completion_tokens >= 20 * 10 and r.usage.total_tokens == r.usage.prompt_tokens + \
        r.usage.completion_tokens


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    zip: int = pydantic.Field(ge=10000, le=99999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    role: str = pydantic.Field(pattern="^(admin|user)$")
    address: Address


def test_openai_parse_returns_the_pydantic_object(oai, model_id):
    r = oai.chat.completions.parse(model=model_id, messages=CHAT, response_format=Person, max_tokens=200, seed=3)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 10000 <= person.address.zip <= 99999
    assert person == Person.model_validate_json(r.choices[0].message.content)


def test_streamed_constraints_on_both_routes(oai, model_id):
    stream = oai.chat.completions.create(model=model_id, messages=CHAT, stream=True, seed=5, max_tokens=300,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "u", "schema": SCHEMA}},
                                         stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert usage.completion_tokens > 5
    whole = oai.chat.completions.create(model=model_id, messages=CHAT, seed=5, max_tokens=300, response_format={
        "type": "json_schema", "json_schema": {"name": "u", "schema": SCHEMA}})
    assert whole.choices[0].message.content == text and whole.usage.completion_tokens == usage.completion_tokens
    stream = oai.completions.create(model=model_id, prompt="id:", stream=True, max_tokens=20, seed=2,
                                    extra_body={"guided_regex": r"[a-f]{4}-\d{2}"})
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert re.fullmatch(r"[a-f]{4}-[0-9]{2}", "".join(pieces))


def test_guided_fields_hold_on_every_sample(oai, model_id):
    r = oai.completions.create(model=model_id, prompt=["a", "b"], n=5, seed=1, max_tokens=20,
                               extra_body={"guided_regex": r"(cat|dog)-[0-9]{3}"})
    assert all(re.fullmatch(r"(cat|dog)-[0-9]{3}", c.text) and c.finish_reason == "stop" for c in r.choices)
    options = ["red", "green", "dark blue"]
    r = oai.chat.completions.create(model=model_id, messages=CHAT, n=8, seed=2, max_tokens=10,
                                    extra_body={"guided_choice": options})
    assert all(c.message.content in options for c in r.choices)
    r = oai.completions.create(model=model_id, prompt="x", n=4, seed=3, max_tokens=10,
                               extra_body={"structured_outputs": {"choice": options}})
    assert all(c.text in options for c in r.choices)
    r = oai.completions.create(model=model_id, prompt="x", n=4, seed=4, max_tokens=40,
                               extra_body={"guided_grammar": 'root ::= "[" [0-9] ("," [0-9]){0,4} "]"'})
    assert all(re.fullmatch(r"\[[0-9](,[0-9]){0,4}\]", c.text) for c in r.choices)
    r = oai.completions.create(model=model_id, prompt="x", n=4, seed=5, max_tokens=300,
                               extra_body={"guided_json": SCHEMA})
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # a stop string cuts the constrained text like any other
    r = oai.completions.create(model=model_id, prompt="x", max_tokens=20, stop=["-"],
                               extra_body={"guided_regex": "abc-def"})
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"9999999": 1}}, "logit_bias"),
])
def test_bad_constraints_are_a_400_naming_the_field(base_url, model_id, body, param):
    for route, extra in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": CHAT})):
        r = httpx.post(f"{base_url}/v1/{route}", json={"model": model_id, "max_tokens": 4, **extra, **body},
                       timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith(param.split(".")[0]) and error["type"] == "invalid_request_error", error
        if "." in param:
            assert param.split(".")[-1] in error["message"]
    ok = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the server keeps serving


def test_a_constraint_the_vocabulary_cannot_write_names_the_field(base_url, model_id):
    """(Why such a constraint fails: tests/engine/test_constraints.py.) Failing before the answer starts, it is a
    400; after the stream began, the stream's error event; both name the field as the request did."""
    r = httpx.post(f"{base_url}/v1/completions", json={"model": model_id, "prompt": "x", "max_tokens": 8,
                                                       "guided_regex": "\U0004cf91"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    assert "cannot go on within the constraint" in r.json()["error"]["message"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "ab\U0004cf91"}}}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=60, json={
            "model": model_id, "messages": CHAT, "max_tokens": 8, "stream": True, "response_format": fmt}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == '"ab' and events[-1]["error"]["param"] == "response_format", events
    ok = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the server keeps serving


def test_response_format_with_a_constraining_tool_choice_is_a_400():
    """(The tiny model's template renders no tools, so over HTTP that is the first 400; the clash is checked where
    the chat route merges what the tools add.)"""
    with pytest.raises(APIError) as e:
        structured.merge({"json_object": True}, {"json_schema": {"type": "array"}})
    assert e.value.status == 400 and e.value.param == "response_format"
    assert structured.merge({"n": 1}, {"json_schema": {}}) == {"n": 1, "json_schema": {}}


def test_text_format_and_logit_bias(oai, model_id, deployment):
    r = oai.completions.create(model=model_id, prompt="x y", max_tokens=5, temperature=0,
                               extra_body={"ignore_eos": True, "response_format": {"type": "text"}})
    assert r.choices[0].finish_reason == "length"
    mii_out = deployment.generate("x y", max_new_tokens=5, do_sample=False, ignore_eos=True, logit_bias={4321: 100})
    assert mii_out[0].token_ids == [4321] * 5  # +100 makes it the argmax at every step
    biased = oai.completions.create(model=model_id, prompt="x y", max_tokens=5, temperature=0,
                                    logit_bias={"4321": 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == mii_out[0].generated_text != r.choices[0].text
    greedy = deployment.generate([[7, 8, 9]], max_new_tokens=1, do_sample=False)[0].token_ids[0]
    plain = oai.completions.create(model=model_id, prompt=[7, 8, 9], max_tokens=1, temperature=0, logprobs=1)
    banned = oai.completions.create(model=model_id, prompt=[7, 8, 9], max_tokens=1, temperature=0, logprobs=1,
                                    logit_bias={str(greedy): -100})
    assert banned.choices[0].logprobs.tokens != plain.choices[0].logprobs.tokens


def test_constraints_over_grpc(deployment):
    out = deployment.generate(["a", "b"], json_schema=SCHEMA, max_new_tokens=300, seed=9)
    for r in out:
        jsonschema.validate(json.loads(r.generated_text), SCHEMA)
    out = deployment.generate("x", regex=r"[xyz]{3}!", max_new_tokens=10)
    assert re.fullmatch(r"[xyz]{3}!", out[0].generated_text)
    with pytest.raises(ValidationError) as e:
        deployment.generate("x", grammar="start: nothing", max_new_tokens=3)
    assert e.value.field == "grammar"


def test_constraints_with_grpcio(deployment):
    """MII's wire format as any gRPC client writes it: a schema as JSON text, a bad regex INVALID_ARGUMENT."""
    import grpc

    from mii.serving.protocol import pb2, pb2_grpc

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with grpc.insecure_channel(deployment.address) as channel:
        stub = pb2_grpc.ModelResponseStub(channel)
        kw = {"json_schema": pb2.Value(svalue=json.dumps(schema)), "max_new_tokens": pb2.Value(ivalue=40)}
        reply = stub.GeneratorReply(pb2.MultiStringRequest(request=["x"], query_kwargs=kw), timeout=60)
        assert json.loads(reply.response[0].response)["ok"] in (True, False)
        with pytest.raises(grpc.RpcError) as e:
            stub.GeneratorReply(pb2.MultiStringRequest(request=["x"], query_kwargs={"regex": pb2.Value(svalue="(")}),
                                timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("regex:")
