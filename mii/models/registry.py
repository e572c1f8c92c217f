"""One registry from Hugging Face `architectures` / `model_type` to a model class and its config normalizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mii.errors import UnsupportedModelError
from mii.models.config import ArchConfig


@dataclass(frozen=True)
class ModelSpec:
    model_class: type
    normalize: Callable[[dict], ArchConfig]


_BY_ARCH: dict[str, ModelSpec] = {}
_BY_TYPE: dict[str, ModelSpec] = {}


def register(architectures: list[str], model_types: list[str], normalize: Callable[[dict], ArchConfig]):
    """Class decorator: `@register(["LlamaForCausalLM"], ["llama"], llama_like)`."""

    def wrap(cls):
        spec = ModelSpec(cls, normalize)
        for a in architectures:
            _BY_ARCH[a] = spec
        for t in model_types:
            _BY_TYPE[t] = spec
        return cls

    return wrap


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def resolve(hf: dict) -> tuple[ModelSpec, ArchConfig]:
    import mii.models  # noqa: F401  (registers every family)

    for arch in hf.get("architectures") or []:
        if arch in _BY_ARCH:
            spec = _BY_ARCH[arch]
            return spec, spec.normalize(hf)
    model_type = hf.get("model_type")
    if model_type in _BY_TYPE:
        spec = _BY_TYPE[model_type]
        return spec, spec.normalize(hf)
    raise UnsupportedModelError(
        f"unsupported model: architectures={hf.get('architectures')}, model_type={model_type!r}; "
        f"supported model_types: {', '.join(supported_model_types())}")
