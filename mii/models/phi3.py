"""Phi-3 (and Phi-3.5 / Phi-4-mini): the Llama decoder with fused `qkv_proj` and `gate_up_proj` tensors in the
checkpoint, optional partial rotary, and LongRoPE ("longrope", formerly "su") scaling: short factors within
`original_max_position_embeddings`, long ones beyond it (see `mii.layers.rotary`)."""
from mii.models.config import llama_like, partial_rotary_factor
from mii.models.decoder import CausalLM
from mii.models.registry import register


def phi3_config(hf: dict):
    cfg = llama_like(hf)
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):  # transformers' legacy aliases
            scaling["rope_type"] = "longrope"
        scaling.setdefault("original_max_position_embeddings",
                           hf.get("original_max_position_embeddings") or cfg.max_position)
    return llama_like(hf, rope_scaling=scaling, rotary_dim=int(cfg.head_dim * partial_rotary_factor(hf)))


@register(["Phi3ForCausalLM"], ["phi3"], phi3_config)
class Phi3ForCausalLM(CausalLM):
    packed_modules = {"qkv_proj": ("qkv_proj", "qkv"), "gate_up_proj": ("gate_up_proj", "all")}
