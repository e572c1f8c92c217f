"""Tool calls in a chat model's output, parsed incrementally: the Hermes / Qwen format (`<tool_call>{json}
</tool_call>`), Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, after an optional `<|python_tag|>`, several
separated by `;`), Mistral (`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`), and the JSON that a
constrained request produces (`tool_choice="required"`: an array of `{"name", "arguments"}`; a named function:
its arguments object).

Every parser is a small state machine fed text pieces (`feed`) and closed once (`finish`); each returns events:
`("content", text)` and `("tool_call", ToolCall)`. The whole-answer parse is the same machine fed the whole text,
so a streamed answer assembles to exactly the non-streamed one, however the text was cut. A call is reported once
it is complete (its name and arguments together); text that only might start a call's markup is held back until
it is known, and text that looked like a call but is not one (bad JSON, no name) comes out as content unchanged.
The one exception is a named function, whose whole answer is its arguments: they are passed on as they come
(`("call_start", name)`, then `("call_arguments", text)` pieces).
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Optional

Event = tuple  # ("content", str) | ("tool_call", ToolCall) | ("call_start", name) | ("call_arguments", str)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON object in a string, as OpenAI sends them."""


def call_id(parser: str) -> str:
    """A tool call id: `call_` + 24 hex digits; Mistral's templates accept only 9 letters or digits."""
    if parser == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held back: it may start it)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class JSONScanner:
    """Finds where the JSON object or array at the start of a growing text ends, reading each character once
    (a long answer that only looks like JSON must not be rescanned at every piece)."""

    def __init__(self):
        self.pos, self.depth, self.in_string, self.escaped = 0, 0, False, False

    def end(self, text: str) -> Optional[int]:
        """Index just past the value that opens at `text[0]`, or None while it is incomplete; `text` is the same
        text as before, grown."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def as_call(obj, need_arguments: bool = False) -> Optional[ToolCall]:
    """A `{"name": str, "arguments" | "parameters": object or JSON-object string}` as a ToolCall, else None.
    `need_arguments`: where the call has no markup around it, a JSON answer that merely has a "name" is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in ("arguments", "parameters") if k in obj), None)
    if key is None and need_arguments:
        return None
    args = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class ToolParser:
    """The base of every format: a text buffer, and content that is not yet known to be content held back."""

    def __init__(self):
        self.buf = ""
        self.done = False

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        self._advance(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._advance(out, final=True)
        if self.buf:
            out.append(("content", self.buf))
            self.buf = ""
        return out

    def _advance(self, out: list[Event], final: bool) -> None:
        raise NotImplementedError


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text (Hermes, Qwen 2.5 / 3, and
    the many templates that copied them); the text around the calls is content. An unterminated call at the end is
    a call if its body is one."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.inside = False

    def _advance(self, out, final):
        while True:
            if not self.inside:
                i = self.buf.find(self.OPEN)
                if i < 0:
                    keep = 0 if final else partial_suffix(self.buf, self.OPEN)
                    _content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return
                _content(out, self.buf[:i])
                self.buf, self.inside = self.buf[i + len(self.OPEN):], True
            j = self.buf.find(self.CLOSE)
            if j < 0 and not final:
                return
            body, closed = (self.buf[:j], True) if j >= 0 else (self.buf, False)
            call = as_call(_loads(body.strip()))
            if call is not None:
                out.append(("tool_call", call))
            else:
                out.append(("content", self.OPEN + body + (self.CLOSE if closed else "")))
            self.buf, self.inside = (self.buf[j + len(self.CLOSE):] if closed else ""), False
            if not closed:
                return


class _LeadingJSON(ToolParser):
    """Formats where the answer is either calls, as JSON right at its start (after an optional marker and
    whitespace), or plain content. Subclasses say what JSON opens the calls and how to read one complete value."""

    MARKER = ""
    OPENS = "{"

    def __init__(self):
        super().__init__()
        self.state = "start"  # start → calls → content

    def _advance(self, out, final):
        if self.state == "start":
            head = self.buf.lstrip()
            if self.MARKER and head.startswith(self.MARKER):
                head = head[len(self.MARKER):].lstrip()
                if not head:
                    return  # the marker is here; the calls are not yet
            elif self.MARKER and not final and self.MARKER.startswith(head):
                return  # empty, or the marker's beginning
            if not head:
                if final:
                    _content(out, self.buf)
                    self.buf = ""
                return
            if head[0] in self.OPENS:
                self.buf, self.state = head, "calls"
            else:
                self.state = "content"
        if self.state == "calls":
            self._calls(out, final)
        if self.state == "content":
            _content(out, self.buf)
            self.buf = ""

    def _calls(self, out, final):
        raise NotImplementedError

    def _not_calls(self):
        """What is left is content from here on."""
        self.state = "content"


class Llama3JSONParser(_LeadingJSON):
    """Llama 3.1 / 3.2 / 3.3 with JSON tool calling: `{"name": ..., "parameters": {...}}` (`arguments` accepted
    too), several separated by `;`, after `<|python_tag|>` when the tokenizer keeps that special token. Text after
    the calls is content; an answer that does not start with a call is all content."""

    MARKER = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.scanner: Optional[JSONScanner] = None  # over self.buf, once it starts with "{"

    def _calls(self, out, final):
        while True:
            if self.scanner is None:
                head = self.buf.lstrip()
                if self.calls and head.startswith(";"):
                    head = head[1:].lstrip()
                if not head:
                    if final:
                        self.buf = ""  # a separator after the last call
                    return
                if head[0] != "{":
                    if self.calls:
                        self.buf = head
                    return self._not_calls()
                self.buf, self.scanner = head, JSONScanner()
            end = self.scanner.end(self.buf)
            if end is None:
                if final:
                    return self._not_calls()
                return
            call = as_call(_loads(self.buf[:end]), need_arguments=True)
            if call is None:
                return self._not_calls()
            out.append(("tool_call", call))
            self.calls += 1
            self.buf, self.scanner = self.buf[end:], None


class JSONArrayParser(_LeadingJSON):
    """A JSON array of `{"name", "arguments"}` at the start of the answer: Mistral's `[TOOL_CALLS][...]` (the
    marker is a special token, so usually not in the text) and the output of `tool_choice="required"`. Text after
    the array is content; an array that is not all calls is content."""

    MARKER = "[TOOL_CALLS]"
    OPENS = "["

    def __init__(self):
        super().__init__()
        self.scanner = JSONScanner()

    def _calls(self, out, final):
        end = self.scanner.end(self.buf)
        if end is None:
            if final:
                self._not_calls()
            return
        items = _loads(self.buf[:end])
        calls = [as_call(x, need_arguments=True) for x in items] if isinstance(items, list) and items else [None]
        if any(c is None for c in calls):
            return self._not_calls()
        out.extend(("tool_call", c) for c in calls)
        self.buf = self.buf[end:]
        self._not_calls()


class NamedArgumentsParser(ToolParser):
    """The output of a request that named its function: the whole answer is that function's arguments (held to
    its schema by the constraint), passed on piece by piece as they come; cut short (finish reason "length"),
    they are not yet a whole JSON object."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.started = False

    def _advance(self, out, final):
        if not self.started and (self.buf or final):
            out.append(("call_start", self.name))
            self.started = True
        if self.buf:
            out.append(("call_arguments", self.buf))
            self.buf = ""


def _content(out: list, text: str) -> None:
    if text:
        out.append(("content", text))


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JSONParser, "mistral": JSONArrayParser}
"""The tool-call formats by the names `--tool-call-parser` takes."""


def detect(chat_template) -> Optional[str]:
    """The tool-call format a chat template renders (its markup in the template's text), or None."""
    text = chat_template if isinstance(chat_template, str) else " ".join((chat_template or {}).values()) \
        if isinstance(chat_template, dict) else ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "tools" in text):
        return "llama3_json"
    return None


def resolve(option: str, chat_template) -> Optional[str]:
    """The parser a deployment uses: `option` ("auto": from the template; "none": no tool calling)."""
    if option == "none":
        return None
    if option == "auto":
        return detect(chat_template)
    if option not in PARSERS:
        raise ValueError(f"tool_call_parser={option!r}: expected auto, none or one of {', '.join(PARSERS)}")
    return option
