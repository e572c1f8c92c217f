"""Qwen (v1, `QWenLMHeadModel`), loaded without its remote code: a Llama decoder (multi-head attention, q/k/v
biases) under other names and config keys.

Checkpoint: `transformer.wte`, `transformer.h.N.{ln_1, attn.c_attn (fused [q; k; v] with bias), attn.c_proj,
ln_2, mlp.w1 (up), mlp.w2 (gate), mlp.c_proj}`, `transformer.ln_f`. Config: `kv_channels` (head dim),
`intermediate_size` is twice the MLP width, `layer_norm_epsilon`, `rotary_emb_base`, `rotary_pct`, `no_bias`,
`seq_length`. Dynamic NTK and log-n attention only act beyond `seq_length`, so the context is capped there.
"""
from mii.models.config import llama_like
from mii.models.decoder import CausalLM
from mii.models.registry import register


def qwen_config(hf: dict):
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("kv_channels") or hidden // heads
    bias = not hf.get("no_bias", True)
    return llama_like(
        hf, num_kv_heads=heads, head_dim=head_dim, intermediate_size=hf["intermediate_size"] // 2,
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), rope_theta=float(hf.get("rotary_emb_base", 10000.0)),
        rope_scaling=None, rotary_dim=int(head_dim * hf.get("rotary_pct", 1.0)),
        max_position=hf.get("seq_length") or hf.get("max_position_embeddings") or 8192,
        attention_bias=True, mlp_bias=bias, extra={"o_proj_bias": bias})


@register(["QWenLMHeadModel"], ["qwen"], qwen_config)
class QWenLMHeadModel(CausalLM):
    renames = {
        "transformer.wte": "model.embed_tokens",
        "transformer.h.": "model.layers.",
        "transformer.ln_f": "model.norm",
        ".ln_1.": ".input_layernorm.",
        ".ln_2.": ".post_attention_layernorm.",
        "attn.c_attn": "self_attn.qkv_proj",
        "attn.c_proj": "self_attn.o_proj",
        "mlp.w1": "mlp.up_proj",
        "mlp.w2": "mlp.gate_proj",
        "mlp.c_proj": "mlp.down_proj",
    }
    packed_modules = {"qkv_proj": ("qkv_proj", "qkv"), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
