"""The HTTP gateway of a deployment (FastAPI, run by uvicorn inside the front process's event loop): MII's REST
route `POST /mii/{deployment_name}`, the OpenAI-compatible API (`mii.serving.openai_api`), `GET /health`,
`GET /metrics`, `POST /tokenize`. It calls the load balancer directly; every error has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` (`mii.serving.http`). Generation arguments are not checked
here: the replica validates each request once, and its typed errors come back as HTTP errors.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response as HTTPResponse

from mii import errors
from mii.engine.requests import encode_prompt, normalize_prompts
from mii.serving import openai_api
from mii.serving.balancer import LoadBalancer
from mii.serving.http import (APIError, BearerAuth, ServedModel, api_error, check_model, read_json, render_chat,
                              require_ready, until_disconnect)
from mii.serving.protocol import make_request


def build_app(lb: LoadBalancer, model: ServedModel, api_key: Optional[str] = None) -> FastAPI:
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
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        lb.check()
        if not model.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        if not lb.live:
            return JSONResponse({"status": "unavailable", "replicas": 0, "configured": lb.expected}, status_code=503)
        if lb.draining:
            return JSONResponse({"status": "stopping", "replicas": len(lb.live)}, status_code=503)
        # degraded: still serving (200), with fewer replicas than configured while the dead ones restart
        return {"status": "degraded" if lb.degraded else "ok", "replicas": len(lb.live), "configured": lb.expected}

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
            text = render_chat(model, body["messages"], body.get("add_generation_prompt", True))
            ids = encode_prompt(model.tokenizer, text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            ids = encode_prompt(model.tokenizer, body["prompt"], bool(body.get("add_special_tokens", True)))
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
            plist, _ = normalize_prompts(prompts)
            responses = await until_disconnect(request, lb.generate(make_request(plist, body)))
        except errors.MIIError as e:
            raise api_error(e) from None
        return [r.to_msg_dict() for r in responses]

    openai_api.add_routes(app, lb, model)
    return app


