"""The wire format: MII's gRPC messages (generated from `proto/modelresponse.proto`) and the codecs between them
and mii's Python types (keyword arguments, prompts, `Response`, typed errors).

The `*_pb2` modules are generated with grpcio-tools on first import into mii's cache directory, keyed by the
proto's content and the installed grpcio-tools and protobuf versions, so the generated code always matches the
protobuf runtime (nothing generated is committed, and no build step is needed).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import grpc

from mii import errors
from mii.envs import cache_dir
from mii.errors import error_from_info, error_info
from mii.response import FinishReason, Response

PROTO = Path(__file__).with_name("proto") / "modelresponse.proto"
SERVICE = "modelresponse.ModelResponse"
_MAX_MESSAGE = 256 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]
"""For every channel and server of a deployment: many prompts or logprobs exceed gRPC's 4 MiB default."""


def server_options(max_request_bytes: int) -> list:
    """The options of a deployment's public gRPC server: requests up to `max_request_bytes`, answers up to the
    channel limit."""
    return [("grpc.so_reuseport", 0), ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", max_request_bytes)]


def _generate() -> Path:
    from importlib.metadata import version

    import grpc_tools
    from grpc_tools import protoc

    key = hashlib.sha256(PROTO.read_bytes() + version("grpcio-tools").encode() + version("protobuf").encode())
    out = cache_dir() / "grpc" / key.hexdigest()[:16]
    if (out / "modelresponse_pb2_grpc.py").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{PROTO.parent}", f"-I{include}", f"--python_out={tmp}",
                      f"--grpc_python_out={tmp}", str(PROTO)])
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed ({rc}) on {PROTO}")
    try:
        os.replace(tmp, out)
    except OSError:  # another process generated it first
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return out


def _load(name: str, folder: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the *_pb2_grpc module imports `modelresponse_pb2` by this name
    spec.loader.exec_module(module)
    return module


_folder = _generate()
pb2 = sys.modules.get("modelresponse_pb2") or _load("modelresponse_pb2", _folder)
pb2_grpc = sys.modules.get("modelresponse_pb2_grpc") or _load("modelresponse_pb2_grpc", _folder)

# --- keyword arguments -----------------------------------------------------------------------------------------


INT64 = (-(1 << 63), (1 << 63) - 1)
"""The integers a `Value` carries (`ivalue` is an int64)."""


def to_value(v: Any, field: str = "kwargs"):
    """A keyword argument's value on the wire; a `ValidationError` naming `field` for one it cannot carry."""
    if v is None:
        return pb2.Value(nvalue=True)
    if isinstance(v, bool):
        return pb2.Value(bvalue=v)
    if isinstance(v, int):
        if not INT64[0] <= v <= INT64[1]:
            raise errors.ValidationError(field, f"{v} is out of range (a 64-bit signed integer)")
        return pb2.Value(ivalue=v)
    if isinstance(v, float):
        return pb2.Value(dvalue=v)
    if isinstance(v, str):
        return pb2.Value(svalue=v)
    if isinstance(v, (list, tuple)):
        return pb2.Value(lvalue=pb2.ListValue(values=[to_value(x, field) for x in v]))
    if isinstance(v, dict):
        return pb2.Value(mvalue=pb2.Dictionary(values={str(k): to_value(x, field) for k, x in v.items()}))
    raise errors.ValidationError(field, f"cannot send a value of type {type(v).__name__}: {v!r:.60}")


def from_value(v) -> Any:
    kind = v.WhichOneof("oneof_values")
    if kind is None or kind == "nvalue":
        return None
    if kind == "lvalue":
        return [from_value(x) for x in v.lvalue.values]
    if kind == "mvalue":
        return {k: from_value(x) for k, x in v.mvalue.values.items()}
    return getattr(v, kind)


def make_request(prompts: list, kwargs: dict, chat: bool = False):
    """A `MultiStringRequest`: MII's `request` field when every prompt is text, else mii's `prompts`. `chat`: the
    text prompts were rendered by the chat template (their special tokens are in them)."""
    kw = {k: to_value(_schema_text(v) if k == "json_schema" else v, k) for k, v in kwargs.items()}
    if all(isinstance(p, str) for p in prompts):
        return pb2.MultiStringRequest(request=prompts, query_kwargs=kw, chat=chat)
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not all(INT64[0] <= t <= INT64[1] for t in p):
            raise errors.ValidationError(f"prompts[{i}]", "a token id is out of range (a 64-bit signed integer)")
    items = [pb2.Prompt(text=p) if isinstance(p, str) else pb2.Prompt(token_ids=pb2.TokenIds(ids=p)) for p in prompts]
    return pb2.MultiStringRequest(prompts=items, query_kwargs=kw, chat=chat)


def _schema_text(value):
    """A JSON schema (or a per-prompt list of them) as JSON text: a protobuf map does not keep the order of its keys,
    and the engine generates an object's properties in its schema's order."""
    if isinstance(value, list):
        return [_schema_text(v) for v in value]
    if isinstance(value, dict):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):  # not JSON: to_value or the engine says what is wrong with it
            return value
    return value


TRANSPORT_KWARGS = frozenset({"stream"})
"""Keys MII's own client puts among the generation arguments to say how it calls (`stream=True` on
GeneratorReplyStream); they are not generation parameters, and are dropped here."""


def read_request(request) -> tuple[list, dict]:
    """(prompts, generation keyword arguments) of a `MultiStringRequest`, as `InputProcessor.process` takes them."""
    if request.prompts and request.request:
        raise errors.ValidationError("prompts", "give text prompts in `request` or prompts in `prompts`, not both")
    if request.prompts:
        prompts = [p.text if p.WhichOneof("kind") == "text" else list(p.token_ids.ids) for p in request.prompts]
    else:
        prompts = list(request.request)
    return prompts, {k: from_value(v) for k, v in request.query_kwargs.items() if k not in TRANSPORT_KWARGS}


def num_sequences(request) -> int:
    """Sequences a request asks for: prompts × n (n may be one value per prompt); what the load balancer weighs."""
    prompts = max(1, len(request.request) or len(request.prompts))
    n = from_value(request.query_kwargs["n"]) if "n" in request.query_kwargs else 1
    if isinstance(n, list):
        return sum(x if isinstance(x, int) and x > 0 else 1 for x in n) or prompts
    return prompts * (n if isinstance(n, int) and n > 0 else 1)


# --- responses -------------------------------------------------------------------------------------------------


def to_reply(r: Response, time_taken: float = 0.0):
    logprobs = [pb2.TokenLogprob(token_id=x["token_id"], logprob=x["logprob"], top_logprobs=x["top_logprobs"])
                for x in r.logprobs or ()]
    prompt_logprobs = [pb2.TokenLogprob(token_id=x["token_id"], top_logprobs=x["top_logprobs"],
                                        logprob=math.nan if x["logprob"] is None else x["logprob"])
                       for x in r.prompt_logprobs or ()]
    return pb2.SingleGenerationReply(response=r.generated_text, finish_reason=r.finish_reason,
                                     prompt_tokens=r.prompt_length, generated_tokens=r.generated_length,
                                     time_taken=time_taken, token_ids=r.token_ids or (), logprobs=logprobs,
                                     has_logprobs=r.logprobs is not None, prompt_logprobs=prompt_logprobs,
                                     has_prompt_logprobs=r.prompt_logprobs is not None,
                                     cached_tokens=r.cached_tokens)


def from_reply(s) -> Response:
    logprobs = None
    if s.has_logprobs:
        logprobs = [{"token_id": x.token_id, "logprob": x.logprob, "top_logprobs": dict(x.top_logprobs)}
                    for x in s.logprobs]
    prompt_logprobs = None
    if s.has_prompt_logprobs:
        prompt_logprobs = [{"token_id": x.token_id, "logprob": None if math.isnan(x.logprob) else x.logprob,
                            "top_logprobs": dict(x.top_logprobs)} for x in s.prompt_logprobs]
    return Response(s.response, s.prompt_tokens, s.generated_tokens, FinishReason(s.finish_reason),
                    list(s.token_ids), logprobs, prompt_logprobs, s.cached_tokens)


def from_multi_reply(reply) -> list[Response]:
    return [from_reply(r) for r in reply.response]


def to_multi_reply(responses: list[Response], time_taken: float = 0.0, token_times: Optional[list] = None):
    """`token_times`: per response, [] or the seconds since the call began of its [first, last] token."""
    reply = pb2.MultiGenerationReply(response=[to_reply(r, time_taken) for r in responses])
    for r, times in zip(reply.response, token_times or ()):
        if times:
            r.first_token_time, r.last_token_time = times
    return reply


# --- errors ----------------------------------------------------------------------------------------------------

ERROR_KEY = "mii-error"
_CODES = [  # most specific first
    (errors.PromptTooLongError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.UnknownArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ServerOverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.KVCacheError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DeploymentUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.RequestTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def error_status(e: BaseException) -> tuple[grpc.StatusCode, str, tuple]:
    """(status code, details, trailing metadata) carrying a mii error across gRPC."""
    code = next((c for cls, c in _CODES if isinstance(e, cls)), grpc.StatusCode.INTERNAL)
    info = error_info(e)
    return code, info["message"], ((ERROR_KEY, json.dumps(info)),)


def error_from_rpc(e: grpc.RpcError) -> Exception:
    """The typed mii error a failed call carried, or `DeploymentUnavailableError` / `MIIError` otherwise."""
    code, details = e.code(), e.details() or ""
    for k, v in (e.trailing_metadata() or ()):
        if k == ERROR_KEY:
            return error_from_info(json.loads(v))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.AuthenticationError(f"{details}; give the deployment's key: mii.client(name, api_key=...)")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return errors.DeploymentUnavailableError(f"the deployment did not answer ({code.name}: {details})")
    return errors.MIIError(f"{code.name}: {details}")
