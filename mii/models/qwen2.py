"""Qwen2: the Llama decoder with biases on q/k/v (not on o_proj) and optional per-layer sliding windows."""
from mii.models.config import llama_like
from mii.models.decoder import CausalLM
from mii.models.registry import register


def qwen2_config(hf: dict):
    return llama_like(hf, attention_bias=True)


@register(["Qwen2ForCausalLM"], ["qwen2"], qwen2_config)
class Qwen2ForCausalLM(CausalLM):
    pass
