"""The OpenAI-compatible API with the official `openai` client: completions, chat, streaming, logprobs, errors."""
import httpx
import openai
import pytest


def test_models(oai, tiny_model, base_url):
    import mii

    models = oai.models.list().data
    assert [m.id for m in models] == [tiny_model]
    assert oai.models.retrieve(tiny_model) == models[0]  # an id with slashes (a folder's path) too
    with pytest.raises(openai.NotFoundError, match="The model `no/such-model` does not exist"):
        oai.models.retrieve("no/such-model")
    assert httpx.get(f"{base_url}/version", timeout=10).json() == {"version": mii.__version__}


def test_completion_usage_and_n(oai, model_id):
    r = oai.completions.create(model=model_id, prompt=["Hello", "A B C"], max_tokens=5, n=2, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    again = oai.completions.create(model=model_id, prompt=["Hello", "A B C"], max_tokens=5, n=2, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_completion_stop_string_and_echo(oai, model_id):
    full = oai.completions.create(model=model_id, prompt="Once upon", max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:][:3]
    cut = oai.completions.create(model=model_id, prompt="Once upon", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and full.startswith(cut.choices[0].text)
    assert stop not in cut.choices[0].text
    echoed = oai.completions.create(model=model_id, prompt="Once upon", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Once upon")


def test_completion_logprobs(oai, model_id):
    r = oai.completions.create(model=model_id, prompt="x y", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 3 for t in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text


def test_extra_fields_are_accepted(oai, model_id):
    r = oai.completions.create(model=model_id, prompt="x", max_tokens=7, extra_body={
        "top_k": 5, "ignore_eos": True, "repetition_penalty": 1.1, "min_p": 0.01, "min_tokens": 2,
        "skip_special_tokens": True})
    assert r.usage.completion_tokens == 7


def test_default_max_tokens_is_the_rest_of_the_context(oai, model_id, deployment):
    """Without max_tokens an OpenAI answer may fill the 1024-token context, past the deployment's default
    max_length of 512, which MII's requests without a length keep to."""
    prompt = [7] * 1000
    r = oai.completions.create(model=model_id, prompt=prompt, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 1024
    mii_default = deployment.generate([[7] * 500], ignore_eos=True)[0]
    assert mii_default.prompt_length + mii_default.generated_length == 512


def test_explicit_max_tokens_past_the_context_is_a_400(oai, model_id):
    """OpenAI's and vLLM's rule and message; not a silently shorter answer."""
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_id, prompt=[5] * 1000, max_tokens=100)
    assert e.value.body["message"] == (
        "This model's maximum context length is 1024 tokens. However, you requested 1100 tokens (1000 in the "
        "prompt, 100 for the completion). Please reduce the length of the prompt or of the completion.")
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="However, you requested 1"):
        oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                    max_completion_tokens=1024)
    r = oai.completions.create(model=model_id, prompt=[5] * 1000, max_tokens=24, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param", [
    (dict(seed=2**63 - 1, n=2), "seed"),  # sample j uses seed + j: past int64 (it overflowed in the step)
    (dict(seed=-2**63 - 1), "seed"),  # below int64 (negative seeds are fine, as in vLLM)
    (dict(stop_token_ids=[49152 + 5], min_tokens=2), "stop_token_ids"),  # outside the vocabulary
    (dict(stop=[f"s{i}" for i in range(17)]), "stop"),
])
def test_values_the_engine_refuses_are_400s(base_url, model_id, extra, param):
    body = {"model": model_id, "prompt": "x", "max_tokens": 2, **extra}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(f"{base_url}/v1/completions", json={"model": model_id, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_chat_and_its_stream_agree(oai, model_id):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    whole = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 10
    stream = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=10, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_logprobs(oai, model_id):
    r = oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                    temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_completion_stream(oai, model_id):
    chunks = list(oai.completions.create(model=model_id, prompt="abc", max_tokens=6, temperature=0, stream=True))
    whole = oai.completions.create(model=model_id, prompt="abc", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_wire_format(base_url, model_id):
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=60,
                      json={"model": model_id, "prompt": "abc", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_errors(oai, model_id, base_url):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_id, prompt=[5] * 1500, max_tokens=2)
    assert "maximum context length is 1024 tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_id, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(f"{base_url}/v1/chat/completions", content=b'{"messages": [', timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "n": "many"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def _bad_request(call, param: str, *words: str) -> dict:
    """A call the server must refuse with a 400 naming `param` (and saying `words`)."""
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param, e.value.body
    assert all(w in e.value.body["message"] for w in words), e.value.body
    return e.value.body


def test_openai_ranges_and_empty_chats(oai, model_id):
    chat, complete = oai.chat.completions.create, oai.completions.create
    hi = [{"role": "user", "content": "hi"}]
    _bad_request(lambda: complete(model=model_id, prompt="x", temperature=2.5), "temperature", "less than or equal to 2")
    _bad_request(lambda: complete(model=model_id, prompt="x", top_p=0), "top_p", "greater than 0")
    _bad_request(lambda: complete(model=model_id, prompt="x", top_p=1.5), "top_p")
    _bad_request(lambda: complete(model=model_id, prompt="x", presence_penalty=3), "presence_penalty")
    _bad_request(lambda: complete(model=model_id, prompt="x", seed=2 ** 64), "seed")
    _bad_request(lambda: complete(model=model_id, prompt="x", extra_body={"repetition_penalty": 0}),
                 "repetition_penalty")
    _bad_request(lambda: complete(model=model_id, prompt=[5, 10 ** 6], echo=True, max_tokens=1), "prompt",
                 "outside the vocabulary")
    _bad_request(lambda: chat(model=model_id, messages=hi, n=500), "n", "less than or equal to 128")
    _bad_request(lambda: complete(model=model_id, prompt=["x"] * 100, n=100), "prompt", "10000 sequences")
    _bad_request(lambda: chat(model=model_id, messages=[]), "messages")
    _bad_request(lambda: chat(model=model_id, messages=[{"role": "user", "content": "  \n"},
                                                        {"role": "assistant", "content": ""}]), "messages", "empty")
    _bad_request(lambda: chat(model=model_id, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "messages[0].content", "only text")
    _bad_request(lambda: chat(model=model_id, messages=hi, top_logprobs=2), "top_logprobs", "logprobs=true")
    _bad_request(lambda: chat(model=model_id, messages=hi, stream_options={"include_usage": True}),
                 "stream_options")
    # the engine's own checks (on the replica) come back as 400s naming OpenAI's field
    _bad_request(lambda: complete(model=model_id, prompt="x", extra_body={"stop_token_ids": [10 ** 6]}),
                 "stop_token_ids", "outside the vocabulary")
    _bad_request(lambda: complete(model=model_id, prompt="x", n=2, seed=2 ** 63 - 1), "seed")
    _bad_request(lambda: complete(model=model_id, prompt="x", max_tokens=2, extra_body={"min_tokens": 5}),
                 "min_tokens", "exceeds max_tokens=2")  # (the other parameter named as the API names it too)
    parts = chat(model=model_id, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 max_tokens=3, temperature=0)
    assert parts.choices[0].message.content == chat(model=model_id, messages=hi, max_tokens=3,
                                                    temperature=0).choices[0].message.content


def test_unsupported_fields_are_refused_not_ignored(oai, model_id):
    chat, hi = oai.chat.completions.create, [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    # tools are supported, but SmolLM2's template does not render them (tests/serving/test_tools.py has one that does)
    _bad_request(lambda: chat(model=model_id, messages=hi, tools=[tool]), "tools", "does not render tools")
    _bad_request(lambda: chat(model=model_id, messages=hi, tool_choice="auto"), "tool_choice", "only allowed when")
    body = _bad_request(lambda: chat(model=model_id, messages=hi, functions=[tool["function"]]), "functions",
                        "not supported")
    assert body["code"] == "unsupported_parameter"
    # response_format and logit_bias are supported (tests/serving/test_structured.py)
    _bad_request(lambda: oai.completions.create(model=model_id, prompt="x", suffix="y"), "suffix")
    # vLLM's: a template sent with the request, chat's echo, beam search, token lists (refused unless "not used")
    _bad_request(lambda: chat(model=model_id, messages=hi, extra_body={"chat_template": "{{ 'x' }}"}), "chat_template")
    _bad_request(lambda: chat(model=model_id, messages=hi, extra_body={"echo": True}), "echo")
    _bad_request(lambda: oai.completions.create(model=model_id, prompt="x", extra_body={"use_beam_search": True}),
                 "use_beam_search")
    _bad_request(lambda: oai.completions.create(model=model_id, prompt="x", extra_body={"allowed_token_ids": [5]}),
                 "allowed_token_ids")
    assert oai.completions.create(model=model_id, prompt="x", max_tokens=1, extra_body={
        "use_beam_search": False, "length_penalty": 1.0, "detokenize": True}).usage.completion_tokens == 1
    # the values that mean "not used" are fine
    r = chat(model=model_id, messages=hi, max_tokens=2, response_format={"type": "text"}, tool_choice="none",
             user="someone")
    assert r.usage.completion_tokens == 2


def test_continue_final_message(oai, model_id, base_url):
    """vLLM's continue_final_message: the chat's final message is left open (no end of turn) and the answer
    continues it: the same greedy text as a completion of the prompt /tokenize renders that way."""
    msgs = [{"role": "user", "content": "Count from one."}, {"role": "assistant", "content": "1, 2, 3,"}]
    open_end = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = httpx.post(f"{base_url}/tokenize", json={"messages": msgs, **open_end}, timeout=30).json()["tokens"]
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n1, 2, 3,"), text
    chat = oai.chat.completions.create(model=model_id, messages=msgs, max_tokens=6, temperature=0,
                                       extra_body=open_end)
    completion = oai.completions.create(model=model_id, prompt=tokens, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == len(tokens)
    # without it the final message is closed: another prompt
    closed = httpx.post(f"{base_url}/tokenize", json={"messages": msgs, "add_generation_prompt": False},
                        timeout=30).json()["tokens"]
    assert closed[:len(tokens)] == tokens and len(closed) > len(tokens)
    _bad_request(lambda: oai.chat.completions.create(model=model_id, messages=msgs, extra_body={
        "continue_final_message": True}), "continue_final_message", "add_generation_prompt")
    _bad_request(lambda: oai.chat.completions.create(model=model_id, messages=msgs[:1] + [
        {"role": "assistant", "content": " "}], extra_body=open_end), "continue_final_message", "empty")


def test_stop_string_kept_and_special_tokens_shown_when_asked(oai, model_id):
    """vLLM's include_stop_str_in_output (the stop string ends the text) and skip_special_tokens=false (special
    tokens the model generates are in the text: here <|im_start|>, forced by logit_bias)."""
    full = oai.completions.create(model=model_id, prompt="Once upon", max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:][:3]
    kept = oai.completions.create(model=model_id, prompt="Once upon", max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == full[: full.index(stop) + len(stop)]
    forced = dict(model=model_id, prompt="Once upon", max_tokens=2, temperature=0, logit_bias={"1": 100})
    assert oai.completions.create(**forced).choices[0].text == ""
    shown = oai.completions.create(**forced, extra_body={"skip_special_tokens": False}).choices[0].text
    assert shown == "<|im_start|><|im_start|>"
