"""Gemma and Gemma-3 (text) against transformers: embeddings scaled by sqrt(hidden), RMSNorm with (1 + w),
tanh-GELU, a head_dim of its own; Gemma-3 adds q/k norm, sandwich norms, query_pre_attn_scalar, sliding and
global layers with different rotary bases, and final logit soft-capping."""
import torch
from transformers import Gemma3TextConfig, GemmaConfig

from tests.reference import TINY, assert_matches_transformers, tiny_checkpoint

VOCAB = 49152


def random_norms(model):  # Gemma's norms store w with scale (1 + w), initialized to 0
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, std=0.3)


def test_gemma(tmp_path, tokenizer_dir):
    cfg = GemmaConfig(vocab_size=VOCAB, head_dim=32, **TINY)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=random_norms))


def test_gemma3_text(tmp_path, tokenizer_dir):
    cfg = Gemma3TextConfig(vocab_size=VOCAB, head_dim=32, **{**TINY, "num_hidden_layers": 3}, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           query_pre_attn_scalar=24, final_logit_softcapping=5.0,
                           rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=random_norms))
