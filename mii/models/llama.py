"""Llama 1/2/3: the shared decoder as it is (RMSNorm, fused qkv with rotary, gated SiLU MLP), rope scaling
included. Llama's checkpoint names are the decoder's own, so there is nothing to map."""
from mii.models.config import llama_like
from mii.models.decoder import CausalLM
from mii.models.registry import register


@register(["LlamaForCausalLM"], ["llama"], llama_like)
class LlamaForCausalLM(CausalLM):
    pass
