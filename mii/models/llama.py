"""Llama 1/2/3 (and the decoder that Mistral, Qwen2 and other Llama-shaped families reuse).

Pre-norm decoder: RMSNorm → attention (fused qkv, rotary, paged attention) → RMSNorm → gated MLP (fused gate/up).
"""
from __future__ import annotations

import torch
from torch import nn

from mii.layers.activation import gated, get_activation
from mii.layers.attention import AttentionContext, PagedAttention
from mii.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mii.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mii.layers.norm import RMSNorm
from mii.layers.rotary import RotaryEmbedding
from mii.models.config import ArchConfig, llama_like
from mii.models.registry import register


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, bias=cfg.attention_bias)
        self.n_heads, self.n_kv_heads = self.qkv_proj.n_heads, self.qkv_proj.n_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.get("o_proj_bias", False))
        self.rotary = rotary
        self.attn = PagedAttention(self.n_heads, self.n_kv_heads, d, cfg.get("attn_scale", d ** -0.5), cfg.window(layer))
        self.splits = [self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q = q.view(T, self.n_heads, -1)     # [T, h, d]
        k = k.view(T, self.n_kv_heads, -1)  # [T, kvh, d]
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(T, self.n_kv_heads, -1), ctx))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x):
        return self.down_proj(gated(self.act, self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions, x, residual, ctx):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        rot_dim = cfg.rotary_dim or cfg.head_dim
        rotary = RotaryEmbedding(cfg.head_dim, rot_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids, positions, ctx):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        return self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """A decoder plus LM head. Subclasses set `model_class` and, where the checkpoint names differ,
    `packed_modules` (checkpoint name part → (parameter name part, shard id)) and `renames`."""

    model_class = LlamaModel
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    renames: dict = {}
    ignored_keys = ("rotary_emb.inv_freq",)

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.cfg = cfg
        self.model = self.model_class(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions: [T] → hidden states [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]


@register(["LlamaForCausalLM"], ["llama"], llama_like)
class LlamaForCausalLM(CausalLM):
    pass
