"""Phi-2 (`PhiForCausalLM`) against transformers: partial rotary, parallel attention + MLP, biases everywhere
(LM head included), LayerNorm, gelu_new; and its optional per-head q/k LayerNorm."""
import pytest
import torch
from transformers import PhiConfig

from tests.reference import TINY, assert_matches_transformers, tiny_checkpoint

VOCAB = 49152


def randomize(model):  # biases and LayerNorms start at 0 / (1, 0): make them matter
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.3)
        elif "layernorm" in name:
            torch.nn.init.normal_(p, mean=1.0, std=0.3)


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_phi2(tmp_path, tokenizer_dir, qk_layernorm):
    tiny = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    cfg = PhiConfig(vocab_size=VOCAB, partial_rotary_factor=0.5, qk_layernorm=qk_layernorm, **tiny)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=randomize))
