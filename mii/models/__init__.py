"""Model families: one thin file each on the shared layers, registered by HF `architectures` / `model_type`.

Importing this package registers every family; `registry.resolve(config_json)` picks one.
"""
from mii.models import llama, mistral, mixtral, qwen2, qwen2_moe, qwen3  # noqa: F401
from mii.models.registry import resolve, supported_model_types

__all__ = ["resolve", "supported_model_types"]
