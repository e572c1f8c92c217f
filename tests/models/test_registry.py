"""The registry: every family registered, picked by `architectures` then `model_type`; anything else is a clear
error that lists what is supported."""
import pytest

from mii.errors import ModelLoadError, UnsupportedModelError
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


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e4}}


@pytest.mark.parametrize("key, value, words", [
    ("hidden_size", "64", r"hidden_size must be a positive integer \(it is '64'\)"),
    ("hidden_size", -1, "hidden_size must be a positive integer"),
    ("num_hidden_layers", 1.5, "num_hidden_layers must be a positive integer"),
    ("num_attention_heads", True, "num_attention_heads must be a positive integer"),
    ("intermediate_size", 0, "intermediate_size must be a positive integer"),
    ("max_position_embeddings", float("inf"), "max_position_embeddings must be a positive integer"),
    ("vocab_size", [], "vocab_size must be a positive integer"),
    ("head_dim", 0, "head_dim must be a positive integer"),
    ("num_key_value_heads", 3, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ("num_attention_heads", 128, r"head_dim must be a positive integer \(it is 0\)"),  # 64 // 128
    ("rms_norm_eps", -1, "rms_norm_eps must be a finite number ≥ 0"),
    ("rms_norm_eps", "nan", "rms_norm_eps must be a finite number"),
    ("rope_parameters", 3, "rope_parameters must be an object"),
    ("rope_parameters", {"rope_theta": float("nan")}, "rope_theta must be a finite number > 0"),
    ("rope_theta", 0, "rope_theta must be a finite number > 0"),
    ("sliding_window", -1, "sliding_window must be an integer ≥ 0"),
    ("sliding_window", "64", "sliding_window must be an integer ≥ 0"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("attention_bias", 1, "attention_bias must be true or false"),
    ("architectures", 3, "architectures must be a list of class names"),
    ("hidden_act", [], "hidden_act must be a string"),
    ("eos_token_id", {}, "eos_token_id must be an integer or a list of integers"),
    ("eos_token_id", [2, "3"], "eos_token_id must be an integer or a list of integers"),
    ("bos_token_id", 1.5, "bos_token_id must be an integer"),
])
def test_a_config_that_describes_no_model_is_refused_by_name(key, value, words):
    with pytest.raises(ModelLoadError, match=words):
        resolve({**LLAMA, key: value})


@pytest.mark.parametrize("key, value", [("sliding_window", 0), ("sliding_window", None), ("head_dim", None),
                                        ("num_key_value_heads", None), ("eos_token_id", [2, 3]),
                                        ("rope_parameters", None), ("tie_word_embeddings", None)])
def test_the_values_real_configs_use_are_accepted(key, value):
    spec, cfg = resolve({**LLAMA, key: value})
    assert (cfg.num_heads, cfg.head_dim, cfg.layer_windows) == (4, 16, ())


def test_what_a_family_cannot_read_is_a_load_error():
    """A value that passes the generic checks but breaks a family's own normalizer names the family."""
    with pytest.raises(ModelLoadError, match=r"config.json cannot be read as MixtralForCausalLM: KeyError"):
        resolve({**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})  # no num_local_experts
