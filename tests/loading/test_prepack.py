"""bf16 on CPU: linears re-laid out for oneDNN give the same logits as plain F.linear."""
import pytest
import torch
from transformers import LlamaConfig

from mii.layers import linear
from mii.loading import load_model, resolve_source
from tests.reference import TINY, tiny_checkpoint


def test_prepacked_bf16_matches_plain(tmp_path, tokenizer_dir):
    path = tiny_checkpoint(LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **TINY), tmp_path, tokenizer_dir)
    src = resolve_source(str(path))
    plain = load_model(src, torch.bfloat16, torch.device("cpu"), prepack=False).model
    packed = load_model(src, torch.bfloat16, torch.device("cpu")).model
    if not linear.bf16_packable():
        assert packed.model.layers[0].self_attn.qkv_proj.packed is None  # loading still works, unpacked
        pytest.skip("oneDNN cannot prepack bf16 weights on this CPU (needs AVX512 or AVX-NE-CONVERT)")
    lin = packed.model.layers[0].self_attn.qkv_proj
    assert lin.packed is not None and lin.weight.numel() == 0  # the dense copy is freed
    assert packed.lm_head.packed is not None and packed.model.embed_tokens.weight.numel() > 0  # tied: kept
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    for name in ("qkv_proj", "o_proj"):
        a = getattr(plain.model.layers[1].self_attn, name)
        b = getattr(packed.model.layers[1].self_attn, name)
        inp = x if name == "qkv_proj" else torch.randn(5, a.weight.shape[1], dtype=torch.bfloat16)
        assert torch.equal(a(inp), b(inp))
    h = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(plain.compute_logits(h), packed.compute_logits(h))
