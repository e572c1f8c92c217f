"""What the HTTP routes share (MII's REST route in `gateway.py`, the OpenAI API in `openai_api.py`): the served
model's description, errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` (and the status of
each typed mii error), JSON bodies, cancellation when the client goes away, the API key check, and rendering chat
messages through the model's template."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from mii import errors

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

    def matches(self, model: Optional[str]) -> bool:
        return model is None or model == self.name or model in self.aliases


class APIError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(e: Exception, renames: Optional[dict] = None) -> APIError:
    """The HTTP error for a mii error (fields renamed to the API's names, e.g. max_new_tokens → max_tokens)."""
    renames = renames or {}
    if isinstance(e, APIError):
        return e
    if isinstance(e, errors.PromptTooLongError):
        return APIError(400, str(e)[len(e.field) + 2:], param="prompt", code="context_length_exceeded")
    if isinstance(e, errors.ValidationError):
        name = renames.get(e.field, e.field)
        return APIError(400, f"{name}: {str(e)[len(e.field) + 2:]}", param=name)
    if isinstance(e, errors.UnknownArgument):
        return APIError(400, str(e), code="unknown_argument")
    if isinstance(e, (errors.ServerOverloadedError, errors.KVCacheError)):
        return APIError(429, str(e), type="rate_limit_error", code="server_overloaded")
    if isinstance(e, errors.DeploymentUnavailableError):
        return APIError(503, str(e), type="service_unavailable", code="unavailable")
    if isinstance(e, errors.RequestTimeoutError):
        return APIError(504, str(e), type="timeout_error", code="request_timeout")
    log.error("internal error: %s: %s", type(e).__name__, e)
    return APIError(500, f"{type(e).__name__}: {e}", type="internal_error")


async def read_json(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


async def until_disconnect(request: Request, coro):
    """Await `coro`, cancelling it (and so the generation) if the client goes away first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client closed the request", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


class BearerAuth:
    """`Authorization: Bearer <api_key>` on every route but /health (plain ASGI, so that disconnects still reach
    the endpoints)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 type="authentication_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def require_ready(model: ServedModel) -> None:
    if not model.ready:
        raise APIError(503, "the model is still loading", type="service_unavailable", code="loading")


def check_model(model: ServedModel, name: Optional[str]) -> None:
    if not model.matches(name):
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{model.name}`)",
                       type="not_found_error", param="model", code="model_not_found")


def render_chat(model: ServedModel, messages, add_generation_prompt: bool = True) -> str:
    tok = model.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: a non-empty list of {role, content} objects is required", param="messages")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise APIError(400, f"messages[{i}]: must be an object with a role", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        flat.append({**m, "content": content or ""})
    try:
        return tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja errors raised by the template itself (e.g. role order)
        raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
