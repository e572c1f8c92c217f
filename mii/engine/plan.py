"""The engine plan: every "auto" choice (device, dtype, threads, KV block size and count, token budget)
resolved from the hardware and the model, with the reason for each; logged at start, exposed as
`pipe.engine_plan`."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from mii.config import ModelConfig
from mii.envs import (amx_disabled, cpu_flags, kernels_disabled, quant_tiles_bf16, ranks_on_this_host,
                      thread_pace_disabled)
from mii.errors import KVCacheError, ValidationError

log = logging.getLogger("mii")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
CPU_KV_CAP_BYTES = 2 << 30
ATTENTION_LABELS = {"torch": "torch SDPA over gathered KV blocks",
                    "kernel": "mii::paged_attention (KV blocks read in place, one call per layer); "
                              "fused rms_norm+residual, rotary, silu*mul; pre-norm RMSNorm/SiLU models run all "
                              "their layers in one mii::decoder_stack call",
                    "kernel on cuda": "mii::paged_attention (Triton: KV blocks read in place, one or two launches "
                                      "a layer); fused rms_norm+residual, rotary, silu*mul (Triton, one launch each)"}
LINEAR_LABELS = {"torch": "torch (oneDNN/MKL)",
                 "kernel": "mii::linear_bf16w (bf16 weights, tiled for one sequential stream, widened to fp32 in "
                           "registers)"}
KPAIRS_LABEL = "mii::linear_bf16w (bf16 weights tiled by pairs of columns, native bf16 dot products)"


@dataclass
class EnginePlan:
    device: str
    dtype: str
    num_threads: int
    kv_block_size: int = 0
    kv_num_blocks: int = 0
    kv_cache_bytes: int = 0
    kv_dtype: str = ""
    """The KV cache's dtype ("" until planned: the compute dtype)."""
    max_batch_tokens: int = 0
    max_batch_seqs: int = 0
    itl_target_ms: float | None = None
    """`itl_target_ms`: prompt chunks beside running streams sized to keep their inter-token latency within it."""
    max_context: int = 0
    tensor_parallel: int = 1
    attention: str = "torch"
    """Attention backend: "kernel" (mii::paged_attention, reads the KV blocks in place) or "torch" (gathered
    blocks + SDPA, the reference)."""
    linear_backend: str = "torch"
    """"torch", "kernel" (mii::linear_bf16w: bf16 weights, fp32 math) or oneDNN's prepacked bf16 (a label)."""
    cuda_graphs: str = ""
    """On a GPU: the captured decode batch sizes, capture time and memory, or why there are none."""
    quantization: str = "none"
    """Weight-only quantization of the linears (`mii.loading.quantize`): what each linear became and from what."""
    activations: str = ""
    """`quantize_activations`: which linears round their inputs to int8 ("" when none do)."""
    weight_bytes: dict = field(default_factory=dict)
    """Bytes of the weights by format ("int4 g32", "bf16", "fp32", ...), as loaded (one rank's shard)."""
    prefix_caching: bool = True
    """Automatic prefix caching: full KV blocks shared by content between requests (`mii.engine.kv_cache`)."""
    startup: dict = field(default_factory=dict)
    """Seconds to build the engine ("total") and its parts ("kernels", "checkpoint", "weights", "tokenizer",
    "engine"); what was built, converted or found in the cache: reasons["start-up"]."""
    reasons: dict = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype or self.dtype]

    @property
    def bf16_kpairs(self) -> bool:
        """The kernel's linears multiply bf16 activations with native bf16 dot products (k-pair tiled weights)."""
        return self.linear_backend == "kernel" and self.dtype == "bfloat16" and cpu_has_fast_bf16()

    @property
    def weight_dtype(self) -> str:
        """The dtype the linear, LM head and embedding weights are kept in: the model's dtype, or bf16 with fp32
        math (mii::linear_bf16w) on CPUs without native bf16 matmul."""
        return "bfloat16" if self.linear_backend == "kernel" else self.dtype

    def as_dict(self) -> dict:
        """The plan as JSON (a deployment's `GET /engine_plan`): its fields, the weight dtype, `describe()`'s text."""
        return {**asdict(self), "weights": self.weight_dtype, "text": self.describe()}

    def describe(self) -> str:
        packed = any(k.startswith(("int4", "int8")) for k in self.weight_bytes)
        weights = self.weight_dtype + ("; int8/int4 where quantization says" if packed else "")
        rows = [("device", self.device), ("dtype", self.dtype), ("weights", weights),
                ("threads", self.num_threads),
                ("tensor parallel", f"{self.tensor_parallel} rank(s)"),
                ("attention", ATTENTION_LABELS.get(f"{self.attention} on {self.device.split(':')[0]}",
                                                   ATTENTION_LABELS.get(self.attention, self.attention))),
                ("linears", KPAIRS_LABEL if self.bf16_kpairs else LINEAR_LABELS.get(self.linear_backend,
                                                                                     self.linear_backend)),
                ("kv dtype", self.kv_dtype or self.dtype),
                ("kv_block_size", self.kv_block_size),
                ("kv_blocks", f"{self.kv_num_blocks} ({self.kv_num_blocks * self.kv_block_size} tokens, "
                              f"{self.kv_cache_bytes / 2**20:.0f} MiB)"),
                ("token budget", self.max_batch_tokens), ("max sequences/step", self.max_batch_seqs),
                ("prompt chunks", "fill the token budget" if self.itl_target_ms is None else
                 f"beside running streams, what keeps their inter-token latency within {self.itl_target_ms:g} ms"),
                ("max context", self.max_context),
                ("prefix caching", "on" if self.prefix_caching else "off")]
        if self.cuda_graphs:
            rows.append(("cuda graphs", self.cuda_graphs))
        amx = self.amx()
        if amx:
            rows.append(("matrix units", amx))
        rows.append(("quantization", self.quantization))
        if self.activations:
            rows.append(("activations", self.activations))
        if self.weight_bytes:
            rows.append(("weight bytes", ", ".join(f"{k} {_size(v)}" for k, v in self.weight_bytes.items())
                         + (" per rank" if self.tensor_parallel > 1 else "")))
        if "total" in self.startup:
            rows.append(("start-up", f"{self.startup['total']:.1f} s"))
        return "\n".join(f"  {k:<20} {v}" + (f"  ({self.reasons[k]})" if k in self.reasons else "") for k, v in rows)

    def amx(self) -> str:
        """What the CPU kernels do with AMX (Intel Xeon 4th generation and later), where the CPU has it and bf16
        math runs through them; "" elsewhere."""
        if self.device != "cpu" or self.dtype != "bfloat16" or self.attention != "kernel" or \
                "amx_bf16" not in cpu_flags():
            return ""
        if amx_disabled():
            return "AMX off (MII_AMX=0): vdpbf16ps for every row count"
        tiles = ("int4/int8 weights from 9, rounded to bf16 in the tiles: MII_QUANT_TILES=bf16" if quant_tiles_bf16()
                 else "int4/int8 weights from 9")
        return (f"AMX tiles (tdpbf16ps) for the linears of prompt chunks and batches (bf16 weights from 5 rows, {tiles}) "
                "and for prompt chunks' attention (MII_AMX=0 turns them off)")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def cpu_has_fast_bf16() -> bool:
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def cuda_dtype(capability: tuple) -> str:
    """The auto dtype on a GPU of this compute capability: bf16 on sm80+ (Ampere on, bf16 tensor cores), else
    fp16 (`torch.cuda.is_bf16_supported()` also says yes where bf16 is only emulated)."""
    return "bfloat16" if tuple(capability) >= (8, 0) else "float16"


def check_cuda_device(device: str, count: int) -> str:
    """`cuda` or `cuda:N`, checked against the `count` GPUs torch sees."""
    if count == 0:
        raise ValidationError("device", f"{device} was asked for, but torch sees no GPU")
    if ":" in device and int(device.split(":")[1]) >= count:
        raise ValidationError("device", f"{device}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return device


def plan_device(cfg: ModelConfig) -> EnginePlan:
    """Device, dtype and threads: what must be known before the model is built."""
    reasons = {}
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        reasons["device"] = "auto: " + ("a GPU is visible" if device == "cuda" else "no GPU visible")
    if device.startswith("cuda"):
        device = check_cuda_device(device, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if ":" in device:
            torch.cuda.set_device(torch.device(device))  # kernels launch and memory is counted on the current GPU
    dtype = cfg.dtype
    if dtype == "auto":
        if device.startswith("cuda"):
            cap = torch.cuda.get_device_capability(torch.device(device))
            dtype = cuda_dtype(cap)
            reasons["dtype"] = f"auto: sm{cap[0]}{cap[1]} " + (
                "has bf16 tensor cores" if dtype == "bfloat16" else "has no bf16 tensor cores (sm80+ has)")
        elif cpu_has_fast_bf16():
            dtype = "bfloat16"
            reasons["dtype"] = "auto: this CPU has native bf16 matmul (avx512_bf16/amx), ~4x fp32"
        else:
            dtype = "float32"
            reasons["dtype"] = "auto: this CPU has no native bf16 matmul"
    elif dtype == "float16" and device == "cpu":
        log.warning("float16 matmul is very slow on most CPUs; bfloat16 or float32 is recommended")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = ranks_on_this_host(cfg.tensor_parallel)
    threads = cfg.num_threads or max(1, cores // ranks)
    if not cfg.num_threads:
        reasons["threads"] = ("auto: every core this process may use" if ranks == 1 else
                              f"auto: {cores} cores shared by {ranks} tensor-parallel ranks, per rank")
    elif threads * ranks > cores:
        reasons["threads"] = f"more threads than the {cores} cores this process may use: they share them"
    if threads > 1 and device == "cpu" and not thread_pace_disabled():
        reasons["threads"] = ((reasons["threads"] + "; ") if "threads" in reasons else "") + (
            "fewer while other processes take the steps' threads off their cores (mii's decoder stack times them; "
            "MII_THREAD_PACE=0: never)")
    if cfg.tensor_parallel > 1:
        reasons["tensor parallel"] = (f"one process per rank, {'NCCL' if device.startswith('cuda') else 'gloo'}; "
                                      "weights and KV heads sharded")
    plan = EnginePlan(device=device, dtype=dtype, num_threads=threads, tensor_parallel=cfg.tensor_parallel,
                      prefix_caching=cfg.enable_prefix_caching, reasons=reasons)
    reasons["prefix caching"] = (
        "default: full KV blocks shared by a hash of their tokens and all before them; a request computes only what "
        "the cache lacks; same outputs, sliding windows too (blocks are kept whole, masked by absolute position)"
        if plan.prefix_caching else "off: enable_prefix_caching=False")
    plan_attention(plan)
    plan_linears(plan, auto_dtype=cfg.dtype == "auto")
    plan_kv_dtype(plan, cfg.kv_cache_dtype)
    return plan


def plan_linears(plan: EnginePlan, auto_dtype: bool) -> None:
    """With mii's CPU kernels built, keep the linear, LM head and embedding weights in bf16, tiled so that every
    weight is read as one sequential stream, and multiply them with mii::linear_bf16w:
    - on a CPU without native bf16 matmul, when the dtype is auto (activations fp32) or bf16 (activations bf16):
      weights widened to fp32 in registers; a decode step streams half the bytes of fp32 weights, and oneDNN's
      emulated bf16 GEMM is avoided. An explicit float32 keeps float32 weights.
    - on a CPU with native bf16 dot products (AVX512-BF16, AMX machines have it too), when the dtype is bf16:
      k-pair tiles for `vdpbf16ps`, for decode rows and prompt chunks alike. oneDNN's prepacked weights are as
      fast for prompt chunks but read the weights of a decode step at about half the rate."""
    if plan.device != "cpu" or plan.attention != "kernel":
        return
    if cpu_has_fast_bf16():
        if plan.dtype != "bfloat16":
            return
        plan.linear_backend = "kernel"
        plan.reasons["weights"] = ("native bf16 dot products (vdpbf16ps) on weights tiled by pairs of columns: "
                                   "one sequential stream a matmul, decode rows and prompt chunks alike")
        return
    if not (auto_dtype or plan.dtype == "bfloat16"):
        return
    plan.linear_backend = "kernel"
    plan.reasons["weights"] = ("auto: " if auto_dtype else "") + (
        "no native bf16 matmul on this CPU: weights kept in bf16 (half the bytes of fp32 per decode step), "
        "math in fp32; dtype=float32 keeps fp32 weights")


def plan_kv_dtype(plan: EnginePlan, asked: str) -> None:
    """The KV cache's dtype: bf16 where the weights are bf16 under fp32 math (attention reads half the bytes, the
    cache holds twice the tokens; transformers' bf16 model keeps a bf16 cache too), else the compute dtype. On CPU
    a bf16/fp16 cache under fp32 math is read by both attention backends; a GPU's kernels read the compute dtype."""
    if asked == "auto":
        mixed = plan.linear_backend == "kernel" and plan.dtype == "float32"
        plan.kv_dtype = "bfloat16" if mixed else plan.dtype
        plan.reasons["kv dtype"] = ("auto: bf16 like the weights, attention math in fp32: half the bytes a step reads"
                                    if mixed else "auto: the compute dtype")
        return
    if asked == "int8":
        if not (plan.device == "cpu" and plan.dtype == "bfloat16" and plan.attention == "kernel"):
            raise ValidationError("kv_cache_dtype", f"int8 on {plan.device} under {plan.dtype} math with the "
                                  f"{plan.attention} attention: an int8 cache is read by mii's CPU attention kernel "
                                  "under bfloat16 math only")
        plan.kv_dtype = asked
        plan.reasons["kv dtype"] = ("kv_cache_dtype=int8: each key and value row int8 with its own scale, queries "
                                    "quantized per row for the keys' dot products (lossy; half a bf16 cache's bytes)")
        return
    if asked != plan.dtype and not (plan.device == "cpu" and plan.dtype == "float32"):
        raise ValidationError("kv_cache_dtype", f"{asked} under {plan.dtype} math: the attention kernels read a cache "
                              "in the compute dtype (or, on CPU, bf16/fp16 under float32)")
    plan.kv_dtype = asked
    plan.reasons["kv dtype"] = f"kv_cache_dtype={asked}"


def plan_attention(plan: EnginePlan) -> None:
    """The attention backend: our kernel when it is available for the device, else the torch reference."""
    from mii import kernels

    if kernels_disabled():
        plan.attention, plan.reasons["attention"] = "torch", "MII_KERNELS=0"
        return
    if plan.device == "cpu":
        error = kernels.load_cpu_kernels()
        plan.attention = "torch" if error else "kernel"
        plan.reasons["attention"] = (f"the C++ kernel could not be built: {error}" if error else
                                     "C++ kernel: no block gather, no mask, decode and prompt chunks in one call")
    elif plan.device.startswith("cuda"):
        from mii.kernels.paged_attention_cuda import load_cuda_kernels

        error = load_cuda_kernels()
        plan.attention = "torch" if error else "kernel"
        plan.reasons["attention"] = (f"no Triton ({error}): torch SDPA over gathered blocks" if error else
                                     "Triton kernels: KV blocks read in place, a ragged step in one or two launches")


def plan_memory(plan: EnginePlan, cfg: ModelConfig, bytes_per_block_token: int, model_max_context: int,
                layer_shape: tuple) -> EnginePlan:
    """KV block size and count, token budget and context, once the model's KV size per token (and its
    (hidden, intermediate) size, for the token budget's probe) is known."""
    sm = cfg.inference_engine_config.state_manager
    plan.max_context = min(sm.max_context, model_max_context)
    if sm.max_context > model_max_context:
        plan.reasons["max context"] = f"capped by the model's {model_max_context} positions"
    on_gpu = plan.device.startswith("cuda")
    plan.kv_block_size = sm.kv_block_size or (16 if on_gpu else 32)
    if not sm.kv_block_size:
        plan.reasons["kv_block_size"] = "auto: " + ("16 for GPU kernels" if on_gpu
                                                    else "32: fewer gather indices on CPU, small padding waste")
    block_bytes = bytes_per_block_token * plan.kv_block_size
    mem = sm.memory_config
    if mem.mode == "allocate":
        plan.kv_num_blocks = mem.size
        plan.reasons["kv_blocks"] = "memory_config allocate"
        ram = _available_ram() // ranks_on_this_host(cfg.tensor_parallel)
        if not on_gpu and mem.size * block_bytes > ram:
            raise KVCacheError(f"memory_config allocate asks for {mem.size} KV blocks of {plan.kv_block_size} "
                               f"tokens, {mem.size * block_bytes / 2**30:.3g} GiB, and this host has "
                               f"{ram / 2**30:.3g} GiB of RAM available for it: ask for fewer blocks, or for mode "
                               "'reserve'")
    else:
        if on_gpu:
            free, _ = torch.cuda.mem_get_info(torch.device(plan.device))
            budget = free - mem.size
            plan.reasons["kv_blocks"] = f"reserve: free GPU memory less {mem.size} bytes"
        else:
            ranks = ranks_on_this_host(cfg.tensor_parallel)  # tensor-parallel ranks share the host's RAM
            budget = min(_available_ram() - mem.size, CPU_KV_CAP_BYTES) // ranks
            plan.reasons["kv_blocks"] = (f"reserve: available RAM less {mem.size} bytes, capped at 2 GiB on CPU"
                                         + (f", shared by {ranks} ranks" if ranks > 1 else ""))
        # never more than every tracked sequence at full context needs
        needed = sm.max_tracked_sequences * -(-plan.max_context // plan.kv_block_size)
        plan.kv_num_blocks = min(max(budget, 0) // block_bytes, needed)
    if plan.kv_num_blocks < 1:
        raise KVCacheError(f"the KV cache gets {plan.kv_num_blocks} blocks of {plan.kv_block_size} tokens: "
                           f"too small for even one sequence (memory_config={mem.model_dump()})")
    plan.kv_cache_bytes = plan.kv_num_blocks * block_bytes
    plan.max_batch_tokens = sm.max_ragged_batch_size or plan_token_budget(plan, *layer_shape)
    plan.max_batch_seqs = sm.max_ragged_sequence_count
    return plan


TOKEN_BUDGETS = (64, 128, 256, 512, 768)
MIN_CPU_TOKEN_BUDGET = 256  # below this, a step could not give every running sequence of a busy server its token


def plan_token_budget(plan: EnginePlan, hidden: int, intermediate: int) -> int:
    """The token budget when the config leaves it unset. A step's cost grows with its tokens while the matmul
    rate saturates: past the knee, a bigger budget only makes steps (and the waits of running streams) longer.
    On CPU, measure the rate of the layer's gate/up matmul at each candidate size now, and take the smallest
    that reaches 90% of the best (at least MIN_CPU_TOKEN_BUDGET)."""
    if plan.device.startswith("cuda"):
        plan.reasons["token budget"] = "auto: MII's 768 on GPU"
        return 768
    if plan.dtype != "float32" and not cpu_has_fast_bf16():
        plan.reasons["token budget"] = f"auto: {MIN_CPU_TOKEN_BUDGET} (no probe for this dtype on this CPU)"
        return MIN_CPU_TOKEN_BUDGET
    rates = matmul_rates(min(hidden, 1024), min(2 * intermediate, 4096), plan.torch_dtype)
    peak = max(rates.values())
    knee = min(m for m, r in rates.items() if r >= 0.9 * peak)
    budget = max(knee, MIN_CPU_TOKEN_BUDGET)
    plan.reasons["token budget"] = (f"auto: matmul rate saturates at {knee} rows on this CPU (measured now: "
                                    + ", ".join(f"{m}: {r / 1e9:.0f}" for m, r in rates.items())
                                    + f" GFLOP/s){'' if budget == knee else f'; at least {budget}'}")
    return budget


def matmul_rates(k: int, n: int, dtype: torch.dtype, repeat: int = 3) -> dict:
    """FLOP/s of x [m, k] @ w.T [k, n] for each candidate m, best of `repeat`."""
    w = torch.rand(n, k).to(dtype)
    rates = {}
    for m in TOKEN_BUDGETS:
        x = torch.rand(m, k).to(dtype)
        torch.nn.functional.linear(x, w)
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t)
        rates[m] = 2 * m * k * n / best
    return rates
