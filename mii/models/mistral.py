"""Mistral: the Llama decoder with a sliding attention window (`sliding_window` in config.json)."""
from mii.models.config import llama_like
from mii.models.decoder import CausalLM
from mii.models.registry import register


@register(["MistralForCausalLM"], ["mistral"], llama_like)
class MistralForCausalLM(CausalLM):
    pass
