"""Loading: resolve a model reference (folder, cached hub id, .gguf file), read its config, tokenizer and
weights, and put each checkpoint tensor into the parameter that owns it (layers shard their own slice); with
`quantization`, pack each linear as int8/int4 as it is loaded (`quantize`), from a GGUF's own blocks where they map
(`gguf_blocks`).
"""
from mii.loading.loader import LoadedModel, load_model
from mii.loading.source import ModelSource, resolve_source

__all__ = ["LoadedModel", "load_model", "ModelSource", "resolve_source"]
