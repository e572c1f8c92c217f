"""The HTTP gateway of a deployment (FastAPI, run by uvicorn inside the front process's event loop): MII's REST
route `POST /mii/{deployment_name}`, the OpenAI-compatible API (`mii.serving.openai_api`), `GET /health`,
`GET /metrics`, `POST /tokenize`, `POST /detokenize`, `GET /engine_plan` (each replica's engine plan), the chat
page at `GET /` (`mii.serving.ui`, unless `chat_ui=False`), and `/openapi.json` describing them all. It calls the load
balancer directly; every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`
(`mii.serving.http`), bodies are strict JSON of at most `max_request_bytes`, and with an API key every route but
/health (and /metrics unless `metrics_need_key`) needs it (`mii.serving.auth`). Generation arguments are not
checked here: the replica validates each request once, and its typed errors come back as HTTP errors.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response as HTTPResponse

import mii
from mii import errors
from mii.config import MIIConfig
from mii.engine.requests import encode_prompt, normalize_prompts
from mii.serving import chat_tools, openai_api, schemas, ui
from mii.serving.balancer import LoadBalancer
from mii.serving.http import (APIError, BodyLimit, HTTPKeyCheck, ServedModel, api_error, check_model,
                              check_token_ids, documented, install_error_handlers,
                              install_openapi, open_http_paths, parse_body, read_json, require_ready,
                              until_disconnect)
from mii.serving.protocol import make_request

def build_app(lb: LoadBalancer, model: ServedModel, api_key: Optional[str] = None, metrics_need_key: bool = False,
              max_request_bytes: int = MIIConfig.model_fields["max_request_bytes"].default,
              chat_ui: bool = False) -> FastAPI:
    app = FastAPI(title="mii", summary="MII's REST gateway and an OpenAI-compatible API", docs_url="/docs",
                  redoc_url=None)
    app.state.lb, app.state.model = lb, model

    def count(kind: str) -> None:  # a request refused here, before the load balancer (which counts its own)
        lb.metrics.errors.labels(kind).inc()

    install_error_handlers(app, count)
    install_openapi(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, count=count)
    if api_key:  # added last: it runs first, so a request without the key is refused before its body is read
        app.add_middleware(HTTPKeyCheck, api_key=api_key, open_paths=open_http_paths(metrics_need_key, chat_ui))

    @app.get("/health", **documented(schemas.Health, responses={503: {"model": schemas.Health}}))
    async def health():
        lb.check()
        if not model.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        if not lb.live:
            return JSONResponse({"status": "unavailable", "replicas": 0, "configured": lb.expected, "nodes": {}},
                                status_code=503)
        if lb.draining:
            return JSONResponse({"status": "stopping", "replicas": len(lb.live), "nodes": lb.nodes()},
                                status_code=503)
        # degraded: still serving (200), with fewer replicas than configured while the dead ones restart
        return {"status": "degraded" if lb.degraded else "ok", "replicas": len(lb.live), "configured": lb.expected,
                "nodes": lb.nodes()}

    @app.get("/metrics", response_class=HTTPResponse, **documented(responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}}))
    async def metrics():
        body = lb.metrics.render(await lb.stats())
        return HTTPResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version", **documented(schemas.Version))
    async def version():
        """mii's version (vLLM's server answers the same route)."""
        return {"version": mii.__version__}

    @app.get("/engine_plan", **documented(schemas.EnginePlans))
    async def engine_plan():
        """What `mii explain` shows, for each replica of this deployment."""
        require_ready(model)
        return {"model": model.name, "deployment": model.deployment_name,
                "replicas": [{"replica": i, **p} for i, p in sorted(model.plans.items()) if p["plan"]]}

    @app.post("/tokenize", **documented(schemas.TokenizeResponse, schemas.TokenizeRequest))
    async def tokenize(request: Request):
        body = parse_body(schemas.TokenizeRequest, await read_json(request))
        require_ready(model)
        check_model(model, body.model)
        if body.messages is not None and body.prompt is not None:
            raise APIError(400, "prompt: give either prompt or messages, not both", param="prompt")
        if body.messages is None:  # the chat-only fields would be ignored
            extra = next((f for f in ("tools", "chat_template_kwargs") if getattr(body, f) is not None), None)
            if extra:
                raise APIError(400, f"{extra}: only with messages", param=extra)
        if body.tools:
            chat_tools.check_renders_tools(getattr(model.tokenizer, "chat_template", None))
        if body.messages is not None:
            text = chat_tools.render(model, body.messages, body.add_generation_prompt, body.tools,
                                     body.chat_template_kwargs, body.continue_final_message)
            ids = encode_prompt(model.tokenizer, text, add_special_tokens=False)
        elif body.prompt is not None:
            ids = encode_prompt(model.tokenizer, body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "prompt: a string is required (or messages)", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_context}

    @app.post("/detokenize", **documented(schemas.DetokenizeResponse, schemas.DetokenizeRequest))
    async def detokenize(request: Request):
        body = parse_body(schemas.DetokenizeRequest, await read_json(request))
        require_ready(model)
        check_model(model, body.model)
        check_token_ids(model, body.tokens, "tokens")
        return {"prompt": model.tokenizer.decode(body.tokens)}

    @app.post("/mii/{deployment_name}", **documented(list[schemas.MIIResponse], schemas.MIIRequest))
    async def mii_generate(request: Request, deployment_name: str = Path(
            json_schema_extra={"enum": [model.deployment_name]}, description="this deployment's name")):
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
    if chat_ui:
        ui.add_routes(app)
    return app

