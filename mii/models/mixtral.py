"""Mixtral: the Llama decoder with a sparse MoE MLP (top-2 of 8 experts, weights renormalized over the two).

Checkpoint: `block_sparse_moe.gate` is the router, `block_sparse_moe.experts.N.{w1,w3,w2}` are each expert's
gate, up and down projections, stacked into the MoE layer's `w13` / `w2`.
"""
from mii.models.config import MoEConfig, llama_like
from mii.models.decoder import DOWN, GATE, UP, CausalLM
from mii.models.registry import register


def mixtral_config(hf: dict):
    moe = MoEConfig(num_experts=hf["num_local_experts"], top_k=hf.get("num_experts_per_tok", 2),
                    intermediate_size=hf["intermediate_size"], renormalize=True)
    return llama_like(hf, moe=moe)


@register(["MixtralForCausalLM"], ["mixtral"], mixtral_config)
class MixtralForCausalLM(CausalLM):
    renames = {"block_sparse_moe.": "mlp."}
    expert_parts = {"w1": GATE, "w3": UP, "w2": DOWN}
