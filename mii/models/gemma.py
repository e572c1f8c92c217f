"""Gemma and Gemma-3 (text): the Llama decoder with embeddings scaled by sqrt(hidden_size), RMSNorm scaling by
(1 + weight), a tanh-GELU gated MLP and a head_dim of its own (256 in the real models).

Gemma-3 adds: q/k RMSNorm per head, "sandwich" norms (after attention, before and after the MLP), a softmax
scale of query_pre_attn_scalar ** -0.5, and sliding-window layers (5 of every 6) with their own rotary base.
"""
from mii.errors import UnsupportedModelError
from mii.models.config import llama_like
from mii.models.decoder import CausalLM
from mii.models.registry import register


def _act(hf: dict) -> str:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act  # transformers: legacy "gelu" meant the tanh form


def gemma_config(hf: dict):
    return llama_like(hf, hidden_act=_act(hf), norm_offset=1.0, embed_scale=hf["hidden_size"] ** 0.5,
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))


def gemma3_config(hf: dict):
    if hf.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("Gemma-3 with attn_logit_softcapping is not supported")
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if not types:  # older config.json: every sliding_window_pattern-th layer is global
        pattern = hf.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    window = hf.get("sliding_window")
    windows = tuple(window if t == "sliding_attention" else None for t in types) if window else ()
    params = hf.get("rope_parameters")
    local = params["sliding_attention"].get("rope_theta") if isinstance(params, dict) and \
        "sliding_attention" in params else hf.get("rope_local_base_freq", 10000.0)
    extra = {"attn_scale": hf.get("query_pre_attn_scalar", 256) ** -0.5, "local_rope_theta": float(local)}
    if hf.get("final_logit_softcapping") is not None:
        extra["final_logit_softcap"] = float(hf["final_logit_softcapping"])
    return llama_like(hf, hidden_act=_act(hf), norm_offset=1.0, embed_scale=hf["hidden_size"] ** 0.5,
                      qk_norm="rms", block="sandwich", layer_windows=windows, extra=extra,
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))


@register(["GemmaForCausalLM"], ["gemma"], gemma_config)
class GemmaForCausalLM(CausalLM):
    pass


@register(["Gemma3ForCausalLM"], ["gemma3_text"], gemma3_config)
class Gemma3ForCausalLM(CausalLM):
    pass
