"""OPT against transformers: learned positions (offset 2), ReLU, biases; the pre-LN layout (125m and up) and
OPT-350m's post-LN layout with 32-wide embeddings through project_in / project_out (MII refuses that one)."""
import torch
from transformers import OPTConfig

from tests.reference import assert_matches_transformers, tiny_checkpoint

VOCAB = 49152
BASE = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=1024, init_std=0.08)


def randomize(model):
    for name, p in model.named_parameters():
        if "layer_norm" in name:
            torch.nn.init.normal_(p, mean=1.0 if name.endswith("weight") else 0.0, std=0.3)
        elif name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.3)


def test_opt_pre_norm(tmp_path, tokenizer_dir):
    cfg = OPTConfig(**BASE, do_layer_norm_before=True)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=randomize))


def test_opt_350m_post_norm_project_in_out(tmp_path, tokenizer_dir):
    cfg = OPTConfig(**BASE, do_layer_norm_before=False, word_embed_proj_dim=32)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, sharded=True, post_init=randomize))
