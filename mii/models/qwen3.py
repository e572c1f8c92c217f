"""Qwen3: the Llama decoder with an RMSNorm over each head's q and k (before rotary) and an explicit head_dim."""
from mii.models.config import llama_like
from mii.models.decoder import CausalLM
from mii.models.registry import register


def qwen3_config(hf: dict):
    return llama_like(hf, qk_norm="rms")


@register(["Qwen3ForCausalLM"], ["qwen3"], qwen3_config)
class Qwen3ForCausalLM(CausalLM):
    pass
