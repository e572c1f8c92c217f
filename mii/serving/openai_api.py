"""The OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming with
`data: ...` / `data: [DONE]` and `stream_options.include_usage`), `GET /v1/models`.

OpenAI's defaults apply here (temperature 1, top_p 1, max_tokens = the rest of the context), not MII's.
Fields that OpenAI clients send as extras (vLLM's names: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`) are honoured; other unknown fields are ignored, as vLLM does.

A request is translated here (OpenAI's fields → generation keyword arguments; chat messages → text through the
template) and validated once, by the replica; its typed errors come back renamed to this API's field names.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticError

from mii import errors
from mii.response import FinishReason, Response
from mii.serving.balancer import LoadBalancer
from mii.serving.http import (APIError, ServedModel, api_error, check_model, read_json, render_chat, require_ready,
                              until_disconnect)
from mii.serving.protocol import from_multi_reply, make_request

# engine parameter → the name this API gives it (for error messages)
_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "logprobs": "logprobs",
            "max_length": "max_tokens"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # extras (vLLM's names)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None

    def engine_kwargs(self, max_context: int) -> dict:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        kw: dict[str, Any] = dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, do_sample=True, n=self.n, stop=self.stop,
            seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, top_k=None if not self.top_k or self.top_k < 0 else self.top_k,
            min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty or 1.0, ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids)
        max_tokens = self.max_new_tokens()
        if max_tokens is None:
            kw["max_length"] = max_context  # OpenAI: the rest of the context
        else:
            kw["max_new_tokens"] = max_tokens
        return {k: v for k, v in kw.items() if v is not None}

    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatRequest(_Sampling):
    messages: list[dict]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish(reason: FinishReason) -> Optional[str]:
    return None if reason is FinishReason.NONE else str(reason)


class OpenAICall:
    """One OpenAI request turned into a gRPC request: prompts × n sequences, in choice order."""

    def __init__(self, model: ServedModel, req: _Sampling, prompts: list, echo: list[str], chat: bool = False):
        self.model, self.req, self.n = model, req, req.n
        kwargs = req.engine_kwargs(model.max_context)
        if isinstance(req, ChatRequest):
            lp = (req.top_logprobs or 0) if req.logprobs else None
        else:
            lp = req.logprobs
        if lp is not None:
            kwargs["logprobs"] = lp
        self.want_logprobs = lp is not None
        self.grpc_request = make_request(prompts, kwargs, chat=chat)
        self.echo = echo
        self.num_prompts = len(prompts)
        self.id = ("chatcmpl-" if isinstance(req, ChatRequest) else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def usage(self, responses: list[Response]) -> dict:
        prompt = sum(r.prompt_length for i, r in enumerate(responses) if i % self.n == 0)
        return _usage(prompt, sum(r.generated_length for r in responses))

    def token_text(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id])


def _completion_logprobs(job: OpenAICall, r: Response, offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for x in r.logprobs:
        text = job.token_text(x["token_id"])
        tokens.append(text)
        lps.append(x["logprob"])
        top = sorted(x["top_logprobs"].items(), key=lambda kv: -kv[1])
        tops.append({job.token_text(t): v for t, v in top} if top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(job: OpenAICall, r: Response) -> dict:
    def entry(token_id, logprob):
        text = job.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for x in r.logprobs:
        e = entry(x["token_id"], x["logprob"])
        e["top_logprobs"] = [entry(t, v) for t, v in sorted(x["top_logprobs"].items(), key=lambda kv: -kv[1])]
        content.append(e)
    return {"content": content}


def _parse(cls, body: dict):
    """Validate a JSON body (whatever its Content-Type); a 400 naming the first bad field."""
    try:
        return cls.model_validate(body)
    except PydanticError as e:
        err = e.errors()[0]
        name = ".".join(str(p) for p in err.get("loc", ())) or "body"
        got = f" (got {err['input']!r:.80})" if err.get("type") != "missing" else ""
        raise APIError(400, f"{name}: {err.get('msg')}{got}", param=name) from None


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _generate(request: Request, lb: LoadBalancer, job: OpenAICall) -> list[Response]:
    """The whole responses of a non-streamed call (cancelled if the client goes away), errors in this API's shape."""
    try:
        return await until_disconnect(request, lb.generate(job.grpc_request))
    except errors.MIIError as e:
        raise api_error(e, _RENAMES) from None


async def _first_chunk(lb: LoadBalancer, job: OpenAICall):
    """Start the stream and wait for its first chunk, so errors (queue full, prompt too long) get their HTTP
    status before any byte of the 200 stream is sent."""
    stream = lb.stream(job.grpc_request)
    try:
        first = await _next(stream)
    except errors.MIIError as e:
        await stream.aclose()
        raise api_error(e, _RENAMES) from None
    return stream, first


def add_routes(app: FastAPI, lb: LoadBalancer, model: ServedModel) -> None:
    @app.get("/v1/models")
    async def models():
        require_ready(model)
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "mii",
                                            "max_model_len": model.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await read_json(request))
        require_ready(model)
        check_model(model, req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of must equal n (or be unset)", param="best_of")
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        echo = [(p if isinstance(p, str) else model.tokenizer.decode(p)) if req.echo else "" for p in prompts]
        job = OpenAICall(model, req, list(prompts), echo)
        if req.stream:
            return await _stream_completions(lb, job, req)
        responses = await _generate(request, lb, job)
        choices = []
        for i, r in enumerate(responses):
            prefix = job.echo[i // job.n]
            choices.append({"index": i, "text": prefix + r.generated_text, "finish_reason": _finish(r.finish_reason),
                            "logprobs": _completion_logprobs(job, r, len(prefix)) if job.want_logprobs else None})
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": model.name,
                "choices": choices, "usage": job.usage(responses)}

    async def _stream_completions(lb, job: OpenAICall, req: CompletionRequest):
        stream, first = await _first_chunk(lb, job)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = [len(e) for e in job.echo for _ in range(job.n)]
        head = ([_completion_chunk(job, i, job.echo[i // job.n], None, None) for i in range(len(offsets))]
                if req.echo else [])

        def choice_event(i, r, finish):
            lp = _completion_logprobs(job, r, offsets[i]) if job.want_logprobs else None
            offsets[i] += len(r.generated_text)
            return _completion_chunk(job, i, r.generated_text, finish, lp)

        def usage_event(last):
            if include_usage:
                return {"id": job.id, "object": "text_completion", "created": job.created, "model": model.name,
                        "choices": [], "usage": job.usage(last)}

        events = _sse_events(stream, first, head, choice_event, usage_event)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _completion_chunk(job: OpenAICall, i: int, text: str, finish, lp) -> dict:
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": model.name,
                "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = _parse(ChatRequest, await read_json(request))
        require_ready(model)
        check_model(model, req.model)
        text = render_chat(model, req.messages, req.add_generation_prompt)
        job = OpenAICall(model, req, [text], [""], chat=True)  # the replica tokenizes it, adding no special tokens
        if req.stream:
            return await _stream_chat(lb, job, req)
        responses = await _generate(request, lb, job)
        choices = [{"index": i, "message": {"role": "assistant", "content": r.generated_text},
                    "logprobs": _chat_logprobs(job, r) if job.want_logprobs else None,
                    "finish_reason": _finish(r.finish_reason)} for i, r in enumerate(responses)]
        return {"id": job.id, "object": "chat.completion", "created": job.created, "model": model.name,
                "choices": choices, "usage": job.usage(responses)}

    async def _stream_chat(lb, job: OpenAICall, req: ChatRequest):
        stream, first = await _first_chunk(lb, job)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk_of(choices, usage=None) -> dict:
            data = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": model.name,
                    "choices": choices}
            if include_usage:
                data["usage"] = usage
            return data

        head = [chunk_of([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None} for i in range(job.n)])]

        def choice_event(i, r, finish):
            delta = {"content": r.generated_text} if r.generated_text else {}
            lp = _chat_logprobs(job, r) if job.want_logprobs else None
            return chunk_of([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}])

        def usage_event(last):
            return chunk_of([], job.usage(last)) if include_usage else None

        events = _sse_events(stream, first, head, choice_event, usage_event)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _sse_events(stream, first, head: list, choice_event, usage_event):
    """The SSE body shared by completions and chat: `head` events, then one event per choice with news in each
    chunk (`choice_event(index, response, finish_reason)`), the usage event if any, errors in OpenAI's shape, and
    `data: [DONE]`; the upstream stream is closed whatever happens (which cancels it if the client left)."""
    last, done = None, set()
    try:
        for event in head:
            yield _sse(event)
        chunk = first
        while chunk is not None:
            last = chunk
            for i, r in enumerate(chunk):
                finish = _finish(r.finish_reason)
                if i in done or (not r.generated_text and not r.token_ids and finish is None):
                    continue
                yield _sse(choice_event(i, r, finish))
                if finish:
                    done.add(i)
            chunk = await _next(stream)
        usage = usage_event(last) if last is not None else None
        if usage is not None:
            yield _sse(usage)
    except errors.MIIError as e:
        yield _sse(api_error(e).body())
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


async def _next(stream) -> Optional[list[Response]]:
    try:
        return from_multi_reply(await stream.__anext__())
    except StopAsyncIteration:
        return None
