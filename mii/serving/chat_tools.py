"""Tool calling and reasoning on `/v1/chat/completions`: the request side (`tools`, `tool_choice`,
`parallel_tool_calls`, `chat_template_kwargs` checked, turned into the chat template's arguments and, for
`tool_choice="required"` or a named function, into a JSON-schema constraint), and the answer side (`ChoiceParser`:
one choice's text split into `reasoning_content`, `content` and `tool_calls`, streamed or whole).

Tools are rendered by the model's own template (the `tools` argument of Hugging Face chat templates). With
`"auto"` the model decides, and its calls are parsed in its format (`mii.serving.tool_parsers`, chosen from the
template or by `--tool-call-parser`). With `"required"` or a named function the engine's constraint holds the
output to a JSON array of calls (or that function's arguments) valid for the tools' parameter schemas, whatever
the template's format, so the answer is always a valid call. `"none"` (the default without tools) renders no tools
and parses nothing.
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
from typing import Optional

from mii.engine.constraints import KINDS
from mii.serving import reasoning, tool_parsers
from mii.serving.http import APIError, render_chat
from mii.serving.schemas import NamedToolChoice, Tool, ToolChoice

__all__ = ["ChatSetup", "ChoiceParser", "NamedToolChoice", "Tool", "ToolChoice", "ToolPlan", "parse_choice", "render"]


def _reserved_template_args() -> frozenset:
    """Names that `apply_chat_template` takes itself (its parameters) or gives the template: not for requests."""
    from transformers import PreTrainedTokenizerBase

    own = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    return frozenset(own | {"messages", "bos_token", "eos_token", "raise_exception", "strftime_now"})


def check_template_kwargs(kwargs: Optional[dict]) -> dict:
    """`chat_template_kwargs`: variables for the template (e.g. `enable_thinking`), none of the names the
    rendering itself sets."""
    reserved = _reserved_template_args()
    for key in kwargs or {}:
        if not key.isidentifier() or key in reserved:
            raise APIError(400, f"chat_template_kwargs.{key}: not a template variable that may be set here",
                           param="chat_template_kwargs")
    return dict(kwargs or {})


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as Hugging Face templates take them: an assistant's `tool_calls[].function.arguments`
    (a JSON string in OpenAI's API) as an object. (Other roles' fields go to the template as they are.)"""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None or m.get("role") != "assistant":
            out.append(m)
            continue
        where = f"messages[{i}].tool_calls"
        if not isinstance(calls, list):
            raise APIError(400, f"{where}: must be a list of calls", param=where)
        fixed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, f"{where}[{j}]: expected {{id, type: function, function: {{name, arguments}}}}",
                               param=f"{where}[{j}]")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args or "{}")
                except ValueError:
                    args = None
            if not isinstance(args, dict):
                raise APIError(400, f"{where}[{j}].function.arguments: must be a JSON object (as a string)",
                               param=f"{where}[{j}].function.arguments")
            fixed.append({**call, "function": {**fn, "arguments": args}})
        out.append({**m, "tool_calls": fixed})
    return out


def render(model, messages: list, add_generation_prompt: bool, tools: Optional[list[Tool]] = None,
           template_kwargs: Optional[dict] = None, continue_final: bool = False) -> str:
    """Chat messages (`schemas.ChatMessage`s) as the model's template writes them, with these tools and template
    variables (chat completions and /tokenize); `continue_final`: the final message left open (render_chat)."""
    return render_chat(model, template_messages([m.model_dump(exclude_none=True) for m in messages]),
                       add_generation_prompt, [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                       check_template_kwargs(template_kwargs), continue_final)


@functools.lru_cache(maxsize=8)
def _template_variables(source: str) -> frozenset:
    import jinja2
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source)))
    except jinja2.TemplateError:
        return frozenset()


def renders_tools(chat_template) -> bool:
    """Whether a chat template (or one of a tokenizer's named templates) reads the `tools` variable."""
    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return any("tools" in _template_variables(str(s)) for s in sources)


def check_renders_tools(chat_template) -> None:
    """A 400 naming `tools` where the chat template does not render them (chat completions and /tokenize)."""
    if not renders_tools(chat_template):
        raise APIError(400, "tools: this model's chat template does not render tools", param="tools")


class ToolPlan:
    """What a chat request's tools mean for its rendering, its constraint and the parsing of its answer."""

    def __init__(self, tools: Optional[list[Tool]], choice: Optional[ToolChoice], parallel: Optional[bool],
                 parser: Optional[str], chat_template):
        self.tools = tools or []
        self.parallel = True if parallel is None else parallel
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice != "none" and not self.tools:
            raise APIError(400, "tool_choice: only allowed when tools are given", param="tool_choice")
        names = [t.function.name for t in self.tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise APIError(400, f"tools: two functions are named {dup!r}", param="tools")
        for i, t in enumerate(self.tools):
            _check_parameters(t.function.parameters, f"tools[{i}].function.parameters")
        self.named: Optional[str] = None
        if isinstance(choice, NamedToolChoice):
            self.named = choice.function.name
            if self.named not in names:
                raise APIError(400, f"tool_choice: no tool is named {self.named!r} (tools: {', '.join(names)})",
                               param="tool_choice")
        self.choice = "named" if self.named else choice
        self.parser = parser
        if self.choice != "none":
            check_renders_tools(chat_template)
        if self.choice == "auto" and parser is None:
            raise APIError(400, "tools: the server knows no tool-call format for this model's chat template; start "
                           "it with --tool-call-parser (hermes, llama3_json or mistral), or use "
                           "tool_choice='required' or a named function", param="tools")

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def json_schema(self) -> Optional[dict]:
        """The constraint on the output: a named function's arguments, or an array of calls for "required"."""
        if self.choice == "named":
            return _parameters(next(t for t in self.tools if t.function.name == self.named))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def parser_for_answer(self) -> Optional[tool_parsers.ToolParser]:
        if self.choice == "named":
            return tool_parsers.NamedArgumentsParser(self.named)
        if self.choice == "required":
            return tool_parsers.JSONArrayParser()
        if self.choice == "auto":
            return tool_parsers.PARSERS[self.parser]()
        return None

    @property
    def id_style(self) -> str:
        return self.parser or ""


def _parameters(tool: Tool) -> dict:
    """A tool's arguments schema for the constraint: always of an object (OpenAI's arguments are one)."""
    return {"type": "object", **(tool.function.parameters or {"properties": {}})}


def _check_parameters(schema: Optional[dict], where: str) -> None:
    if schema is None:
        return
    import jsonschema

    try:  # against one meta-schema whatever "$schema" says (an odd one broke validator_for)
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise APIError(400, f"{where}: not a valid JSON Schema: {e.message}", param=where) from None
    if schema.get("type", "object") != "object":
        raise APIError(400, f"{where}: must be a schema of type object (got type {schema.get('type')!r})",
                       param=where)


class ChoiceParser:
    """One choice's answer as OpenAI's message: `feed` each text piece (`final` with the last) and get the delta
    (`reasoning_content`, `content`, `tool_calls` with index, id, type and function {name, arguments}); `message()`
    is the whole answer. Streamed deltas join to exactly `message()`, however the text was cut."""

    def __init__(self, tools: Optional[ToolPlan] = None, reasoning_on: bool = False, in_think: bool = False):
        self.think = reasoning.ThinkParser(in_think) if reasoning_on else None
        self.tools = tools.parser_for_answer() if tools is not None else None
        self.parallel = tools.parallel if tools is not None else True
        self.id_style = tools.id_style if tools is not None else ""
        self.reasoning, self.content, self.calls = [], [], []
        self.blank = ""  # trailing whitespace of the content, held while calls may follow (then dropped)

    @property
    def parses(self) -> bool:
        """Whether the answer is parsed at all (else all of it is content)."""
        return self.think is not None or self.tools is not None

    def feed(self, text: str, final: bool = False) -> dict:
        if self.think is None:
            events = [("content", text)] if text else []
        else:
            events = self.think.feed(text) + (self.think.finish() if final else [])
        return self._delta(self._route(events, final))

    def _route(self, events, final: bool) -> list:
        if self.tools is None:
            return events
        out = []
        for kind, text in events:
            out.extend(self.tools.feed(text) if kind == "content" else [(kind, text)])
        if final:
            out.extend(self.tools.finish())
        return self._gate(out, final)

    def _gate(self, events, final: bool) -> list:
        """Content's trailing whitespace waits for more content: dropped if the answer ends after tool calls."""
        out = []
        for kind, value in events:
            if kind != "content":
                out.append((kind, value))
                continue
            text = self.blank + value
            body = text.rstrip()
            self.blank = text[len(body):]
            if body:
                out.append(("content", body))
        if final and self.blank:
            if not self.calls and not any(k == "tool_call" for k, _ in out):
                out.append(("content", self.blank))
            self.blank = ""
        return out

    def _delta(self, events) -> dict:
        delta: dict = {}
        for kind, value in events:
            if kind in ("tool_call", "call_start"):
                if self.calls and not self.parallel:
                    continue  # parallel_tool_calls=false: the first call only
                name, arguments = (value.name, value.arguments) if kind == "tool_call" else (value, "")
                call = {"index": len(self.calls), "id": tool_parsers.call_id(self.id_style), "type": "function",
                        "function": {"name": name, "arguments": arguments}}
                self.calls.append(call)
                delta.setdefault("tool_calls", []).append(copy.deepcopy(call))
            elif kind == "call_arguments":  # more of the last call's arguments
                self.calls[-1]["function"]["arguments"] += value
                pieces = delta.setdefault("tool_calls", [])
                if pieces and pieces[-1]["index"] == self.calls[-1]["index"]:
                    pieces[-1]["function"]["arguments"] += value
                else:
                    pieces.append({"index": self.calls[-1]["index"], "function": {"arguments": value}})
            else:
                key = "reasoning_content" if kind == "reasoning" else "content"
                (self.reasoning if kind == "reasoning" else self.content).append(value)
                delta[key] = delta.get(key, "") + value
        return delta

    def message(self) -> dict:
        """The whole answer so far as an assistant message."""
        content = "".join(self.content)
        msg: dict = {"role": "assistant",
                     "content": content if content or not (self.calls or self.reasoning) else None}
        if self.think is not None:
            msg["reasoning_content"] = "".join(self.reasoning) or None
        if self.calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        return msg

    def finish_reason(self, engine_reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason


class ChatSetup:
    """A chat request's rendering (tools and template variables in the template) and the parsing of its answers."""

    def __init__(self, model, req):
        tok = model.tokenizer
        self.tools = ToolPlan(req.tools, req.tool_choice, req.parallel_tool_calls, model.tool_call_parser,
                              getattr(tok, "chat_template", None))
        self.prompt = render(model, req.messages, req.add_generation_prompt,
                             self.tools.tools if self.tools.active else None, req.chat_template_kwargs,
                             req.continue_final_message)
        self.reasoning_on = model.reasoning_parser is not None
        self.in_think = reasoning.starts_thinking(self.prompt)

    def engine_kwargs(self) -> dict:
        """What the tools add to the generation arguments: the constraint of "required" or a named function."""
        schema = self.tools.json_schema()
        return {} if schema is None else {"json_schema": schema}

    def parser(self, engine_kwargs: dict) -> ChoiceParser:
        # a constrained answer (tools' or response_format's) is that text from its first token: no thinking in it;
        # and one held to response_format's schema is no tool call, whatever its JSON looks like
        constrained = any(k in engine_kwargs for k in KINDS)
        tools = self.tools if self.tools.active and (self.tools.constrained or not constrained) else None
        return ChoiceParser(tools, self.reasoning_on and not constrained, self.in_think)


def parse_choice(text: str, tools: Optional[ToolPlan] = None, reasoning_on: bool = False,
                 in_think: bool = False) -> dict:
    """A whole answer as an assistant message (the same machine as streaming, fed in one piece)."""
    p = ChoiceParser(tools, reasoning_on, in_think)
    p.feed(text, final=True)
    return p.message()

