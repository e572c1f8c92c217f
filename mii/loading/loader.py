"""Build a model from its source: config → registry → model class; weights routed to parameters that load
(and shard) themselves; tokenizer and end-of-sequence ids alongside."""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from mii.envs import packed_cache_disabled
from mii.errors import MIIError, ModelLoadError
from mii.layers.linear import check_shape, prepack_cpu_bf16, store_weights_bf16
from mii.layers.quant import scheme
from mii.loading import checkpoint, gguf_blocks, gguf_file, packed_cache, quantize
from mii.loading.source import ModelSource
from mii.models.config import ArchConfig, read_hf_config, token_ids_ok
from mii.models.decoder import CausalLM
from mii.models.registry import resolve
from mii.parallel import tp_size

log = logging.getLogger("mii")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    cfg: ArchConfig
    tokenizer: object
    eos_token_ids: tuple
    source: ModelSource
    prepacked: int = 0
    """Linears whose weights were re-laid out for oneDNN (bf16 on CPU)."""
    quantization: Optional[quantize.QuantReport] = None
    """What weight-only quantization did to each linear (`mii.loading.quantize`), when it was asked for."""
    weight_bytes: Optional[dict] = None
    """Bytes of the weights by format ("int4 g32", "bf16", ...), as loaded."""
    startup: Optional[dict] = None
    """Seconds each part of the load took: "checkpoint" (a GGUF's conversion, or finding its converted folder),
    "weights" (read, packed, re-laid out), "tokenizer"."""
    weights_cache: str = ""
    """What of the weights is packed for the kernels and what the packed weights' cache did with it
    (`mii.loading.packed_cache`): "int8/int4 read as packed before from …", "bf16 tiles packed now, saving to …"
    (on a thread of its own), "… packed as they load, at every start" (the cache off or not written), or ""
    (nothing packed)."""


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_tokenizer(folder, tokenizer: Optional[str] = None):
    source = tokenizer or str(folder)
    try:
        generic = _generic_tokenizer_class(source)
        if generic is not None:
            return generic.from_pretrained(source)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {source}: {type(e).__name__}: {e}") from None


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_tokenizer_class(source: str):
    """transformers' generic tokenizer class (a tokenizer.json as it is), where a local folder's
    tokenizer_config.json names it: the class AutoTokenizer would take, without AutoTokenizer's imports (every
    family's configuration, and through Llama's torch.distributed.tensor: 2.1 of the embedded model's 3.6 s
    load, which the GGUF's folder names TokenizersBackend). None otherwise (a hub id, another class)."""
    config = Path(source) / "tokenizer_config.json"
    try:
        name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    if name not in _GENERIC_TOKENIZERS:
        return None
    import transformers

    return getattr(transformers, name, None)  # (TokenizersBackend is transformers 5's; 4's is the other)


def _eos_ids(folder, cfg: ArchConfig, tokenizer) -> tuple:
    ids = list(cfg.eos_token_ids)
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise ModelLoadError(f"{gen} is not a JSON object: {e}") from None
        if eos is not None and not token_ids_ok(eos):
            raise ModelLoadError(f"{gen}: eos_token_id must be an integer or a list of integers (it is {eos!r})")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               tokenizer: Optional[str] = None, prepack: bool = True, bf16_weights: bool = False,
               quantization: Optional[quantize.QuantSpec] = None, bf16_kpairs: bool = False) -> LoadedModel:
    """Build the model in `dtype` on `device` and load its weights. With `bf16_weights`, the linear, LM head and
    embedding weights are then kept in bf16 and multiplied by mii::linear_bf16w (`store_weights_bf16`) instead
    of being prepacked for oneDNN (`bf16_kpairs`: in the layout for native bf16 dot products). With an active
    `quantization`, each linear's weight is packed as int8/int4 as soon as it is loaded (`mii.loading.quantize`);
    the other weights follow `bf16_weights`. On one CPU rank the parameters so packed or tiled are cached, and a
    later load of the same files and settings maps them as they are (`mii.loading.packed_cache`)."""
    clock = time.perf_counter()
    folder = gguf_file.cached_folder(source.path, source.name) if source.kind == "gguf" else source.path
    startup = {"checkpoint": time.perf_counter() - clock}
    clock = time.perf_counter()
    hf = read_hf_config(folder / "config.json")
    files = checkpoint.checkpoint_files(folder)
    spec, cfg = resolve(hf)
    try:
        with _default_dtype(dtype), torch.device(device):
            model = spec.model_class(cfg)
    except MIIError:
        raise
    except (RuntimeError, TypeError, ValueError, MemoryError) as e:  # e.g. sizes this machine cannot hold
        raise ModelLoadError(f"cannot build {cfg.architecture} from {folder / 'config.json'}: "
                             f"{type(e).__name__}: {e}") from None
    quantizing = bool(quantization and quantization.active)
    layout = ("k-pair tiles" if bf16_kpairs else "tiles") if bf16_weights else ""
    cached = (packed_cache.entry(folder, quantization if quantizing else None, dtype, model, layout)
              if (quantizing or bf16_weights) and not packed_cache_disabled() and device.type == "cpu"
              and tp_size() == 1 else None)
    read = packed_cache.load(cached, model) if cached is not None and cached.exists else None
    if read is not None:
        report = read.report
    else:
        tensors, total = checkpoint.iter_folder(files), checkpoint.count_tensors(files) or None
        if source.kind == "gguf":  # the matrices whose exact blocks hold them: floats only if a parameter takes them
            deferred = gguf_blocks.deferred_floats(folder)
            tensors, total = itertools.chain(tensors, deferred), (total or 0) + len(deferred) or None
        quantizer = quantize.Quantizer(model, quantization, folder) if quantizing else None
        load_weights(model, tqdm(tensors, total=total, desc=f"Loading {source.name}", unit="tensor", leave=False),
                     on_loaded=quantizer.loaded if quantizer else None)
        report = quantizer.report if quantizer else None
    model.eval()
    if quantizing:
        quantize.check_model(model, quantization)
    if bf16_weights and read is None:
        store_weights_bf16(model, kpairs=bf16_kpairs)
    packed = _packed(model)
    if not packed:
        weights_cache = ""
    elif read is not None:
        weights_cache = f"{packed} read as packed before from {cached.folder}"
    elif cached is not None and packed_cache.save(cached, model, report):
        weights_cache = f"{packed} packed now, saving to {cached.folder}"
    else:
        weights_cache = f"{packed} packed as they load, at every start"
    prepacked = prepack_cpu_bf16(model) if prepack and not bf16_weights else 0
    quantize.release_freed_memory()  # the float copies quantization or a bf16 re-layout replaced
    startup["weights"] = time.perf_counter() - clock
    clock = time.perf_counter()
    tok = load_tokenizer(folder, tokenizer)
    startup["tokenizer"] = time.perf_counter() - clock
    return LoadedModel(model, cfg, tok, _eos_ids(folder, cfg, tok), source, prepacked, report,
                       quantize.weight_bytes(model), startup, weights_cache)


def _packed(model: torch.nn.Module) -> str:
    """What of the model's weights is laid out for the kernels: "int8/int4", "bf16 tiles", both, or ""."""
    kinds = ["int8/int4"] if any(scheme(p) for p in model.parameters()) else []
    if any(getattr(m, "bf16_kernel", False) for m in model.modules()):
        kinds.append("bf16 tiles")
    return " and ".join(kinds)


def _copy_loader(param, loaded, shard_id=None):
    check_shape(param, loaded)
    param.data.copy_(loaded)


def load_weights(model, tensors, on_loaded: Optional[Callable] = None) -> None:
    """Route (checkpoint name, tensor) pairs to parameters; fail loudly on an unknown or a missing tensor.

    Per pair: the model's `checkpoint_tensors` (re-layouts), `ignored_keys`, `renames`, then stacked MoE experts
    (`expert_shard`) or `packed_modules` pick the parameter and shard id its `weight_loader` receives. A parameter
    lists the shards it needs in `shard_ids`, or they come from `packed_modules`. `on_loaded(name, param,
    sources, materialize)` is called once a parameter has every shard it needs, with the [(checkpoint name, shard
    id)] that filled it (weight-only quantization packs it then). A tensor may come as a `gguf_blocks.Deferred`
    (a GGUF's exact blocks): with `on_loaded`, its floats reach the parameter only when `materialize()` is called
    (the quantizer does, unless it packs the parameter from those blocks), or after `on_loaded` if the parameter
    is still float; without it, at once.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = model.packed_modules
    expected: dict[str, set] = {}
    for pname, param in params.items():
        shards = {s for part, (target, s) in packed.items() if f".{target}." in f".{pname}"}
        expected[pname] = getattr(param, "shard_ids", None) or shards or {None}
    if model.cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    seen: dict[str, set] = {}
    sources: dict[str, list] = {}
    deferred: dict[str, list] = {}  # parameter → [(its loader, shard id, Deferred)] not yet copied in
    relayout = type(model).checkpoint_tensors is not CausalLM.checkpoint_tensors

    def materialize(pname: str) -> None:
        for loader, shard, later in deferred.pop(pname, ()):
            param = params[pname]
            loader(param, later.tensor().to(param.dtype), shard)

    for raw_name, raw_tensor in tensors:
        if isinstance(raw_tensor, gguf_blocks.Deferred) and (on_loaded is None or relayout):
            raw_tensor = raw_tensor.tensor()
        for name, tensor in model.checkpoint_tensors(raw_name, raw_tensor):
            if any(name.endswith(k) for k in model.ignored_keys):
                continue
            for old, new in model.renames.items():
                name = name.replace(old, new)
            if model.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            pname, shard = name, None
            expert = model.expert_shard(name)
            if expert is not None:
                pname, shard = expert
            else:
                for part, (target, s) in packed.items():
                    if f".{part}." in f".{name}":
                        pname, shard = name.replace(part, target), s
                        break
            param = params.get(pname)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
            try:
                loader = getattr(param, "weight_loader", _copy_loader)
                if isinstance(tensor, gguf_blocks.Deferred):
                    deferred.setdefault(pname, []).append((loader, shard, tensor))
                else:
                    loader(param, tensor.to(param.dtype), shard)
                seen.setdefault(pname, set()).add(shard)
                sources.setdefault(pname, []).append((name, shard))
                if on_loaded is not None and seen[pname] >= expected.get(pname, {None}):
                    on_loaded(pname, param, sources.pop(pname), functools.partial(materialize, pname))
                    if deferred.get(pname) and scheme(param) is None:  # still float: it takes its floats
                        materialize(pname)
                    deferred.pop(pname, None)
            except ModelLoadError as e:
                raise ModelLoadError(f"{name}: {e}") from None
    missing = [f"{p}" + (f"[{s}]" if s is not None else "") for p, shards in expected.items()
               for s in shards if s not in seen.get(p, set())]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
