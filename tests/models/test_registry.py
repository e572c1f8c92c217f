"""The registry: every family registered, picked by `architectures` then `model_type`; anything else is a clear
error that lists what is supported."""
import pytest

from mii.errors import UnsupportedModelError
from mii.models import resolve, supported_model_types

FAMILIES = ["falcon", "gemma", "gemma3_text", "llama", "mistral", "mixtral", "opt", "phi", "phi3", "qwen", "qwen2",
            "qwen2_moe", "qwen3"]


def test_every_family_is_registered():
    assert set(FAMILIES) <= set(supported_model_types())


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        resolve({"architectures": ["BloomForCausalLM"], "model_type": "bloom", "vocab_size": 10})
    for t in FAMILIES:
        assert t in str(e.value)
    assert "bloom" in str(e.value)
