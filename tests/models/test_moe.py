"""Mixtral and Qwen2-MoE against transformers on tiny random checkpoints (fp32 greedy, chunked prompts).

Both route each token to top-k experts; the test models have enough experts (8) that tokens of one batch spread
over all of them, so the grouped expert computation is exercised with uneven groups."""
from transformers import MixtralConfig, Qwen2MoeConfig

from tests.reference import TINY, assert_matches_transformers, tiny_checkpoint

VOCAB = 49152


def test_mixtral_sharded(tmp_path, tokenizer_dir):
    cfg = MixtralConfig(vocab_size=VOCAB, num_local_experts=8, num_experts_per_tok=2, **TINY)
    path = tiny_checkpoint(cfg, tmp_path, tokenizer_dir, sharded=True)
    assert (path / "model.safetensors.index.json").exists()
    assert_matches_transformers(path)


def test_qwen2_moe_shared_expert(tmp_path, tokenizer_dir):
    import torch

    def nonzero_bias(model):
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
            if hasattr(layer.mlp, "shared_expert_gate"):
                torch.nn.init.normal_(layer.mlp.shared_expert_gate.weight, std=0.5)

    # 3 layers: layer 1 is dense (mlp_only_layers), the others are sparse with a shared expert
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                         shared_expert_intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False,
                         **{**TINY, "num_hidden_layers": 3})
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=nonzero_bias))
