"""Falcon, both layouts, on the shared decoder with LayerNorm and a plain GELU MLP:

- 7B (`multi_query`, `parallel_attn`): one key/value head, attention and MLP in parallel off one LayerNorm;
- 40B/180B (`new_decoder_architecture`): grouped key/value heads, separate `ln_attn` / `ln_mlp` norms.

The fused `query_key_value` tensor is laid out per key/value group in the new architecture ([q x r, k, v] per
group) and per head in the old non-multi-query one ([q, k, v] per head); `checkpoint_tensors` reorders both to
[q; k; v] so the fused qkv layer loads (and shards) it like any other. ALiBi checkpoints are refused.
"""
import torch

from mii.errors import UnsupportedModelError
from mii.models.config import llama_like
from mii.models.decoder import CausalLM
from mii.models.registry import register


def falcon_config(hf: dict):
    if hf.get("alibi"):
        raise UnsupportedModelError("Falcon checkpoints with ALiBi positions (alibi=true, e.g. falcon-rw) are not "
                                    "supported: only rotary Falcon models are")
    heads = hf.get("num_attention_heads") or hf["n_head"]
    new_arch = bool(hf.get("new_decoder_architecture", False))
    if new_arch:
        kv = hf.get("num_kv_heads") or hf.get("n_head_kv") or heads
    elif hf.get("multi_query", True):
        kv = 1
    else:
        kv = hf.get("num_kv_heads") or heads
    parallel = new_arch or hf.get("parallel_attn", True)
    hidden = hf.get("hidden_size") or hf["n_embed"]
    return llama_like(
        hf, num_kv_heads=kv, head_dim=hidden // heads, hidden_size=hidden,
        intermediate_size=hf.get("ffn_hidden_size") or 4 * hidden, hidden_act=hf.get("activation", "gelu"),
        norm="layer", norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp="plain",
        attention_bias=bool(hf.get("bias", False)), mlp_bias=bool(hf.get("bias", False)),
        block="parallel" if parallel else "pre_norm",
        parallel_norms=(hf.get("num_ln_in_parallel_attn") or 2) if new_arch else 1,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        extra={"o_proj_bias": bool(hf.get("bias", False)), "qkv_layout": "grouped" if new_arch else
               "concatenated" if kv == 1 else "per_head"})


@register(["FalconForCausalLM", "RWForCausalLM"], ["falcon", "RefinedWeb", "RefinedWebModel"], falcon_config)
class FalconForCausalLM(CausalLM):
    renames = {
        "transformer.word_embeddings": "model.embed_tokens",
        "transformer.h.": "model.layers.",
        "transformer.ln_f": "model.norm",
        "self_attention.query_key_value": "self_attn.qkv_proj",
        "self_attention.dense": "self_attn.o_proj",
        "mlp.dense_h_to_4h": "mlp.fc1",
        "mlp.dense_4h_to_h": "mlp.fc2",
        "ln_attn": "input_layernorm",
        "ln_mlp": "post_attention_layernorm",
    }
    packed_modules = {"qkv_proj": ("qkv_proj", "qkv")}

    def checkpoint_tensors(self, name, tensor):
        layout = self.cfg.get("qkv_layout")
        if "query_key_value" in name and layout != "concatenated":
            h, kv, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
            rest = tensor.shape[1:]
            if layout == "grouped":  # [kv, h / kv + 2, d, ...]: each group's queries, then its key and value
                g = tensor.view(kv, h // kv + 2, d, *rest)
                q, k, v = g[:, :-2], g[:, -2], g[:, -1]
            else:  # [h, 3, d, ...]
                g = tensor.view(h, 3, d, *rest)
                q, k, v = g[:, 0], g[:, 1], g[:, 2]
            tensor = torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])
        yield name, tensor
