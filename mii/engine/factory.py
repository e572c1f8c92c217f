"""`build_engine`: the one way an engine comes to be, for `mii.pipeline`, a deployment's replica and a spawned
tensor-parallel worker: device plan and threads, model source, the tensor-parallel group, weights, then the engine
on rank 0 (or the runner that follows rank 0's steps on the other ranks)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mii.config import ModelConfig
from mii.engine.engine import PLAN_LOG, Engine, finish_plan_and_build_runner
from mii.engine.model_runner import ModelRunner
from mii.engine.plan import EnginePlan, plan_device
from mii.engine.requests import InputProcessor
from mii.envs import collections_paused, cpu_flags
from mii.errors import ValidationError
from mii.kernels import cpu_kernels_origin
from mii.layers.quant import use_int8_activations
from mii.loading import gguf_file, load_model, resolve_source
from mii.loading.quantize import quant_spec
from mii.parallel.group import TPGroup, active_group, start

log = logging.getLogger("mii")


@dataclass
class BuiltEngine:
    plan: EnginePlan
    tokenizer: Any
    engine: Optional[Engine] = None
    """The engine, on rank 0 (or without tensor parallelism)."""
    follower: Optional[ModelRunner] = None
    """On the other tensor-parallel ranks: the runner that executes rank 0's steps."""
    tp_group: Optional[TPGroup] = None

    def input_processor(self) -> InputProcessor:
        return InputProcessor(self.tokenizer, self.engine.limits, self.engine.grammars)


@collections_paused()  # (what it builds stays: see there)
def build_engine(model_config: ModelConfig, tp_group: Optional[TPGroup] = None) -> BuiltEngine:
    """Load `model_config`'s model and build its engine. With `tensor_parallel > 1` this process starts the group
    (spawned workers) or joins it (torchrun) unless it is a spawned worker that joined already (`tp_group`)."""
    if tp_group is None and active_group() is not None:  # the layers' rank and size are process-wide
        raise ValidationError("tensor_parallel", "a tensor-parallel pipeline is running in this process; "
                                                 "destroy() it before creating another pipeline")
    started = time.perf_counter()
    source = resolve_source(model_config.model_name_or_path)  # a wrong path fails before the kernels' build
    kernels_before = cpu_kernels_origin()
    plan = plan_device(model_config)
    plan.startup["kernels"] = time.perf_counter() - started  # (with the device plan: a few ms beside them)
    kernels = ("already loaded in this process" if kernels_before else cpu_kernels_origin()) \
        if plan.attention == "kernel" and plan.device == "cpu" else ""
    converted = source.kind == "gguf" and gguf_file.is_converted(source.path)
    torch.set_num_threads(plan.num_threads)
    quant, plan.reasons["quantization"] = quant_spec(model_config.quantization, model_config.quantization_group,
                                                     plan.device, source.kind)  # may refuse: before any rank starts
    if model_config.quantize_activations and not (quant.scheme == "int4" or quant.keep_file):
        raise ValidationError("quantize_activations", "rounds the inputs of int4 linears, and this model has none: "
                              "use quantization='int4' (or a GGUF with 4-bit blocks)")
    group_started = None
    if tp_group is None and model_config.tensor_parallel > 1:
        if source.kind == "gguf":  # convert once here, before the other ranks read it
            clock = time.perf_counter()
            gguf_file.cached_folder(source.path, source.name)
            plan.startup["checkpoint"] = time.perf_counter() - clock
        tp_group = group_started = start(model_config.model_copy(update={"num_threads": plan.num_threads}),
                                         plan.device)
    try:
        loaded = load_model(source, plan.torch_dtype, torch.device(plan.device), model_config.tokenizer,
                            bf16_weights=plan.linear_backend == "kernel", bf16_kpairs=plan.bf16_kpairs,
                            quantization=quant)
        plan.weight_bytes = loaded.weight_bytes
        for part, seconds in loaded.startup.items():
            plan.startup[part] = plan.startup.get(part, 0.0) + seconds
        if model_config.quantize_activations:
            n = use_int8_activations(loaded.model)
            if not n:
                raise ValidationError("quantize_activations", "rounds the inputs of int4 linears, and this model "
                                      f"has none (its weights: {', '.join(loaded.weight_bytes)})")
            plan.activations = f"int8 per 32 columns in the {n} int4 linears"
            plan.reasons["activations"] = ("quantize_activations=True: ~1.1-1.2x decode and prompts, outputs close "
                                           "to the int16 path's, not identical")
        if loaded.quantization is not None:
            plan.quantization = loaded.quantization.summary() or "none"
            if loaded.quantization.kept_raw or loaded.quantization.quantized:
                plan.reasons["linears"] = (f"the int8/int4 linears: mii::linear_quant{_tile_rows(plan)}; this row: "
                                           "the other weights")
        if tp_group is None or tp_group.rank == 0:
            clock = time.perf_counter()
            engine = Engine(loaded, model_config, plan, tp_group)
            plan = engine.plan
            plan.startup["engine"] = time.perf_counter() - clock
            plan.startup["total"] = time.perf_counter() - started
            plan.reasons["start-up"] = _startup_reason(plan, loaded, kernels, converted)
            log.info(PLAN_LOG, source.name, plan.describe())
            return BuiltEngine(plan, loaded.tokenizer, engine=engine, tp_group=tp_group)
        plan, runner = finish_plan_and_build_runner(loaded, model_config, plan, tp_group)
        return BuiltEngine(plan, loaded.tokenizer, follower=runner, tp_group=tp_group)
    except BaseException:
        if group_started is not None:  # the other ranks may be anywhere in loading: stop them hard
            group_started.close(graceful=False)
        raise


def _startup_reason(plan: EnginePlan, loaded, kernels: str, converted: bool) -> str:
    """What building the engine did, part by part: what was built or converted now, what came from the cache
    (`$MII_CACHE_DIR`, default ~/.cache/mii), and what is redone at every start."""
    t = plan.startup
    parts = [f"CPU kernels {kernels}"] if kernels else []
    if loaded.source.kind == "gguf":
        parts.append(f"GGUF {'read as converted before' if converted else 'converted now'} in {t['checkpoint']:.1f} s "
                     f"({gguf_file.folder_for(loaded.source.path)})")
    parts.append(f"weights {t['weights']:.1f} s" + (f" ({loaded.weights_cache})" if loaded.weights_cache else ""))
    parts.append(f"tokenizer {t['tokenizer']:.1f} s")
    parts.append(f"KV cache and plan {t['engine']:.1f} s")
    return "; ".join(parts)


def _tile_rows(plan: EnginePlan) -> str:
    """How the int8/int4 tiles take prompt chunks' and batches' bf16 rows on this CPU (mii::tile_block_rows, measured
    once per process), where they take them (no AMX)."""
    if plan.device != "cpu" or plan.dtype != "bfloat16" or plan.amx() or "avx512_bf16" not in cpu_flags():
        return ""
    try:
        rows = torch.ops.mii.tile_block_rows()
    except (NotImplementedError, RuntimeError):  # the CPU kernels did not load
        return ""
    why = ("this CPU runs 12 chains of vdpbf16ps faster than 8" if rows == 6 else "8 chains of vdpbf16ps fill this CPU")
    return (f", prompt chunks' and batches' rows in blocks of {rows} ({why}; measured at start, MII_TILE_ROWS=4|6 "
            "overrides)")
