"""Phi-2 (`PhiForCausalLM`): parallel attention and MLP off one LayerNorm, partial rotary (the first
partial_rotary_factor of each head), biases everywhere including the LM head, gelu_new MLP."""
from mii.models.config import llama_like, partial_rotary_factor
from mii.models.decoder import CausalLM
from mii.models.registry import register


def phi_config(hf: dict):
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    return llama_like(
        hf, norm="layer", norm_eps=hf.get("layer_norm_eps", 1e-5), block="parallel", mlp="plain",
        hidden_act=hf.get("hidden_act", "gelu_new"), attention_bias=True, mlp_bias=True, lm_head_bias=True,
        rotary_dim=int(head_dim * partial_rotary_factor(hf, 0.5)), head_dim=head_dim,
        qk_norm="layer" if hf.get("qk_layernorm") else None, extra={"o_proj_bias": True})


@register(["PhiForCausalLM"], ["phi"], phi_config)
class PhiForCausalLM(CausalLM):
    renames = {
        "self_attn.dense": "self_attn.o_proj",
        "self_attn.q_layernorm": "self_attn.q_norm",
        "self_attn.k_layernorm": "self_attn.k_norm",
        "model.final_layernorm": "model.norm",
    }
