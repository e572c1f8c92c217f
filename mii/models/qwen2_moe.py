"""Qwen2-MoE: Qwen2 attention (q/k/v biases) with a sparse MoE MLP plus an always-on shared expert whose output
is scaled by sigmoid(shared_expert_gate(x)). Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`
stride, use a dense MLP."""
from mii.models.config import MoEConfig, llama_like
from mii.models.decoder import DOWN, GATE, UP, CausalLM
from mii.models.registry import register


def qwen2_moe_config(hf: dict):
    layers = hf["num_hidden_layers"]
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and hf["num_experts"] > 0 and (i + 1) % step == 0)
    moe = MoEConfig(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                    intermediate_size=hf["moe_intermediate_size"], renormalize=bool(hf.get("norm_topk_prob", False)),
                    shared_intermediate_size=hf.get("shared_expert_intermediate_size") or 0, sparse_layers=sparse)
    return llama_like(hf, attention_bias=hf.get("qkv_bias", True), moe=moe)


@register(["Qwen2MoeForCausalLM"], ["qwen2_moe"], qwen2_moe_config)
class Qwen2MoeForCausalLM(CausalLM):
    expert_parts = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
