"""Qwen3 against transformers: per-head q/k RMSNorm and a head_dim that is not hidden_size / heads."""
import torch
from transformers import Qwen3Config

from tests.reference import TINY, assert_matches_transformers, tiny_checkpoint

VOCAB = 49152


def test_qwen3_qk_norm(tmp_path, tokenizer_dir):
    def random_norms(model):  # q/k norms start at 1: make them matter
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.normal_(norm.weight, mean=1.0, std=0.5)

    cfg = Qwen3Config(vocab_size=VOCAB, head_dim=24, **TINY)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=random_norms))
