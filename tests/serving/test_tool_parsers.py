"""Tool-call and reasoning parsers on fixed model outputs, for each format; streamed in arbitrary chunkings (every
split into two, one character at a time, and random pieces of 1-3 characters) they give the non-streamed answer."""
import json
import random

import pytest

from mii.serving import reasoning, tool_parsers
from mii.serving.chat_tools import ChoiceParser, NamedToolChoice, Tool, ToolPlan, parse_choice

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})
         for n in ("get_weather", "get_time")]
TEMPLATE = "{% for t in tools %}{{ t }}{% endfor %}"  # a template that renders tools (the plan checks it does)


def plan(parser: str, parallel=True) -> ToolPlan:
    return ToolPlan(TOOLS, "auto", parallel, parser, TEMPLATE)


def calls(message: dict) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


CASES = [  # (parser, in_think, reasoning on, text, expected reasoning, content, calls)
    ("hermes", False, False,
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     None, "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("hermes", False, False, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',
     None, None, [("get_weather", {"city": "Oslo"})]),  # arguments as a string, unterminated block
    ("hermes", False, False, "a < b, <tool and <tool_call>{not json}</tool_call> end",
     None, "a < b, <tool and <tool_call>{not json}</tool_call> end", []),
    ("hermes", False, False, "no calls here, trailing blanks  \n", None, "no calls here, trailing blanks  \n", []),
    ("hermes", False, False, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>\n after',
     None, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>\n after', []),  # arguments not an object
    ("llama3_json", False, False,
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "note": "a } and a \\" inside"}}; '
     '{"name": "get_time", "parameters": {}}',
     None, None, [("get_weather", {"city": "Rome", "note": 'a } and a " inside'}), ("get_time", {})]),
    ("llama3_json", False, False, ' {"name": "get_time", "arguments": {"tz": "UTC"}} and some words',
     None, "and some words", [("get_time", {"tz": "UTC"})]),
    ("llama3_json", False, False, '{"name": "get_time", "parameters": {}};', None, None, [("get_time", {})]),
    ("llama3_json", False, False, "The weather is {sunny}.", None, "The weather is {sunny}.", []),
    ("llama3_json", False, False, '{"answer": 42}', None, '{"answer": 42}', []),
    ("llama3_json", False, False, '{"name": "Alice", "age": 3}', None, '{"name": "Alice", "age": 3}', []),  # data
    ("mistral", False, False, '[{"name": "Alice"}]', None, '[{"name": "Alice"}]', []),
    ("mistral", False, False,
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "get_time", "arguments": {}}]',
     None, None, [("get_weather", {"city": "Lima"}), ("get_time", {})]),
    ("mistral", False, False, '[{"name": "get_time", "arguments": {"tz": "PST"}}]', None, None,
     [("get_time", {"tz": "PST"})]),  # [TOOL_CALLS] is a special token: usually not in the text
    ("mistral", False, False, "[1, 2, 3] are numbers", None, "[1, 2, 3] are numbers", []),
    ("mistral", False, False, "Sure: [TOOL_CALLS] is a marker", None, "Sure: [TOOL_CALLS] is a marker", []),
    (None, False, True, "<think>\nHmm, 2 + 2.\n</think>\n\nIt is 4.", "\nHmm, 2 + 2.\n", "It is 4.", []),
    (None, True, True, "Hmm, Paris</think>Paris.", "Hmm, Paris", "Paris.", []),  # the prompt opened <think>
    (None, True, True, "still thinking when the tokens ran out", "still thinking when the tokens ran out", None, []),
    (None, False, True, "No thinking: <think> is text here.", None, "No thinking: <think> is text here.", []),
    (None, False, True, "  <thin", None, "  <thin", []),
    ("hermes", False, True,
     '<think>I should call it.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Kyiv"}}'
     '</tool_call>', "I should call it.", None, [("get_weather", {"city": "Kyiv"})]),
]


def _stream(text: str, pieces: list[int], make) -> dict:
    """Feed `text` cut at `pieces` lengths; the deltas assembled as the openai client does."""
    p = make()
    out = {"reasoning_content": "", "content": "", "tool_calls": []}
    i = 0
    for k, n in enumerate(pieces):
        delta = p.feed(text[i:i + n], final=k == len(pieces) - 1)
        i += n
        out["reasoning_content"] += delta.get("reasoning_content", "")
        out["content"] += delta.get("content", "")
        out["tool_calls"] += delta.get("tool_calls", [])
    assert i == len(text)
    assert [c["index"] for c in out["tool_calls"]] == list(range(len(out["tool_calls"])))
    return out


def _chunkings(text: str):
    n = len(text)
    yield [n]
    yield [1] * n
    for cut in range(1, n):
        yield [cut, n - cut]
    rng = random.Random(n)
    for _ in range(30):
        pieces, left = [], n
        while left:
            pieces.append(min(left, rng.randint(1, 3)))
            left -= pieces[-1]
        yield pieces


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3][:24]}")
def test_fixed_outputs_whole_and_streamed(case):
    parser, in_think, think, text, want_reasoning, want_content, want_calls = case
    tools = plan(parser) if parser else None
    message = parse_choice(text, tools, think, in_think)
    assert message.get("reasoning_content") == want_reasoning
    assert message["content"] == want_content
    assert calls(message) == want_calls
    assert all(c["id"].startswith("call_") or parser == "mistral" for c in message.get("tool_calls", []))

    def make():
        return ChoiceParser(tools, think, in_think)

    for pieces in _chunkings(text):
        got = _stream(text, pieces, make)
        assert (got["reasoning_content"] or None) == message.get("reasoning_content"), pieces
        assert (got["content"] or None) == (message["content"] or None), pieces
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got["tool_calls"]] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])], pieces


def test_finish_reason_and_parallel_tool_calls():
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "get_time", ' \
           '"arguments": {}}</tool_call>'
    p = ChoiceParser(plan("hermes", parallel=False))
    delta = p.feed(text, final=True)
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["get_weather"]
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    plain = ChoiceParser(plan("hermes"))
    plain.feed("hello", final=True)
    assert plain.finish_reason("stop") == "stop"


def test_constrained_outputs():
    """What tool_choice="required" (an array of calls) and a named function (its arguments) produce."""
    required = ToolPlan(TOOLS, "required", None, None, TEMPLATE)
    assert calls(parse_choice('[{"name": "get_time", "arguments": {"tz": "UTC"}}]', required)) == \
        [("get_time", {"tz": "UTC"})]
    schema = required.json_schema()
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [x["properties"]["name"]["const"] for x in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert ToolPlan(TOOLS, "required", False, None, TEMPLATE).json_schema()["maxItems"] == 1
    named = ToolPlan(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}}),
                     None, None, TEMPLATE)
    assert named.json_schema() == {"type": "object"}
    msg = parse_choice('{"tz": "UTC"}', named)
    assert calls(msg) == [("get_time", {"tz": "UTC"})] and msg["content"] is None
    cut = parse_choice('{"tz": "UT', named)  # by max_tokens: OpenAI's answer too is then a call cut short
    assert cut["content"] is None
    assert cut["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UT'}
    p = ChoiceParser(named)  # the arguments stream as they come
    deltas = [p.feed(piece, final=piece == "}") for piece in ('{"tz"', ': "UTC"', "}")]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz"'}
    assert [d["tool_calls"] for d in deltas[1:]] == [[{"index": 0, "function": {"arguments": ': "UTC"'}}],
                                                     [{"index": 0, "function": {"arguments": "}"}}]]
    assert p.message()["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'


def test_formats_detected_from_templates():
    assert tool_parsers.detect("...<tool_call>\n{{ tool_call | tojson }}\n</tool_call>...") == "hermes"
    assert tool_parsers.detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_parsers.detect("<|start_header_id|>ipython{% if tools %}") == "llama3_json"
    assert tool_parsers.detect("{{ message.content }}") is None
    assert tool_parsers.resolve("none", "<tool_call>") is None
    assert tool_parsers.resolve("mistral", "") == "mistral"
    assert reasoning.resolve("auto", "{{ content.split('</think>')[-1] }}") == "think"
    assert reasoning.resolve("auto", "{{ content }}") is None
    assert reasoning.resolve("deepseek_r1", "") == "think" and reasoning.resolve("none", "</think>") is None
    assert reasoning.starts_thinking("<|im_start|>assistant\n<think>\n")
    assert not reasoning.starts_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
