"""One registry from Hugging Face `architectures` / `model_type` to a model class and its config normalizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mii.errors import MIIError, ModelLoadError, UnsupportedModelError
from mii.models.config import ArchConfig, check, check_hf


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

    check_hf(hf)
    model_type = hf.get("model_type")
    name = next((a for a in hf.get("architectures") or [] if a in _BY_ARCH), None)
    spec = _BY_ARCH[name] if name else _BY_TYPE.get(model_type)
    if spec is None:
        raise UnsupportedModelError(
            f"unsupported model: architectures={hf.get('architectures')}, model_type={model_type!r}; "
            f"supported model_types: {', '.join(supported_model_types())}")
    try:
        cfg = spec.normalize(hf)
    except MIIError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        raise ModelLoadError(f"config.json cannot be read as {name or model_type}: {type(e).__name__}: {e}") from None
    return spec, check(cfg)
