"""The OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming with
`data: ...` / `data: [DONE]` and `stream_options.include_usage`), `GET /v1/models` and `/v1/models/{model}`.

OpenAI's defaults apply here (temperature 1, top_p 1, max_tokens = the rest of the context), not MII's, and
OpenAI's ranges (temperature in [0, 2], top_p in (0, 1], penalties in [-2, 2]); the engine's bounds (n, logprobs,
stop strings, `mii.engine.params.BOUNDS`) are in the schema too, so /openapi.json says what is accepted.
Fields that OpenAI clients send as extras (vLLM's names: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, and `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` /
`structured_outputs`) are honoured. `response_format` and those constrain the output (`structured`: translated to
the engine's constraints). OpenAI fields that change the answer but are not implemented (`NOT_SUPPORTED`: suffix,
audio, ...) are refused with a 400 rather than ignored; other unknown fields are ignored, as vLLM does.

A request is translated here (OpenAI's fields → generation keyword arguments; chat messages, tools and
`chat_template_kwargs` → text through the template; answers → content, `reasoning_content` and `tool_calls`:
`mii.serving.chat_tools`) and validated once, by the replica; its typed errors come back renamed to this API's
field names.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from mii import errors
from mii.engine.params import BOUNDS
from mii.response import FinishReason, Response
from mii.serving import chat_tools, schemas, structured
from mii.serving.balancer import LoadBalancer
from mii.serving.http import (APIError, ServedModel, api_error, check_model, check_token_ids,
                              documented, internal_error, parse_body, read_json, require_ready,
                              until_disconnect)
from mii.serving.protocol import INT64, from_multi_reply, make_request

# engine parameter → the name this API gives it (for error messages)
_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "logprobs": "logprobs",
            "max_length": "max_tokens", "prompts": "prompt"}


NOT_SUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"),
    "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,),
    # vLLM's that change the answer: a chat template sent with the request, chat's echo of the final message, beam
    # search, token allow and ban lists, prompt truncation, logits processors, token ids in place of text
    "chat_template": (None,), "echo": (None, False), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "allowed_token_ids": (None,), "bad_words": (None, []), "truncate_prompt_tokens": (None,),
    "logits_processors": (None,), "return_tokens_as_token_ids": (None, False), "detokenize": (None, True),
    "spaces_between_special_tokens": (None, True),
}
"""OpenAI's (and vLLM's) fields that would change the answer but are not implemented, with the values that mean "not
used" (accepted); any other value is a 400. Implementing one means declaring it on the request and deleting it here."""


_Stop = Annotated[str, Field(min_length=1, max_length=BOUNDS.max_stop_length)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(structured.StructuredFields):  # + response_format and vLLM's guided_* fields
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1, le=INT64[1])
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=BOUNDS.max_n)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[_Stop, Annotated[list[_Stop], Field(max_length=BOUNDS.max_stop_strings)]]] = None
    seed: Optional[int] = Field(None, ge=INT64[0], le=INT64[1])
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    user: Optional[str] = None
    logit_bias: Optional[Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(
        ge=-100, le=100)]], Field(max_length=BOUNDS.max_logit_bias)]] = Field(
        None, description="token id → bias added to its logit before sampling")
    # extras (vLLM's names)
    top_k: Optional[int] = Field(None, ge=-1, le=INT64[1], description="0 or -1: no top-k")
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=INT64[1])
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64[1])
    stop_token_ids: Optional[Annotated[list[schemas.TokenId], Field(max_length=BOUNDS.max_stop_token_ids)]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in NOT_SUPPORTED and value not in NOT_SUPPORTED[name]:
                raise APIError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")

    def engine_kwargs(self, max_context: int) -> dict:
        kw: dict[str, Any] = dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, do_sample=True, n=self.n, stop=self.stop,
            seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            top_k=None if not self.top_k or self.top_k < 0 else self.top_k, min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            ignore_eos=self.ignore_eos, min_new_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            logit_bias=self.logit_bias or None, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)
        kw.update(self.constraint()[0])
        max_tokens = self.max_new_tokens()
        if max_tokens is None:
            kw["max_length"] = max_context  # OpenAI: the rest of the context
        else:
            kw["max_new_tokens"] = max_tokens
        return {k: v for k, v in kw.items() if v is not None}

    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens


class CompletionRequest(_Sampling):
    prompt: schemas.Prompts
    max_tokens: Optional[int] = Field(None, ge=0, le=INT64[1],
                                      description="0 only with echo: the prompt alone (scored with logprobs)")
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=BOUNDS.max_logprobs)
    best_of: Optional[int] = Field(None, ge=1, le=INT64[1], description="must equal n")


class ChatRequest(_Sampling):
    messages: list[schemas.ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=INT64[1])
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=BOUNDS.max_logprobs, description="needs logprobs=true")
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="vLLM's: the final message left open for the model to "
                                         "continue (an answer the caller began); needs add_generation_prompt=false")
    tools: Optional[Annotated[list[chat_tools.Tool], Field(max_length=128)]] = None
    tool_choice: Optional[chat_tools.ToolChoice] = Field(None, description='default: "auto" with tools, else "none"')
    parallel_tool_calls: Optional[bool] = Field(None, description="default true; false: at most one call")
    chat_template_kwargs: Optional[schemas.TemplateKwargs] = Field(
        None, description="variables for the chat template, e.g. {\"enable_thinking\": false}")

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finish(reason: FinishReason) -> Optional[str]:
    return None if reason is FinishReason.NONE else str(reason)


class OpenAICall:
    """One OpenAI request turned into a gRPC request: prompts × n sequences, in choice order."""

    def __init__(self, model: ServedModel, req: _Sampling, prompts: list, echo: list[str], chat: bool = False,
                 extra_kwargs: Optional[dict] = None):
        self.model, self.req, self.n = model, req, req.n
        kwargs = structured.merge(req.engine_kwargs(model.max_context), extra_kwargs or {})
        # engine fields → the ones this request used (extra_kwargs: the constraint of the request's tools)
        self.renames = {**_RENAMES, **req.constraint()[1], **{k: "tools" for k in extra_kwargs or {}}}
        field = "messages" if chat else "prompt"  # (the engine's prompts, as this request gave them)
        self.renames.update({"prompts": field, **({"prompts[0]": field} if len(prompts) == 1 else {})})
        if isinstance(req, ChatRequest):
            lp = (req.top_logprobs or 0) if req.logprobs else None
        else:
            lp = req.logprobs
        if lp is not None:
            kwargs["logprobs"] = lp
        self.want_logprobs = lp is not None
        self.score_only = isinstance(req, CompletionRequest) and req.max_tokens == 0
        """echo with max_tokens=0 (lm-eval's scoring): one token is generated and dropped, as vLLM does"""
        if self.score_only:
            kwargs.pop("max_length", None)
            kwargs["max_new_tokens"] = 1
        self.echo_logprobs = isinstance(req, CompletionRequest) and req.echo and lp is not None
        if self.echo_logprobs:  # the echoed prompt's tokens come with their logprobs too
            kwargs["prompt_logprobs"] = lp
        self.kwargs = kwargs
        try:
            self.grpc_request = make_request(prompts, kwargs, chat=chat)
        except errors.MIIError as e:
            raise api_error(e, self.renames) from None
        self.echo = echo
        self.num_prompts = len(prompts)
        self.id = ("chatcmpl-" if isinstance(req, ChatRequest) else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def usage(self, responses: list[Response]) -> dict:
        firsts = [r for i, r in enumerate(responses) if i % self.n == 0]  # a prompt counts once, whatever n
        return _usage(sum(r.prompt_length for r in firsts),
                      0 if self.score_only else sum(r.generated_length for r in responses),
                      sum(r.cached_tokens for r in firsts))

    def token_text(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id])


def _completion_piece(job: OpenAICall, i: int, r: Response, offset: int, first: bool) -> tuple[str, Optional[dict]]:
    """A completion choice's text and logprobs from one piece of its sequence (`offset`: characters of the choice
    before it): with echo, the prompt (and its tokens' logprobs) before the first piece; with max_tokens=0, only
    that."""
    prefix = job.echo[i // job.n] if first else ""
    text = prefix + ("" if job.score_only else r.generated_text)
    if not job.want_logprobs:
        return text, None
    lp = _completion_logprobs(job, [] if job.score_only else r.logprobs, offset + len(prefix))
    if first and job.echo_logprobs:
        prompt = _completion_logprobs(job, r.prompt_logprobs or [], offset)
        lp = {k: prompt[k] + lp[k] for k in lp}
    return text, lp


def _completion_logprobs(job: OpenAICall, entries: list[dict], offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for x in entries:
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
    """A request (any Content-Type), refused with a 400 naming the first bad or unsupported field."""
    req = parse_body(cls, body)
    req.check_supported()
    return req


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _generate(request: Request, lb: LoadBalancer, job: OpenAICall) -> list[Response]:
    """The whole responses of a non-streamed call (cancelled if the client goes away), errors in this API's shape."""
    try:
        return await until_disconnect(request, lb.generate(job.grpc_request))
    except errors.MIIError as e:
        raise api_error(e, job.renames) from None


async def _first_chunk(lb: LoadBalancer, job: OpenAICall):
    """Start the stream and wait for its first chunk, so errors (queue full, prompt too long) get their HTTP
    status before any byte of the 200 stream is sent."""
    stream = lb.stream(job.grpc_request)
    try:
        first = await _next(stream)
    except errors.MIIError as e:
        await stream.aclose()
        raise api_error(e, job.renames) from None
    return stream, first


def add_routes(app: FastAPI, lb: LoadBalancer, model: ServedModel) -> None:
    def card() -> dict:
        return {"id": model.name, "object": "model", "created": 0, "owned_by": "mii",
                "max_model_len": model.max_context}

    @app.get("/v1/models", **documented(schemas.ModelList))
    async def models():
        require_ready(model)
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", **documented(schemas.ModelCard))
    async def retrieve_model(model_id: str):
        """The `openai` client's `models.retrieve`: the served model by its name or an alias (404 otherwise)."""
        require_ready(model)
        check_model(model, model_id)
        return card()

    @app.post("/v1/completions", **documented(schemas.Completion, CompletionRequest, stream=True))
    async def completions(request: Request):
        req = _parse(CompletionRequest, await read_json(request))
        require_ready(model)
        check_model(model, req.model)
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of must equal n (or be unset)", param="best_of")
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: 0 is allowed only with echo=true (the prompt alone, scored with "
                                "logprobs)", param="max_tokens")
        if req.echo:  # echoed token ids are decoded here, before the engine sees them: check them first
            for p in prompts:
                check_token_ids(model, p, "prompt")
        echo = [(p if isinstance(p, str) else model.tokenizer.decode(p)) if req.echo else "" for p in prompts]
        job = OpenAICall(model, req, list(prompts), echo)
        if req.stream:
            return await _stream_completions(lb, job, req)
        responses = await _generate(request, lb, job)
        choices = []
        for i, r in enumerate(responses):
            text, lp = _completion_piece(job, i, r, 0, first=True)
            choices.append({"index": i, "text": text, "finish_reason": _finish(r.finish_reason), "logprobs": lp})
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": model.name,
                "choices": choices, "usage": job.usage(responses)}

    async def _stream_completions(lb, job: OpenAICall, req: CompletionRequest):
        stream, first = await _first_chunk(lb, job)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # the echo goes first, or, when its tokens' logprobs come from the engine, with each choice's first piece
        early_echo = req.echo and not job.echo_logprobs
        offsets = [len(e) if early_echo else 0 for e in job.echo for _ in range(job.n)]
        head = [_completion_chunk(job, i, job.echo[i // job.n], None, None) for i in range(len(offsets))
                if early_echo]
        started = [early_echo] * len(offsets)

        def choice_event(i, r, finish):
            text, lp = _completion_piece(job, i, r, offsets[i], first=not started[i] and req.echo)
            started[i] = True
            offsets[i] += len(text)
            return _completion_chunk(job, i, text, finish, lp)

        def usage_event(last):
            if include_usage:
                return {"id": job.id, "object": "text_completion", "created": job.created, "model": model.name,
                        "choices": [], "usage": job.usage(last)}

        events = _sse_events(stream, first, head, choice_event, usage_event, job.renames)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _completion_chunk(job: OpenAICall, i: int, text: str, finish, lp) -> dict:
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": model.name,
                "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}

    @app.post("/v1/chat/completions", **documented(schemas.ChatCompletion, ChatRequest, stream=True))
    async def chat(request: Request):
        req = _parse(ChatRequest, await read_json(request))
        require_ready(model)
        check_model(model, req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: only allowed with logprobs=true", param="top_logprobs")
        setup = chat_tools.ChatSetup(model, req)  # tools and template variables rendered; how answers are parsed
        # the replica tokenizes the text, adding no special tokens
        job = OpenAICall(model, req, [setup.prompt], [""], chat=True, extra_kwargs=setup.engine_kwargs())
        if req.stream:
            return await _stream_chat(lb, job, req, setup)
        responses = await _generate(request, lb, job)
        choices = []
        for i, r in enumerate(responses):
            parser = setup.parser(job.kwargs)
            parser.feed(r.generated_text, final=True)
            choices.append({"index": i, "message": parser.message(),
                            "logprobs": _chat_logprobs(job, r) if job.want_logprobs else None,
                            "finish_reason": parser.finish_reason(_finish(r.finish_reason))})
        return {"id": job.id, "object": "chat.completion", "created": job.created, "model": model.name,
                "choices": choices, "usage": job.usage(responses)}

    async def _stream_chat(lb, job: OpenAICall, req: ChatRequest, setup: chat_tools.ChatSetup):
        stream, first = await _first_chunk(lb, job)
        parsers = [setup.parser(job.kwargs) for _ in range(job.n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk_of(choices, usage=None) -> dict:
            data = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": model.name,
                    "choices": choices}
            if include_usage:
                data["usage"] = usage
            return data

        # content "" would make a client's assembled message say "" where the whole answer has null (tool calls)
        opening = {"role": "assistant"} if parsers[0].parses else {"role": "assistant", "content": ""}
        head = [chunk_of([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}
                          for i in range(job.n)])]

        def choice_event(i, r, finish):
            delta = parsers[i].feed(r.generated_text, final=finish is not None)
            lp = _chat_logprobs(job, r) if job.want_logprobs else None
            if not delta and lp is None and finish is None:
                return None  # text held back by the parsers (markup that may start a tool call)
            return chunk_of([{"index": i, "delta": delta, "logprobs": lp,
                              "finish_reason": parsers[i].finish_reason(finish)}])

        def usage_event(last):
            return chunk_of([], job.usage(last)) if include_usage else None

        events = _sse_events(stream, first, head, choice_event, usage_event, job.renames)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _sse_events(stream, first, head: list, choice_event, usage_event, renames: dict):
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
                event = choice_event(i, r, finish)
                if event is not None:
                    yield _sse(event)
                if finish:
                    done.add(i)
            chunk = await _next(stream)
        usage = usage_event(last) if last is not None else None
        if usage is not None:
            yield _sse(usage)
    except errors.MIIError as e:
        yield _sse(api_error(e, renames).body())  # naming the fields as this request did
    except Exception as e:  # the 200 is sent: the error goes in the stream
        yield _sse(internal_error(e).body())
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


async def _next(stream) -> Optional[list[Response]]:
    try:
        return from_multi_reply(await stream.__anext__())
    except StopAsyncIteration:
        return None
