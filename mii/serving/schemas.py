"""The HTTP API's bodies as pydantic models, for `/openapi.json`: what each route answers (and the bodies of the
gateway's own routes). The routes build plain dicts; these models document them, and the schema test
(tests/serving/test_schema.py) checks every answer against them. The OpenAI request bodies live with their
translation in `openai_api.py`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

FinishReasonName = Literal["stop", "length", "none"]
TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]


def _kind(x) -> str:
    if isinstance(x, str):
        return "text"
    if isinstance(x, int) and not isinstance(x, bool):
        return "a token id"
    return "a token-id list" if isinstance(x, list) else type(x).__name__


def _prompt_shape(value):
    """A message that says what is wrong with a list of prompts that none of the forms takes (pydantic names only
    its first form's error: "should be a valid string")."""
    def refuse(message: str, **ctx):
        raise PydanticCustomError("prompt_shape", message, ctx)

    if not isinstance(value, (list, str)):
        refuse("must be text, token ids or a list of them, got {k}", k=type(value).__name__)
    if not isinstance(value, list):
        return value
    if not value:
        refuse("the list of prompts is empty")
    kinds = [_kind(x) for x in value]
    bad = next((i for i, k in enumerate(kinds) if k not in ("text", "a token id", "a token-id list")), None)
    if bad is not None:
        refuse("item {i} is {k}: each item is text, a token id or a token-id list", i=bad, k=kinds[bad])
    if len(set(kinds)) > 1:
        refuse("a list of prompts is all text or all token-id lists (a flat list of token ids is one prompt), not "
               "{a} and {b}", a=kinds[0], b=next(k for k in kinds if k != kinds[0]))
    for i, x in enumerate(value):
        ids = x if isinstance(x, list) else [x] if kinds[0] == "a token id" else []
        if isinstance(x, (str, list)) and not x:
            refuse("item {i} is empty", i=i)
        k = next((_kind(t) for t in ids if _kind(t) != "a token id"), None)
        if k is not None:
            refuse("item {i}: a token-id list holds integers, not {k}", i=i, k=k)
        neg = next((t for t in ids if t < 0), None)
        if neg is not None:
            refuse("token ids are >= 0, got {t}", t=neg)
    return value


Prompts = Annotated[Union[Text, Annotated[list[Text], Field(min_length=1)], Annotated[list[TokenId], Field(min_length=1)],
                          Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]],
                    BeforeValidator(_prompt_shape)]
"""One prompt (text or token ids) or a list of them; none empty."""


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """Every error, whatever its status: OpenAI's shape."""

    error: ErrorBody


# --- OpenAI chat messages ---------------------------------------------------------------------------------------


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, as text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$", description="letters, digits, _ . -; at most 64")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON Schema of type object")
    strict: Optional[bool] = None


class Tool(BaseModel):
    """A function the model may call (OpenAI's `tools` item), rendered by the model's chat template."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
_IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"
TemplateKwargs = Annotated[dict[Annotated[str, Field(pattern=_IDENTIFIER)], Any],
                           WithJsonSchema({"type": "object", "propertyNames": {"pattern": _IDENTIFIER}})]
"""`chat_template_kwargs`: variables for the chat template (e.g. `enable_thinking`)."""


class ChatMessage(BaseModel):
    """A chat message; its content is text: a string, or text parts (joined). Other kinds of parts (images,
    audio) are not supported: the gateway refuses them naming the part. An assistant message may carry the
    `tool_calls` it made, and a `tool` message answers one (`tool_call_id`); both go to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Annotated[Optional[Union[str, list[dict]]], WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]})] = None
    tool_calls: Optional[list[ToolCall]] = Field(
        None, description="an assistant's calls (arguments: a JSON object as text); on other roles, left to the "
                          "template")
    tool_call_id: Optional[str] = Field(None, description="a tool message: the call it answers")


# --- OpenAI answers ----------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache (not computed)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[Literal["stop", "length"]]


class Completion(BaseModel):
    """`/v1/completions` without `stream`; with it, a `text/event-stream` of `data: <Completion chunk>` events
    (choices with a text delta) and `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: Optional[str] = Field(description="null when the answer is only tool calls or reasoning")
    reasoning_content: Optional[str] = Field(None, description="the thinking of a reasoning model (its parser on)")
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[Literal["stop", "length", "tool_calls"]]


class ChatCompletion(BaseModel):
    """`/v1/chat/completions` without `stream`; with it, a `text/event-stream` of `data: <chat.completion.chunk>`
    events (choices with a `delta`) and `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Version(BaseModel):
    version: str


# --- the gateway's own routes ------------------------------------------------------------------------------------


class MIIRequest(BaseModel):
    """MII's REST body: the prompts and any of MII's generation keyword arguments (`max_new_tokens`, `do_sample`,
    `temperature`, `top_p`, `top_k`, `stop`, `seed`, `n`, `return_full_text`, ...), checked by the engine."""

    model_config = ConfigDict(extra="allow")
    prompts: Prompts


class MIILogprob(BaseModel):
    token_id: int
    logprob: float
    top_logprobs: dict[str, float]


class MIIPromptLogprob(BaseModel):
    token_id: int
    logprob: Optional[float] = Field(description="null for the first prompt token")
    top_logprobs: dict[str, float]


class MIIResponse(BaseModel):
    generated_text: str
    prompt_length: int
    generated_length: int
    finish_reason: FinishReasonName
    token_ids: Optional[list[int]] = None
    logprobs: Optional[list[MIILogprob]] = None
    prompt_logprobs: Optional[list[MIIPromptLogprob]] = Field(None, description="with prompt_logprobs=k")
    cached_tokens: int = Field(0, description="prompt tokens whose KV came from the prefix cache (not computed)")


class Health(BaseModel):
    """200 while some replica serves; 503 (same shape) while loading, stopping or with no replica left."""

    model_config = ConfigDict(extra="allow")
    status: str
    """ok, degraded (fewer replicas than configured, still serving), loading, stopping or unavailable"""
    replicas: Optional[int] = None
    configured: Optional[int] = None
    nodes: Optional[dict[str, list[int]]] = None
    """the replicas in rotation on each node ("local", or a Ray node's address/id)"""


class EnginePlan(BaseModel):
    """What the engine of one replica chose and why (`mii explain`; `mii.engine.plan.EnginePlan`)."""

    device: str
    dtype: str = Field(description="the dtype the engine computes in")
    weights: str = Field(description="the dtype the linear, LM head and embedding weights are kept in")
    num_threads: int
    tensor_parallel: int
    attention: str = Field(description="kernel or torch")
    linear_backend: str
    kv_block_size: int
    kv_num_blocks: int
    kv_cache_bytes: int
    kv_dtype: str = Field("", description="the KV cache's dtype (bf16 under fp32 math where the weights are bf16)")
    max_batch_tokens: int = Field(description="the token budget of a step")
    max_batch_seqs: int
    max_context: int
    cuda_graphs: str
    startup: dict[str, float] = Field(default_factory=dict, description=(
        "seconds the replica took to build its engine (total) and each part: kernels, checkpoint, weights, "
        "tokenizer, engine; reasons['start-up'] says what was built, converted or read from the cache"))
    reasons: dict[str, str] = Field(description="why, for the rows chosen automatically (keyed by `text`'s row names)")
    text: str = Field(description="the plan as `mii explain` prints it")


class ReplicaPlan(BaseModel):
    replica: int
    pid: int = Field(description="the replica's process (a restarted replica reports its plan again)")
    node: str = Field(description='where it runs: "local", or its Ray node (address/id)')
    plan: EnginePlan


class EnginePlans(BaseModel):
    """`GET /engine_plan`: the engine plan of each replica, as its process reported when it became ready."""

    model: str
    deployment: str
    replicas: list[ReplicaPlan]


class TokenizeRequest(BaseModel):
    """Text (`prompt`) or chat `messages` (rendered through the model's template) to token ids."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="with messages: the final message left open "
                                         "(as chat completions leave it)")
    tools: Optional[Annotated[list[Tool], Field(max_length=128)]] = Field(
        None, description="with messages: rendered by the template, as chat completions render them")
    chat_template_kwargs: Optional[TemplateKwargs] = Field(None, description="with messages: template variables")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model: Optional[str] = None
    tokens: list[TokenId] = Field(description="token ids of the model's vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str
