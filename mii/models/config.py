"""`ArchConfig`: a Hugging Face `config.json` normalized once into a frozen dataclass.

Model code reads only these fields, never the raw HF config. Each family's normalizer (`llama_like` plus the
overrides a family passes) is the only code that reads HF keys. Family-specific knobs that most models lack live
in `extra` (read with `cfg.get(name, default)`):

- `o_proj_bias` (bool): bias on the attention output projection.
- `attn_scale` (float): softmax scale when it is not head_dim ** -0.5 (Gemma-3: query_pre_attn_scalar ** -0.5).
- `local_rope_theta` (float): rotary base of the sliding-window layers (Gemma-3), scaling-free.
- `final_logit_softcap` (float): logits = cap * tanh(logits / cap) (Gemma-3, when set).
- `position_offset` (int): index offset of learned position embeddings (OPT: 2).
- `qkv_layout` (str): Falcon's fused query_key_value layout ("concatenated", "grouped", "per_head").
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping, Optional

from mii.errors import ModelLoadError


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP: top-k routing over `num_experts` gated experts."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    """True: the selected experts' softmax weights are renormalized to sum to 1 (Mixtral); False: kept as the
    softmax over all experts (Qwen2-MoE unless `norm_topk_prob`)."""
    shared_intermediate_size: int = 0
    """Size of an always-on shared expert whose output is scaled by sigmoid(shared_expert_gate(x)); 0: none."""
    sparse_layers: Optional[tuple] = None
    """Indices of the layers that use the MoE MLP (None: all); the others use a dense `intermediate_size` MLP."""

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers is None or layer in self.sparse_layers


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
    norm: str = "rms"
    """"rms" (RMSNorm) or "layer" (LayerNorm with bias)."""
    norm_offset: float = 0.0
    """RMSNorm scales by (norm_offset + weight); Gemma stores weight - 1 and uses 1."""
    block: str = "pre_norm"
    """Decoder layer wiring: "pre_norm" (Llama: x + attn(norm(x)), then x + mlp(norm(x))); "parallel" (Falcon,
    Phi-2: x + attn(norm(x)) + mlp(norm'(x))); "post_norm" (OPT-350m: norm(x + attn(x)), then norm(x + mlp(x)));
    "sandwich" (Gemma-3: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))))."""
    parallel_norms: int = 1
    """"parallel" block: 1 norm shared by attention and MLP (Falcon-7B, Phi-2) or 2 (Falcon-40B's ln_attn/ln_mlp)."""
    mlp: str = "gated"
    """"gated" (down(act(gate(x)) * up(x))) or "plain" (fc2(act(fc1(x))))."""
    qk_norm: Optional[str] = None
    """Per-head norm of q and k before rotary: None, "rms" (Qwen3, Gemma-3) or "layer" (Phi-2's qk_layernorm)."""
    learned_positions: bool = False
    """Absolute position embeddings added to the token embeddings (OPT) instead of rotary."""
    embed_scale: Optional[float] = None
    """Token embeddings are multiplied by this (Gemma: sqrt(hidden_size))."""
    embed_dim: Optional[int] = None
    """Width of the token embeddings and LM head when it differs from hidden_size (OPT-350m's project_in/out)."""
    final_norm: bool = True
    """Whether the decoder ends with a norm (OPT-350m's post-norm layout has none)."""
    lm_head_bias: bool = False
    moe: Optional[MoEConfig] = None
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
        first = hf.get("max_window_layers") if "use_sliding_window" in hf else None  # Qwen2/3: the top layers only
        if first is not None:
            return tuple(window if i >= first else None for i in range(num_layers))
        return (window,) * num_layers
    return ()


def partial_rotary_factor(hf: dict, default: float = 1.0) -> float:
    """The fraction of each head that rotary rotates (transformers 5 keeps it in `rope_parameters`)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(hf.get("partial_rotary_factor", default))


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
    # transformers' `attention_bias` puts a bias on o_proj too (Llama, Qwen3, Gemma); a family whose biases differ
    # (Qwen2: q/k/v only, with no such key) says so in its own `extra`, which comes on top
    extra = {"o_proj_bias": bool(hf.get("attention_bias", False)), **dict(overrides.pop("extra", None) or {})}
    values.update(overrides)
    values["extra"] = MappingProxyType(extra)
    return ArchConfig(**values)


def read_hf_config(path) -> dict:
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(hf).__name__}, not an object")
    return hf


# --- validation: a config.json that describes no buildable model is refused by name, before anything is built ---

# keys that, where a config has them (not null), are sizes or counts: positive integers
_POSITIVE_KEYS = ("vocab_size", "hidden_size", "n_embd", "n_embed", "d_model", "intermediate_size", "ffn_dim",
                  "ffn_hidden_size", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
                  "num_key_value_heads", "num_kv_heads", "n_head_kv", "head_dim", "max_position_embeddings",
                  "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "word_embed_proj_dim")
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
# the Hugging Face key behind each size of `ArchConfig`, for messages
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings",
             "norm_eps": "rms_norm_eps"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def token_ids_ok(value) -> bool:
    """An integer or a list of integers (config.json's and generation_config.json's `eos_token_id`)."""
    return _is_int(value) or isinstance(value, list) and all(_is_int(i) for i in value)


def _bad(key: str, want: str, value) -> ModelLoadError:
    return ModelLoadError(f"config.json: {key} must be {want} (it is {value!r})")


def check_hf(hf: dict) -> None:
    """Refuse, naming the key, the values of a raw config.json that no model can be built from: sizes that are
    not positive integers, flags that are not booleans, norms' epsilons and rotary bases that are not finite
    numbers, and malformed `architectures`, `rope_parameters`, `rope_scaling`, token ids and `sliding_window`."""
    for key in _POSITIVE_KEYS:
        v = hf.get(key)
        if v is not None and not (_is_int(v) and v > 0):
            raise _bad(key, "a positive integer", v)
    for key in _BOOL_KEYS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise _bad(key, "true or false", hf[key])
    for key in _EPS_KEYS:
        if hf.get(key) is not None and not (_is_real(hf[key]) and hf[key] >= 0):
            raise _bad(key, "a finite number ≥ 0", hf[key])
    window = hf.get("sliding_window")
    if window is not None and window is not False and not (_is_int(window) and window >= 0):
        raise _bad("sliding_window", "an integer ≥ 0 (0: none) or null", window)
    archs = hf.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise _bad("architectures", "a list of class names", archs)
    for key in ("model_type", "hidden_act"):
        if hf.get(key) is not None and not isinstance(hf[key], str):
            raise _bad(key, "a string", hf[key])
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise _bad(key, "an object", hf[key])
    params = hf.get("rope_parameters") or {}
    for theta in (hf.get("rope_theta"), params.get("rope_theta")):
        if theta is not None and not (_is_real(theta) and theta > 0):
            raise _bad("rope_theta", "a finite number > 0", theta)
    if hf.get("bos_token_id") is not None and not _is_int(hf["bos_token_id"]):
        raise _bad("bos_token_id", "an integer", hf["bos_token_id"])
    eos = hf.get("eos_token_id")
    if eos is not None and not token_ids_ok(eos):
        raise _bad("eos_token_id", "an integer or a list of integers", eos)


def check(cfg: ArchConfig) -> ArchConfig:
    """The normalized config's own consistency (sizes derived by the families included): every size a positive
    integer, query heads a multiple of key/value heads, the rotary part within a head, windows positive."""
    for f in fields(ArchConfig):
        v = getattr(cfg, f.name)
        if f.type == "int" and not (_is_int(v) and v > 0):
            raise _bad(_HF_NAMES.get(f.name, f.name), "a positive integer", v)
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"config.json: num_attention_heads ({cfg.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({cfg.num_kv_heads})")
    if cfg.rotary_dim is not None and not (_is_int(cfg.rotary_dim) and 0 < cfg.rotary_dim <= cfg.head_dim):
        raise ModelLoadError(f"config.json: the rotary part of a head ({cfg.rotary_dim!r}) must be a positive "
                             f"integer of at most head_dim ({cfg.head_dim})")
    if not (_is_real(cfg.norm_eps) and cfg.norm_eps >= 0):
        raise _bad("the norm's epsilon", "a finite number ≥ 0", cfg.norm_eps)
    if not (_is_real(cfg.rope_theta) and cfg.rope_theta > 0):
        raise _bad("rope_theta", "a finite number > 0", cfg.rope_theta)
    if cfg.embed_dim is not None and not (_is_int(cfg.embed_dim) and cfg.embed_dim > 0):
        raise _bad("word_embed_proj_dim", "a positive integer", cfg.embed_dim)
    for w in cfg.layer_windows:
        if w is not None and not (_is_int(w) and w > 0):
            raise _bad("sliding_window", "a positive integer or null", w)
    moe = cfg.moe
    if moe is not None and not (_is_int(moe.num_experts) and _is_int(moe.top_k) and 0 < moe.top_k <= moe.num_experts
                                and _is_int(moe.intermediate_size) and moe.intermediate_size > 0):
        raise ModelLoadError(f"config.json: the experts ({moe.num_experts!r}, {moe.top_k!r} a token, intermediate size "
                             f"{moe.intermediate_size!r}) must be positive integers, at most num_experts a token")
    return cfg
