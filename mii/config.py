"""Typed, validated configuration: what a user may set, documented where it is declared.

`ModelConfig` describes one model deployment (MII's fields plus `dtype` and `device`), `MIIConfig` a persistent
deployment. Unknown keys are errors (`mii.errors.UnknownArgument`); "auto" values are resolved by the engine
plan (`mii.engine.plan`) and reported there.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mii.errors import UnknownArgument, ValidationError

DEVICE_MAP_DEFAULT = "auto"
HOSTFILE_DEFAULT = "/job/hostfile"  # MII's


class TaskType(str, Enum):
    TEXT_GENERATION = "text-generation"


class DeploymentType(str, Enum):
    LOCAL = "local"


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class MemoryConfig(_Config):
    mode: Literal["reserve", "allocate"] = "reserve"
    """`reserve`: leave `size` bytes of the device's free memory unused (on CPU: of available RAM, capped);
    `allocate`: exactly `size` KV blocks."""
    size: int = Field(1_000_000_000, ge=1)
    """Bytes to leave free (`reserve`) or number of KV blocks (`allocate`)."""


class StateManagerConfig(_Config):
    max_tracked_sequences: int = Field(2048, ge=1)
    """Most sequences the engine holds at once (running and waiting)."""
    max_ragged_batch_size: Optional[int] = Field(None, ge=1)
    """Token budget of one forward pass (Dynamic SplitFuse). Unset: on CPU, the smallest budget at which this
    machine's matmuls reach 90% of their peak rate, measured at start-up (at least 256); on GPU 768 (MII's
    default). The engine plan shows the choice and why."""
    max_ragged_sequence_count: int = Field(512, ge=1)
    """Most sequences in one forward pass."""
    itl_target_ms: Optional[float] = Field(None, gt=0, le=60_000, allow_inf_nan=False)
    """Inter-token latency target of running streams: a step with decode tokens carries only the prompt tokens that
    keep every stream's gaps (their EMA over 16 tokens, as FastGen's SLA) within it, by the step times measured so
    far (`mii.engine.pacing`). Unset: prompt chunks fill the token budget (throughput first)."""
    max_context: int = Field(8192, ge=1)
    """Longest sequence (prompt + generated) the engine accepts; also capped by the model's own context."""
    kv_block_size: Optional[int] = Field(None, ge=1)
    """Tokens per KV cache block; chosen by the engine plan when unset."""
    memory_config: MemoryConfig = Field(default_factory=MemoryConfig)
    """How large the KV cache is."""


class InferenceEngineConfig(_Config):
    state_manager: StateManagerConfig = Field(default_factory=StateManagerConfig)


class ModelConfig(_Config):
    model_name_or_path: str = ""
    """A local Hugging Face folder, a hub id already in the local cache, or a `.gguf` file."""
    tokenizer: Optional[str] = None
    """Where to load the tokenizer from, when not from the model itself."""
    task: TaskType = TaskType.TEXT_GENERATION
    tensor_parallel: int = Field(1, ge=1)
    """Processes (ranks) the model is sharded over, joined with torch.distributed (gloo on CPU, NCCL on GPU, one
    GPU per rank). Under torchrun (RANK/WORLD_SIZE set) `mii.pipeline` joins that group and defaults to WORLD_SIZE."""
    replica_num: int = Field(1, ge=1)
    """Independent engines (each `tensor_parallel` processes) behind a deployment's load balancer."""
    max_length: Optional[int] = Field(None, ge=1)
    """Default `max_length` (prompt + generated) of a request; the model's context when unset."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype; `auto` picks bfloat16 where the device has fast bf16 matmul, else float32 (CPU) / float16."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = "auto"
    """The KV cache's dtype. `auto`: bfloat16 where the weights are kept in bf16 with fp32 math (a CPU without
    native bf16 matmul: half the bytes that attention reads each step, twice the tokens per GiB), else the compute
    dtype. On CPU a bf16/fp16 cache may sit under fp32 math (keys and values rounded as they are written, the
    attention in fp32); on a GPU the cache keeps the compute dtype. `int8` (CPU, bf16 math, mii's attention kernel
    on a CPU with AVX512-VNNI and AVX512-BF16, head size 64 or 128): each key and value row quantized to int8 with
    its own scale as it is written (half a bf16 cache's bytes, ~1.9x the tokens per GiB), queries quantized per row
    for the keys' integer dot products; lossy, opt-in."""
    device: str = "auto"
    """`auto` (cuda when a GPU is visible, else cpu), `cpu`, `cuda` (the current GPU; one GPU per rank under
    tensor parallelism) or `cuda:N` (GPU N, a single-rank engine)."""
    cuda_graphs: bool = True
    """On a GPU: capture decode steps as CUDA graphs at start (padded batch sizes; sizes and capture time in the
    engine plan) and replay them when a step fits; False runs every step eagerly. Ignored on CPU."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching: a request's leading full KV blocks already computed for an earlier request with
    the same tokens (a system prompt, the conversation so far) are shared instead of computed again; outputs are
    identical. False computes every prompt in full (`mii serve --no-prefix-caching`)."""
    quantization: Optional[Literal["auto", "none", "int8", "int4"]] = "auto"
    """Weight-only quantization of the linears (`mii.loading.quantize`; CPU only): `int8` (symmetric, one scale
    per output channel) or `int4` (a scale and an offset per group of `quantization_group` input features); the
    activations, the LM head, the embedding and the KV cache keep their dtypes. `auto` (the default): a GGUF file
    keeps its own quantization (Q8_0 → int8, Q4_0 / Q4_1 → int4 exactly, Q4_K → int4 with its sub-scales rounded
    to fp16; other formats are dequantized), a float checkpoint stays unquantized. `none` (or None): every weight
    in the model's dtype, a GGUF dequantized (`mii serve --quantization none`). The engine plan lists the bytes
    per format."""
    quantization_group: Optional[int] = Field(None, ge=32)
    """Input features per scale when `quantization` quantizes a float weight: a multiple of 32; unset: 64 for
    int4, one group per output channel for int8. A matrix whose input size it does not divide takes the largest
    of 128/64/32 (not above it) that does, and the plan says so. A GGUF's own blocks keep their 32."""
    quantize_activations: bool = False
    """Opt-in speed for int4 linears on CPU: their inputs rounded to int8 per 32 columns (as llama.cpp's Q8
    activations) instead of int16, so the 4-bit weights multiply with twice the multiply-adds per instruction:
    single-stream decode ~1.1-1.2x faster on AVX2. The price: an error up to 1/254 of each 32 columns' largest
    value, so outputs are close to, not the same as, the dequantized model's (perplexity +0.4% on the embedded
    model), and a request's logprobs can move slightly with the batch it shares a step with. Needs int4 weights
    (`quantization` int4, or a GGUF's 4-bit blocks); the engine plan's `activations` row says what ran."""
    quantization_mode: Optional[str] = None
    """Reserved (MII's field for its GPU FP6 kernels); only None: use `quantization`."""
    inference_engine_config: InferenceEngineConfig = Field(default_factory=InferenceEngineConfig)
    torch_dist_port: int = Field(29500, ge=1, le=65535)
    """Rendezvous port of the tensor-parallel group on 127.0.0.1 (replica i of a deployment uses this + i)."""
    device_map: Any = DEVICE_MAP_DEFAULT
    """MII's field: the GPUs of each replica, one id per tensor-parallel rank — a GPU id, a list of ids (one replica), a
    list of such lists (one per replica) or {"localhost": lists}. `auto`: replica i takes GPUs i*tp .. (i+1)*tp-1.
    No GPU may serve two ranks; see `mii.parallel.placement`."""
    all_rank_output: bool = False
    """Under torchrun: every rank's pipeline call returns rank 0's results (otherwise the other ranks get [])."""
    sync_debug: bool = False
    """MII's field (synchronize the device after every step, for debugging); only False is supported: run with
    CUDA_LAUNCH_BLOCKING=1 instead."""
    profile_model_time: bool = False
    """MII's field (time each forward and report it as `model_time_taken`); only False is supported: the
    deployment's `/metrics` has time to first token, inter-token and end-to-end latency histograms."""
    num_threads: Optional[int] = Field(None, ge=1, le=4096)
    """CPU threads of each engine process (each tensor-parallel rank); the cores divided between the processes
    on this host when unset. More than the cores the process may use share them (the plan says so)."""
    trust_remote_code: bool = False
    """Hugging Face's switch to run Python code that comes with a checkpoint; only False: mii never runs a
    checkpoint's code (it has its own implementation of each supported architecture, and reads `.bin` weights
    with `weights_only`)."""
    seed: Optional[int] = None
    """Seed of the stream of sampling seeds given to requests that do not bring their own `seed`. None (the
    default): fresh entropy in every process, so every run and every replica samples differently; a number makes
    a deployment's samples reproducible."""

    @field_validator("sync_debug", "profile_model_time")
    @classmethod
    def _not_implemented(cls, v, info):
        instead = {"sync_debug": "run with CUDA_LAUNCH_BLOCKING=1 to synchronize after every kernel",
                   "profile_model_time": "read the latency histograms of the deployment's /metrics, or use "
                                         "torch.profiler around mii.pipeline calls"}
        if v:
            raise ValueError(f"{info.field_name}=True is not supported (MII's debugging option); "
                             f"{instead[info.field_name]}")
        return v

    @field_validator("trust_remote_code")
    @classmethod
    def _no_remote_code(cls, v):
        if v:
            raise ValueError("trust_remote_code=True is not supported: mii never runs code that comes with a "
                             "checkpoint; models load only into mii's own implementations (mii/models)")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str):
        if v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v):
            return v
        raise ValueError(f"device={v!r}: expected auto, cpu, cuda or cuda:N")

    @model_validator(mode="after")
    def _one_gpu_per_rank(self):
        if ":" in self.device and self.tensor_parallel > 1:
            raise ValueError(f"device={self.device!r} names one GPU, but tensor_parallel={self.tensor_parallel} "
                             "needs one per rank: use device='cuda' (ranks take GPUs 0..N-1 of CUDA_VISIBLE_DEVICES)")
        return self

    @field_validator("quantization_mode")
    @classmethod
    def _no_quantization(cls, v):
        if v is not None:
            raise ValueError(f"quantization_mode={v!r} is not supported (only None; weight-only int8/int4 on CPU "
                             "is quantization='int8' / 'int4')")
        return v

    @field_validator("quantization", mode="before")
    @classmethod
    def _quantization(cls, v):
        return "none" if v is None else v.lower() if isinstance(v, str) else v

    @field_validator("quantization_group")
    @classmethod
    def _group(cls, v):
        if v is not None and v % 32:
            raise ValueError(f"quantization_group={v} is not a multiple of 32 (32, 64, 128, ...)")
        return v


class MIIConfig(_Config):
    deployment_name: str = ""
    """Name that `mii.client(name)` finds the deployment by; `<model basename>-mii-deployment` when empty."""
    deployment_type: DeploymentType = DeploymentType.LOCAL
    """MII's field; only `local` (processes on this host) is supported: AzureML deployments (`aml`) are not."""
    port_number: int = Field(50050, ge=1, le=65535)
    """gRPC port of the deployment's load balancer (MII's service)."""
    enable_restful_api: bool = False
    """Also serve HTTP: MII's REST gateway (`POST /mii/{deployment_name}`) and the OpenAI-compatible API."""
    enable_chat_ui: bool = True
    """With `enable_restful_api`: serve a chat page at `GET /` of the HTTP gateway (it talks to the OpenAI API;
    `mii serve --no-ui` turns it off, and `/` is then a 404)."""
    restful_api_host: str = "localhost"
    """Address the HTTP gateway binds to (loopback unless told otherwise; `0.0.0.0` for every interface)."""
    grpc_host: str = "localhost"
    """Address MII's gRPC service (`port_number`) binds to: loopback unless told otherwise, since it also carries
    `Terminate`; with an `api_key`, every call but `grpc.health.v1` must carry it."""
    restful_api_port: int = Field(28080, ge=1, le=65535)
    """HTTP port (REST gateway and OpenAI API)."""
    hostfile: str = HOSTFILE_DEFAULT
    """MII's field (DeepSpeed's multi-node hostfile); only its default is accepted. Several machines are a Ray
    cluster here (`cluster="ray"`), which places the replicas itself: a hostfile has nothing left to say."""
    cluster: Literal["local", "ray"] = "local"
    """Where the replicas run: `local`, processes on this host; `ray`, actors that a Ray cluster places on its
    nodes (`pip install 'mii[ray]'`), each replica with all of its tensor-parallel ranks on one node."""
    ray_address: Optional[str] = None
    """With `cluster="ray"`: the cluster to join (`auto`: the one running on this host; `HOST:PORT`: its GCS
    address); none starts a cluster of this host alone (or joins `$RAY_ADDRESS` when set)."""
    max_waiting_requests: Optional[int] = Field(None, ge=0)
    """Requests an engine may hold waiting for a slot before new ones are refused at once (gRPC RESOURCE_EXHAUSTED,
    HTTP 429); unbounded (up to `max_tracked_sequences`) when unset."""
    stream_interval_ms: float = Field(20.0, ge=0, le=10_000, allow_inf_nan=False)
    """A stream's chunks come at most this often (milliseconds) per request: the tokens of the steps between join the
    next chunk. The first token and the last are sent at once. Each chunk wakes the replica's handler and the front
    process, which on a machine of few cores take them from the engine's steps (one stream on 2 cores: 20 ms streamed
    ~1.25x faster than a chunk every step). 0: a chunk every engine step, as MII and vLLM send them."""
    request_timeout: Optional[float] = Field(None, gt=0)
    """Seconds a request may take from arrival to its last token; past it the request is aborted (its KV blocks
    freed) and answered with gRPC DEADLINE_EXCEEDED / HTTP 504. A client's own gRPC deadline applies as well.
    No limit when unset."""
    drain_timeout: float = Field(30.0, ge=0)
    """On shutdown (`terminate_server`, SIGTERM, SIGINT): seconds the requests in flight get to finish while new ones
    are refused (503 / UNAVAILABLE); those still running then end with an error. A second signal stops at once."""
    api_key: Optional[str] = Field(None, repr=False)
    """When set, every HTTP route but `/health` (and `/metrics`, unless `metrics_need_key`) requires
    `Authorization: Bearer <api_key>`, and every gRPC call but the health service the same as metadata
    (`mii.client` sends it); compared in constant time."""
    metrics_need_key: bool = False
    """Require the `api_key` on `/metrics` too (by default Prometheus may scrape it without one)."""
    max_request_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body (HTTP) or message (gRPC) accepted, in bytes; larger ones are refused (HTTP 413,
    gRPC RESOURCE_EXHAUSTED)."""
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral"] = "auto"
    """How the OpenAI API reads tool calls in the model's answers (`tool_choice="auto"`): `hermes` (Hermes, Qwen
    2.5/3: `<tool_call>{json}</tool_call>`), `llama3_json` (Llama 3.x: `{"name", "parameters"}`), `mistral`
    (`[TOOL_CALLS][...]`); `auto` picks the one the chat template writes (none if it writes none of them); `none`
    turns it off (`tool_choice="required"` and named functions, being constrained, work without one)."""
    reasoning_parser: Literal["auto", "none", "think", "deepseek_r1", "qwen3"] = "auto"
    """How the OpenAI API splits a reasoning model's thinking (`<think>…</think>`) into `reasoning_content`:
    `think` (`deepseek_r1` and `qwen3` are other names for it); `auto` turns it on when the chat template handles
    `</think>`; `none` leaves the thinking in `content`."""
    model_config_: ModelConfig = Field(default_factory=ModelConfig, alias="model_config")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              populate_by_name=True)

    @field_validator("deployment_type", mode="before")
    @classmethod
    def _local_only(cls, v):
        if str(getattr(v, "value", v)).lower() != DeploymentType.LOCAL.value:
            raise ValueError(f"deployment_type={v!r} is not supported: only 'local' (processes on this host; "
                             "AzureML deployments are not)")
        return v

    @model_validator(mode="after")
    def _ray_address_needs_ray(self):
        if self.ray_address is not None and self.cluster != "ray":
            raise ValueError(f"ray_address={self.ray_address!r} is given but cluster={self.cluster!r}: set "
                             "cluster='ray' to serve on a Ray cluster")
        return self

    @field_validator("hostfile")
    @classmethod
    def _one_host(cls, v):
        if v != HOSTFILE_DEFAULT:
            raise ValueError(f"hostfile={v!r} is not supported: to serve from several machines, make them one Ray "
                             "cluster (`ray start --head` on one, `ray start --address HEAD:6379` on the others) and "
                             "serve with cluster='ray' (mii serve MODEL --ray auto); Ray places the replicas")
        return v


def _split_known(cls: type[BaseModel], kwargs: dict) -> tuple[dict, dict]:
    fields = {name for name in cls.model_fields} | {f.alias for f in cls.model_fields.values() if f.alias}
    known = {k: v for k, v in kwargs.items() if k in fields}
    return known, {k: v for k, v in kwargs.items() if k not in fields}


def build_config(cls: type[_Config], given: Any, **overrides) -> Any:
    """Build a config from an instance, a dict or nothing, plus keyword overrides; typed errors on bad input."""
    from pydantic import ValidationError as PydanticError

    if isinstance(given, cls):
        data = given.model_dump(by_alias=True)
    elif given is None:
        data = {}
    elif isinstance(given, dict):
        data = dict(given)
    else:
        raise ValidationError(cls.__name__, f"expected a dict or {cls.__name__}, got {type(given).__name__}")
    data.update(overrides)
    _, unknown = _split_known(cls, data)
    if unknown:
        raise UnknownArgument(f"unknown argument(s) for {cls.__name__}: {', '.join(sorted(unknown))}")
    try:
        return cls.model_validate(data)
    except PydanticError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise UnknownArgument(f"unknown argument for {cls.__name__}: {loc}") from None
        raise ValidationError(loc or cls.__name__, f"{err['msg']} (got {err.get('input')!r})") from None


def split_kwargs(kwargs: dict, *classes: type[BaseModel]) -> tuple[list[dict], dict]:
    """Split keyword arguments into those each config class accepts and the rest."""
    parts, rest = [], dict(kwargs)
    for cls in classes:
        known, rest = _split_known(cls, rest)
        parts.append(known)
    return parts, rest
