"""Falcon against transformers: the 7B layout (multi-query, parallel attention + MLP, one LayerNorm), the
40B/180B `new_decoder_architecture` (grouped KV heads, ln_attn/ln_mlp), and the sequential per-head-qkv layout.
ALiBi variants are refused with a clear error."""
import pytest
import torch
from transformers import FalconConfig

from mii.errors import UnsupportedModelError
from mii.models import resolve
from tests.reference import TINY, assert_matches_transformers, tiny_checkpoint

VOCAB = 49152
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024,
            initializer_range=0.08, ffn_hidden_size=128)


def random_norms(model):  # LayerNorms start at (1, 0): make them matter
    for name, p in model.named_parameters():
        if "ln" in name or "layernorm" in name:
            torch.nn.init.normal_(p, mean=1.0 if name.endswith("weight") else 0.0, std=0.3)


def test_falcon_7b_multi_query(tmp_path, tokenizer_dir):
    cfg = FalconConfig(**BASE, multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, sharded=True, post_init=random_norms))


def test_falcon_new_decoder_architecture(tmp_path, tokenizer_dir):
    cfg = FalconConfig(**BASE, new_decoder_architecture=True, num_kv_heads=2, bias=False)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=random_norms))


def test_falcon_sequential_per_head_qkv_bias(tmp_path, tokenizer_dir):
    def post_init(model):
        random_norms(model)
        for name, p in model.named_parameters():
            if name.endswith("bias") and "ln" not in name and "layernorm" not in name:
                torch.nn.init.normal_(p, std=0.3)

    cfg = FalconConfig(**BASE, multi_query=False, parallel_attn=False, new_decoder_architecture=False, bias=True)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=post_init))


def test_falcon_alibi_refused():
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        resolve({"architectures": ["FalconForCausalLM"], "model_type": "falcon", "alibi": True, **BASE})
