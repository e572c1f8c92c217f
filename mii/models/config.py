"""`ArchConfig`: a Hugging Face `config.json` normalized once into a frozen dataclass.

Model code reads only these fields, never the raw HF config. Family-specific knobs that most models lack live
in `extra` (read with `cfg.get(name, default)`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

from mii.errors import ModelLoadError


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Mapping[str, Any]] = None
    rotary_dim: Optional[int] = None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_windows: tuple = ()
    """Sliding window of each layer (None: full attention); empty means no layer has one."""
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, name: str, default=None):
        return self.extra.get(name, default)

    def window(self, layer: int) -> Optional[int]:
        return self.layer_windows[layer] if self.layer_windows else None


def _require(hf: dict, *names):
    for n in names:
        if hf.get(n) is not None:
            return hf[n]
    raise ModelLoadError(f"config.json has none of {names}")


def _ids(value) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def rope_from_hf(hf: dict) -> tuple[float, Optional[dict]]:
    """(theta, scaling) from either transformers-5 `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type rope (Gemma-3)
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return float(theta), (dict(params) if kind != "default" else None)
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(hf.get("rope_theta", 10000.0)), (dict(scaling) if scaling else None)


def layer_windows_from_hf(hf: dict, num_layers: int) -> tuple:
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window and hf.get("use_sliding_window", True):
        return (window,) * num_layers
    return ()


def llama_like(hf: dict, **overrides) -> ArchConfig:
    """Normalize a Llama-style config; families pass overrides for what they name or default differently."""
    hidden = _require(hf, "hidden_size", "n_embd", "d_model")
    heads = _require(hf, "num_attention_heads", "n_head")
    layers = _require(hf, "num_hidden_layers", "n_layer")
    kv = hf.get("num_key_value_heads") or heads
    theta, scaling = rope_from_hf(hf)
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
    values = dict(
        architecture=arch,
        model_type=hf.get("model_type", ""),
        vocab_size=_require(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=hf.get("intermediate_size") or 4 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hf.get("head_dim") or hidden // heads,
        max_position=hf.get("max_position_embeddings") or 2048,
        norm_eps=hf.get("rms_norm_eps", hf.get("layer_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        hidden_act=hf.get("hidden_act", "silu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        layer_windows=layer_windows_from_hf(hf, layers),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_ids(hf.get("eos_token_id")),
    )
    values.update(overrides)
    if isinstance(values.get("extra"), dict):
        values["extra"] = MappingProxyType(values["extra"])
    return ArchConfig(**values)


def read_hf_config(path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
