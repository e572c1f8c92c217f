"""The HTTP gateway of a deployment (FastAPI, run by uvicorn inside the front process's event loop): MII's REST
route `POST /mii/{deployment_name}`, the OpenAI-compatible API (`mii.serving.openai_api`), `GET /health`,
`GET /metrics`, `POST /tokenize`. It calls the load balancer directly; every error has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response as HTTPResponse

from mii import errors
from mii.serving.balancer import LoadBalancer
from mii.serving.protocol import from_reply, make_request

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


class _BearerAuth:
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


def build_app(lb: LoadBalancer, model: ServedModel, api_key: Optional[str] = None) -> FastAPI:
    from mii.serving import openai_api

    app = FastAPI(title="mii", summary="MII's REST gateway and an OpenAI-compatible API", docs_url="/docs",
                  redoc_url=None)
    app.state.lb, app.state.model = lb, model

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        name = ".".join(loc) or "body"
        if err.get("type") == "json_invalid":
            return APIError(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json").response()
        return APIError(400, f"{name}: {err.get('msg')} (got {err.get('input')!r:.80})", param=name).response()

    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        lb.check()
        if not model.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        if not lb.live:
            return JSONResponse({"status": "unavailable", "replicas": 0}, status_code=503)
        return {"status": "ok", "replicas": len(lb.live)}

    @app.get("/metrics")
    async def metrics():
        body = lb.metrics.render(await lb.stats())
        return HTTPResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request)
        require_ready(model)
        check_model(model, body.get("model"))
        if "messages" in body:
            text = openai_api.render_chat(model, body["messages"], body.get("add_generation_prompt", True))
            ids = model.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            ids = model.tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise APIError(400, "prompt: a string is required (or messages)", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request)
        require_ready(model)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise APIError(400, "tokens: a list of token ids is required", param="tokens")
        return {"prompt": model.tokenizer.decode(tokens)}

    @app.post("/mii/{deployment_name}")
    async def mii_generate(deployment_name: str, request: Request):
        """MII's REST gateway: {"prompts": [...] | "text", ...generation kwargs} → list of responses."""
        if deployment_name != model.deployment_name:
            raise APIError(404, f"no deployment named {deployment_name!r} here (this is {model.deployment_name!r})",
                           type="not_found_error", code="deployment_not_found")
        body = await read_json(request)
        if "prompts" not in body:
            raise APIError(400, "prompts: required (a string or a list of prompts)", param="prompts")
        prompts = body.pop("prompts")
        try:
            from mii.pipeline import normalize_prompts, per_prompt_params

            plist, _ = normalize_prompts(prompts)
            per_prompt_params(body, len(plist))  # typed errors before routing
            reply = await until_disconnect(request, lb.generate(make_request(plist, body)))
        except errors.MIIError as e:
            raise api_error(e) from None
        return [from_reply(r).to_msg_dict() for r in reply.response]

    openai_api.add_routes(app, lb, model)
    return app


def require_ready(model: ServedModel) -> None:
    if not model.ready:
        raise APIError(503, "the model is still loading", type="service_unavailable", code="loading")


def check_model(model: ServedModel, name: Optional[str]) -> None:
    if not model.matches(name):
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{model.name}`)",
                       type="not_found_error", param="model", code="model_not_found")
