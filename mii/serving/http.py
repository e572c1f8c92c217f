"""What the HTTP routes share (MII's REST route in `gateway.py`, the OpenAI API in `openai_api.py`): the served
model's description, errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` for every status
(FastAPI's own 404/405/422 and unexpected exceptions included: a 500 says only that it is internal, the detail
goes to the log), strict JSON bodies of bounded size, cancellation when the client goes away, and rendering chat
messages through the model's template."""
from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from mii import errors
from mii.engine.requests import chat_messages
from mii.serving.auth import key_matches

log = logging.getLogger("mii")


@dataclass
class ServedModel:
    """What the gateway knows of the model; filled in once the first replica is up."""

    name: str
    deployment_name: str
    tokenizer: Any = None
    max_context: int = 0
    ready: bool = False
    aliases: set = field(default_factory=set)
    tool_call_parser: Optional[str] = None
    """The format of the model's tool calls (`mii.serving.tool_parsers.PARSERS`); None: only tool_choice
    "required" or a named function (constrained output) can call tools."""
    reasoning_parser: Optional[str] = None
    """The format of the model's reasoning (`mii.serving.reasoning.PARSERS`); None: none is split off."""
    plans: dict = field(default_factory=dict)
    """Each replica's engine plan (index → {"pid", "plan": `EnginePlan.as_dict()`}), as its process reported when
    ready."""

    def matches(self, model: Optional[str]) -> bool:
        return model is None or model == self.name or model in self.aliases


class APIError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.counted = False  # already in mii_request_errors_total (the load balancer counted its mii error)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(e: Exception, renames: Optional[dict] = None) -> APIError:
    """The HTTP error for a mii error (fields renamed to the API's names, e.g. max_new_tokens → max_tokens)."""
    if isinstance(e, APIError):
        return e
    err = _error_for(e, renames or {})
    err.counted = getattr(e, "counted", False)
    return err


def _error_for(e: Exception, renames: dict) -> APIError:
    if isinstance(e, errors.PromptTooLongError):
        return APIError(400, str(e)[len(e.field) + 2:], param="prompt", code="context_length_exceeded")
    if isinstance(e, errors.ValidationError):
        base, index = re.match(r"([^\[]*)(.*)", e.field).groups()  # (`prompts[1]` → `prompt[1]`)
        name = renames.get(e.field, renames.get(base, base) + index)
        message = str(e)[len(e.field) + 2:]
        for engine_name, api_name in renames.items():  # other parameters the message names, by the API's names too
            if "_" in engine_name:  # (identifiers such as max_new_tokens, not words such as "prompts")
                message = re.sub(rf"\b{engine_name}\b", api_name, message)
        return APIError(400, f"{name}: {message}", param=name)
    if isinstance(e, errors.UnknownArgument):
        return APIError(400, str(e), code="unknown_argument")
    if isinstance(e, (errors.ServerOverloadedError, errors.KVCacheError)):
        return APIError(429, str(e), type="rate_limit_error", code="server_overloaded")
    if isinstance(e, errors.DeploymentUnavailableError):
        return APIError(503, str(e), type="service_unavailable", code="unavailable")
    if isinstance(e, errors.RequestTimeoutError):
        return APIError(504, str(e), type="timeout_error", code="request_timeout")
    return internal_error(e)


def internal_error(e: BaseException) -> APIError:
    """A 500 that says nothing of the exception; its detail and traceback go to the log."""
    log.error("internal error: %s: %s", type(e).__name__, e, exc_info=e)
    return APIError(500, "internal server error (the server's log has the details)", type="internal_error",
                    code="internal_error")


_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


# the `kind` of mii_request_errors_total an HTTP error counts under (the load balancer's kinds: mii.serving.balancer);
# none for a refused key (401), a route or model that is not here (404) and a wrong method (405)
ERROR_KINDS = {400: "invalid", 413: "invalid", 429: "overloaded", 500: "internal", 503: "unavailable", 504: "timeout"}


def install_error_handlers(app: FastAPI, count: Optional[Callable[[str], None]] = None) -> None:
    """Every error of `app` in OpenAI's shape: ours, FastAPI's validation (422 → 400 naming the field), Starlette's
    own (404 no such route, 405 wrong method, 400 unreadable body) and any exception a route did not expect.
    `count(kind)`: told of each error answered here that the load balancer did not count (a request refused before
    it reached a replica), by ERROR_KINDS."""

    def answer(error: APIError):
        if count is not None and not error.counted and error.status in ERROR_KINDS:
            count(ERROR_KINDS[error.status])
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return answer(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return answer(APIError(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json"))
        name = field_name(err.get("loc", ()))
        return answer(APIError(400, f"{name}: {err.get('msg')}", param=name))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
                   f"{request.url.path}"}.get(e.status_code, str(e.detail))
        response = answer(APIError(e.status_code, message,
                                   type=_STATUS_TYPES.get(e.status_code, "invalid_request_error")))
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(ClientDisconnect)
    async def _gone(request, e: ClientDisconnect):  # the client left before its body was read: no one to answer
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        return answer(internal_error(e))


def _no_constant(name: str):
    raise APIError(400, f"malformed JSON body: {name} is not a JSON number (numbers must be finite)",
                   code="invalid_json")


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no lone UTF-16 surrogates (escaped `\\ud800`), bounded nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8 (byte {e.start})", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if _ESCAPED_SURROGATE.search(text):  # a pair joins into one character; a lone half cannot be encoded
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "malformed JSON body: a string has a lone UTF-16 surrogate", code="invalid_json") \
                from None
    return body


async def read_json(request: Request) -> dict:
    """The request's JSON object (whatever its Content-Type: `curl -d` sends form-encoded)."""
    body = parse_json(await request.body() or b"null")
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


class BodyLimit:
    """Refuse request bodies over `max_bytes` with 413: at once from Content-Length, else while it is read."""

    def __init__(self, app, max_bytes: int, count: Optional[Callable[[str], None]] = None):
        self.app, self.max_bytes, self.count = app, max_bytes, count

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes (max_request_bytes)",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            if self.count is not None:  # (answered here, before the app's handlers)
                self.count(ERROR_KINDS[413])
            return await self._error().response()(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()  # answered by the app's APIError handler
            return message

        await self.app(scope, limited, send)


async def until_disconnect(request: Request, coro):
    """Await `coro`, cancelling it (and so the generation) as soon as the client goes away: the request's body
    has been read, so the next ASGI message is the disconnect. (Asked again every 0.5 s: a byte after the body, a
    stray CRLF or a pipelined request, pauses uvicorn's reading until `receive` is called again.)"""
    async def gone():
        while True:
            try:
                if (await asyncio.wait_for(request.receive(), 0.5))["type"] == "http.disconnect":
                    return
            except asyncio.TimeoutError:
                pass

    task, watcher = asyncio.ensure_future(coro), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "client closed the request", code="client_closed")
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()


class HTTPKeyCheck:
    """The API key on every HTTP route but the open ones (plain ASGI, so that disconnects still reach the
    endpoints)."""

    def __init__(self, app, api_key: str, open_paths: frozenset):
        self.app, self.key, self.open_paths = app, api_key.encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            if not key_matches(dict(scope["headers"]).get(b"authorization"), self.key):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 type="authentication_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def open_http_paths(metrics_need_key: bool, chat_ui: bool = False) -> frozenset:
    paths = {"/health"} if metrics_need_key else {"/health", "/metrics"}
    return frozenset(paths | {"/"} if chat_ui else paths)  # the chat page asks for the key itself


def require_ready(model: ServedModel) -> None:
    if not model.ready:
        raise APIError(503, "the model is still loading", type="service_unavailable", code="loading")


def check_model(model: ServedModel, name: Optional[str]) -> None:
    if not model.matches(name):
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{model.name}`)",
                       type="not_found_error", param="model", code="model_not_found")


def parse_body(cls: type[BaseModel], body: dict):
    """A JSON object as `cls`, strictly (no "3" for 3, no 1 for true); a 400 naming the first bad field."""
    try:
        return cls.model_validate(body, strict=True)
    except ValidationError as e:
        # a union reports one error per member: the one past a type mismatch says what is wrong, else the deepest
        # (the member whose outer shape fits: `stop[2]` for ["a", "b", 5], not `stop`)
        errs = e.errors()
        err = next((x for x in errs if not x["type"].endswith("_type")), max(errs, key=lambda x: len(x["loc"])))
        name = field_name(err.get("loc", ()))
        got = f" (got {err['input']!r:.80})" if err.get("type") != "missing" else ""
        raise APIError(400, f"{name}: {err.get('msg')}{got}", param=name) from None


def field_name(loc) -> str:
    """A pydantic error location as the API names the field: `messages[0].content` (union members' tags, such as
    `str` or `list[int]`, and a tagged union's tag, such as response_format's `json_schema`, left out)."""
    name, last = "", None
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in _UNION_TAGS.get(last, ()):
            last = None  # (the member's own field of the same name, `json_schema.json_schema`, is kept)
            continue
        elif part.isidentifier() and part not in _TYPE_TAGS:
            name += f".{part}" if name else part
        last = part
    return name or "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "body"}
_UNION_TAGS = {"response_format": {"text", "json_object", "json_schema"}}  # field → its members' `type` tags


def check_token_ids(model: ServedModel, prompt, field: str) -> None:
    """Token ids that the gateway itself decodes must be in the tokenizer's vocabulary."""
    if isinstance(prompt, str):
        return
    vocab = len(model.tokenizer)
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{field}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=field)


def render_chat(model: ServedModel, messages, add_generation_prompt: bool = True, tools: Optional[list] = None,
                template_kwargs: Optional[dict] = None, continue_final: bool = False) -> str:
    """Chat messages as text through the model's template; a 400 naming the message for anything else than text
    content, and for a chat with nothing to say (no message, or every content empty or whitespace). `tools` (OpenAI's
    function definitions) and `template_kwargs` (e.g. `enable_thinking`) are passed on to the template.
    `continue_final` (vLLM's continue_final_message): the final message left open, without its end of turn, for
    the model to continue (an assistant's answer begun by the caller); not with `add_generation_prompt`."""
    tok = model.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        flat = chat_messages(messages)
    except errors.ValidationError as e:
        raise APIError(400, str(e), param=e.field) from None
    if continue_final and add_generation_prompt:
        raise APIError(400, "continue_final_message: continues the final message, so add_generation_prompt (a new "
                       "assistant turn, true by default) must be false", param="continue_final_message")
    if continue_final and not flat[-1]["content"].strip():
        raise APIError(400, f"continue_final_message: the final message (messages[{len(flat) - 1}]) is empty, "
                       "nothing to continue", param="continue_final_message")
    try:
        return tok.apply_chat_template(flat, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final, **(template_kwargs or {}))
    except Exception as e:  # jinja errors raised by the template itself (e.g. role order)
        raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None


# --- /openapi.json -----------------------------------------------------------------------------------------------

_ERRORS = {400: "invalid request (the error names the field)", 401: "missing or wrong API key",
           404: "no such model or deployment", 413: "request body too large", 429: "the queue is full (Retry-After)",
           500: "internal error", 503: "loading, stopping or no replica (Retry-After)"}


_SSE_EVENT = {"type": "object", "required": ["data"], "description": "one server-sent event", "properties": {
    "data": {"type": "string", "description": "a JSON chunk (the answer's shape, with deltas), an error in OpenAI's "
                                              "shape, or [DONE] (the last event)"},
    "event": {"type": "string"}}}


def documented(answer=None, body: Optional[type[BaseModel]] = None, stream: bool = False,
               responses: Optional[dict] = None) -> dict:
    """FastAPI route arguments that describe a route in /openapi.json: its JSON body (read by the route itself,
    with `read_json`), its answer (`text/event-stream` too when it can stream), its errors in OpenAI's shape, and
    `responses` over those."""
    from mii.serving.schemas import ErrorResponse

    out: dict = {"responses": {code: {"model": ErrorResponse, "description": why} for code, why in _ERRORS.items()}}
    out["responses"]["default"] = {"model": ErrorResponse, "description": "any other error"}
    if answer is not None:
        out["responses"][200] = {"model": answer}
        if stream:
            out["responses"][200]["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    out["responses"].update(responses or {})
    if body is not None:
        schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
        out["openapi_extra"] = {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body.__name__}", "x-mii-schema": schema}}}}}
    return out


def install_openapi(app: FastAPI) -> None:
    """/openapi.json with the bodies of `documented` routes among its components, and without FastAPI's 422 (a
    validation error is a 400 here)."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = base()
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        for path in spec.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
                content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
                schema = content.get("schema", {}).pop("x-mii-schema", None)
                if schema is not None:
                    components.update(schema.pop("$defs", {}))
                    components[content["schema"]["$ref"].rsplit("/", 1)[1]] = schema
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = spec
        return spec

    app.openapi = openapi
