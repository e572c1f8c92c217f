"""Typed exceptions raised by mii's public entry points."""
from typing import Optional


class MIIError(Exception):
    """Base class of every error mii raises on purpose."""


class UnknownArgument(MIIError, TypeError):
    """A keyword argument that no config or generation parameter accepts (MII's behaviour)."""


class ValidationError(MIIError, ValueError):
    """A value that is out of range or of the wrong type; the message names the field and the value."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class PromptTooLongError(ValidationError):
    """A request that does not fit in the model's context: the prompt alone, or the prompt plus an explicit
    number of tokens to generate (`completion_tokens`; OpenAI's and vLLM's message)."""

    def __init__(self, prompt_length: int, max_context: int, completion_tokens: Optional[int] = None):
        self.prompt_length = prompt_length
        self.max_context = max_context
        self.completion_tokens = completion_tokens
        if completion_tokens is None:
            message = (f"This model's maximum context length is {max_context} tokens. However, the prompt has "
                       f"{prompt_length} tokens. Please reduce the length of the prompt.")
        else:
            message = (f"This model's maximum context length is {max_context} tokens. However, you requested "
                       f"{prompt_length + completion_tokens} tokens ({prompt_length} in the prompt, "
                       f"{completion_tokens} for the completion). Please reduce the length of the prompt or "
                       "of the completion.")
        super().__init__("prompt", message)


class ModelLoadError(MIIError, ValueError):
    """A model that cannot be found, read or mapped onto a supported architecture."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose architecture has no registered implementation."""


class KVCacheError(MIIError, RuntimeError):
    """The KV cache cannot hold what was asked of it."""


class DeploymentNotFoundError(MIIError, LookupError):
    """No running deployment answers to the given name."""


class DeploymentExistsError(MIIError, RuntimeError):
    """`mii.serve` was asked for a deployment name that a running deployment already uses."""


class DeploymentUnavailableError(MIIError, RuntimeError):
    """A deployment that exists but cannot serve: starting, stopping, or every replica is gone."""


class AuthenticationError(MIIError, PermissionError):
    """The deployment has an API key and the call did not carry it (`mii.client(name, api_key=...)`)."""


class ServerOverloadedError(MIIError, RuntimeError):
    """The server's queue of waiting requests is full; retry later (HTTP 429)."""


class EngineStepError(MIIError, RuntimeError):
    """A request failed inside an engine step (a bug, or a fault of the device): only the requests named in it
    are dropped; the message says what failed."""


class RequestTimeoutError(MIIError, TimeoutError):
    """A request that did not finish within its time limit (`request_timeout`, or the caller's gRPC deadline); it
    was aborted (gRPC DEADLINE_EXCEEDED, HTTP 504)."""


class PipelineDestroyedError(MIIError, RuntimeError):
    """A pipeline used after its `destroy()`: its model and KV cache are gone."""


class TensorParallelError(MIIError, RuntimeError):
    """A tensor-parallel rank failed (died, or could not join its group); the group is down."""


def error_info(e: BaseException) -> dict:
    """A JSON-able description of an exception, enough to raise the same typed mii error in another process
    (across gRPC, or from a child process's start-up error file)."""
    # a foreign exception keeps its name only in the message: a same-named mii class (pydantic's ValidationError
    # vs ours) must not be rebuilt from it
    info = {"type": type(e).__name__ if isinstance(e, MIIError) else "MIIError",
            "message": str(e) if isinstance(e, MIIError) else f"{type(e).__name__}: {e}"}
    if isinstance(e, ValidationError):
        info.update(field=e.field, detail=str(e)[len(e.field) + 2:])
    if isinstance(e, PromptTooLongError):
        info.update(prompt_length=e.prompt_length, max_context=e.max_context, completion_tokens=e.completion_tokens)
    return info


def error_from_info(info: dict) -> Exception:
    kind = info.get("type")
    if kind == "PromptTooLongError":
        return PromptTooLongError(info["prompt_length"], info["max_context"], info.get("completion_tokens"))
    if "field" in info:
        return ValidationError(info["field"], info["detail"])
    cls = globals().get(kind or "")
    if isinstance(cls, type) and issubclass(cls, MIIError):
        return cls(info["message"])
    return MIIError(info["message"])
