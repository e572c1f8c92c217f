"""Phi-3 against transformers: fused qkv_proj / gate_up_proj tensors, default rope with partial rotary, and
LongRoPE scaling.

LongRoPE: transformers rotates a whole sequence with the long factors once it is longer than
original_max_position_embeddings (dropping its cache to recompute); a paged KV cache cannot, so mii uses the long
factors per position from there on (see mii/layers/rotary.py). The greedy test keeps every sequence below that
length (short factors, and the attention factor from max_position / original, apply); the long-factor table is
checked against transformers' own LongRoPE frequencies directly.
"""
import math

import torch
from transformers import Phi3Config

from mii.layers.rotary import RotaryEmbedding
from tests.reference import TINY, assert_matches_transformers, prompts_for, tiny_checkpoint

VOCAB = 49152


def test_phi3_partial_rotary_sliding_window(tmp_path, tokenizer_dir):
    cfg = Phi3Config(vocab_size=VOCAB, partial_rotary_factor=0.75, sliding_window=24, pad_token_id=0, **TINY)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, sharded=True))


def _longrope_config():
    g = torch.Generator().manual_seed(3)
    half = 16 // 2  # head_dim 16
    return Phi3Config(vocab_size=VOCAB, **{**TINY, "max_position_embeddings": 512}, pad_token_id=0,
                      original_max_position_embeddings=64,
                      rope_scaling={"rope_type": "longrope",
                                    "short_factor": (1 + 3 * torch.rand(half, generator=g)).tolist(),
                                    "long_factor": (4 + 8 * torch.rand(half, generator=g)).tolist()})


def test_phi3_longrope_short(tmp_path, tokenizer_dir):
    cfg = _longrope_config()
    prompts = prompts_for(VOCAB, lengths=(5, 17, 31))  # + 32 new tokens: every sequence stays below 64
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir), prompts=prompts)


def test_phi3_longrope_long_factors_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _longrope_config()
    long_inv, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=65)
    short_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=None)
    assert math.isclose(factor, math.sqrt(1 + math.log(512 / 64) / math.log(64)))
    from mii.models import resolve

    spec, arch = resolve(cfg.to_dict())
    rot = RotaryEmbedding(16, 16, 512, arch.rope_theta, arch.rope_scaling)
    t = torch.arange(512, dtype=torch.float32)
    expected = torch.where((t < 64)[:, None], torch.outer(t, short_inv), torch.outer(t, long_inv))
    torch.testing.assert_close(rot.cos, expected.cos() * factor)
    torch.testing.assert_close(rot.sin, expected.sin() * factor)
