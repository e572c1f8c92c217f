"""Model families: one thin file each on the shared layers, registered by HF `architectures` / `model_type`.

Importing this package registers every family; `registry.resolve(config_json)` picks one.
"""
from mii.models import (  # noqa: F401
    falcon, gemma, llama, mistral, mixtral, opt, phi, phi3, qwen, qwen2, qwen2_moe, qwen3)
from mii.models.registry import resolve, supported_model_types

__all__ = ["resolve", "supported_model_types"]
