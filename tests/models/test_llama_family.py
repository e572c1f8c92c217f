"""Llama (its optional biases too), Mistral and Qwen2 against transformers on tiny random checkpoints (fp32 greedy,
chunked prompts)."""
import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from tests.reference import TINY, assert_matches_transformers, tiny_checkpoint

VOCAB = 49152


def test_llama(tmp_path, tokenizer_dir):
    cfg = LlamaConfig(vocab_size=VOCAB, **TINY)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir))


def test_llama3_rope_scaling_sharded(tmp_path, tokenizer_dir):
    cfg = LlamaConfig(vocab_size=VOCAB, **{**TINY, "max_position_embeddings": 2048}, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                      tie_word_embeddings=True)
    path = tiny_checkpoint(cfg, tmp_path, tokenizer_dir, sharded=True)
    assert (path / "model.safetensors.index.json").exists()
    assert_matches_transformers(path, prompts=None)


def test_mistral_sliding_window(tmp_path, tokenizer_dir):
    cfg = MistralConfig(vocab_size=VOCAB, sliding_window=16, **TINY)
    # prompts longer than the window, chunked, so the window matters in both prefill and decode
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir))


def test_qwen2_qkv_bias(tmp_path, tokenizer_dir):
    import torch

    def nonzero_bias(model):
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)

    cfg = Qwen2Config(vocab_size=VOCAB, **TINY)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=nonzero_bias))


def test_llama_attention_and_mlp_biases(tmp_path, tokenizer_dir):
    """`attention_bias` puts a bias on q, k, v and o_proj; `mlp_bias` on gate, up and down: all loaded and applied
    (o_proj's and down's after the rank's matmul, as a row-parallel linear adds them)."""
    import torch

    def nonzero_biases(model):
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.3)

    cfg = LlamaConfig(vocab_size=VOCAB, attention_bias=True, mlp_bias=True, **TINY)
    path = tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=nonzero_biases)
    assert_matches_transformers(path)
