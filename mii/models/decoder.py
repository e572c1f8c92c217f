"""The decoder every family composes: attention, MLP (dense or MoE), decoder layer, model, `CausalLM`.

One set of classes, driven by `ArchConfig`: norm kind (RMS/Layer, Gemma's 1 + w), layer wiring (`block`: pre-norm,
parallel, post-norm, sandwich), q/k norm, partial rotary or learned positions, gated or plain MLP, MoE, embedding
scale. A family file sets checkpoint names (`renames`, `packed_modules`, `expert_parts`) and a normalizer; it
adds code only for what is truly its own (e.g. Falcon's interleaved qkv layout).

Layers pass (x, residual) so that pre-norm blocks fold the residual add into the next norm; residual None means
x is already the full hidden state.
"""
from __future__ import annotations

import re
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mii.layers.attention import AttentionContext, PagedAttention
from mii.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mii.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from mii.layers.mlp import MLP
from mii.layers.moe import DOWN, GATE, UP, SparseMoeBlock
from mii.layers.norm import RMSNorm, build_norm
from mii.layers.rotary import RotaryEmbedding
from mii.models.config import ArchConfig


def _norm(cfg: ArchConfig, dim: Optional[int] = None) -> nn.Module:
    return build_norm(cfg.norm, dim or cfg.hidden_size, cfg.norm_eps, cfg.norm_offset)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, rotary: Optional[RotaryEmbedding]):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, bias=cfg.attention_bias)
        self.n_heads, self.n_kv_heads = self.qkv_proj.n_heads, self.qkv_proj.n_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.get("o_proj_bias", False))
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # one norm over head_dim, shared by all heads (Qwen3, Gemma-3, Phi-2's qk_layernorm)
            self.q_norm = build_norm(cfg.qk_norm, d, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = build_norm(cfg.qk_norm, d, cfg.norm_eps, cfg.norm_offset)
        self.rotary = rotary
        self.attn = PagedAttention(self.n_heads, self.n_kv_heads, d, cfg.get("attn_scale", d ** -0.5), cfg.window(layer))
        self.splits = [self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q = q.view(T, self.n_heads, -1)     # [T, h, d]
        k = k.view(T, self.n_kv_heads, -1)  # [T, kvh, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(T, self.n_kv_heads, -1), ctx))


def build_mlp(cfg: ArchConfig, layer: int) -> nn.Module:
    moe = cfg.moe
    if moe is not None and moe.is_sparse(layer):
        return SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, cfg.hidden_act,
                              moe.renormalize, moe.shared_intermediate_size)
    return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, gated_mlp=cfg.mlp == "gated")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, rotary: Optional[RotaryEmbedding]):
        super().__init__()
        if cfg.block not in ("pre_norm", "parallel", "post_norm", "sandwich"):
            raise ValueError(f"unknown decoder block {cfg.block!r}")
        self.block = cfg.block
        self.input_layernorm = _norm(cfg)
        self.self_attn = Attention(cfg, layer, rotary)
        # parallel blocks with one norm feed its output to both attention and MLP
        self.post_attention_layernorm = None if (cfg.block == "parallel" and cfg.parallel_norms == 1) else _norm(cfg)
        self.mlp = build_mlp(cfg, layer)
        if cfg.block == "sandwich":
            self.pre_feedforward_layernorm = _norm(cfg)
            self.post_feedforward_layernorm = _norm(cfg)

    def forward(self, positions, x, residual, ctx):
        if self.block == "pre_norm":
            x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
            x = self.self_attn(positions, x, ctx)
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        if self.block == "parallel":
            if residual is not None:
                x = x + residual
            h = self.input_layernorm(x)
            m = h if self.post_attention_layernorm is None else self.post_attention_layernorm(x)
            return self.self_attn(positions, h, ctx) + self.mlp(m), x
        if self.block == "sandwich":
            x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
            x = self.post_attention_layernorm(self.self_attn(positions, x, ctx))
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        # post_norm
        if residual is not None:
            x = x + residual
        x = self.input_layernorm(x + self.self_attn(positions, x, ctx))
        return self.post_attention_layernorm(x + self.mlp(x)), None


class DecoderModel(nn.Module):
    embed = None  # the embedding's forward bound to its op (CausalLM.bind_ops)

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.cfg = cfg
        embed_dim = cfg.embed_dim or cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, embed_dim)
        self.project_in = self.project_out = None
        if embed_dim != cfg.hidden_size:
            self.project_in = ReplicatedLinear(embed_dim, cfg.hidden_size, bias=False)
            self.project_out = ReplicatedLinear(cfg.hidden_size, embed_dim, bias=False)
        self.position_offset = cfg.get("position_offset", 0)
        rotaries: list = [None] * cfg.num_layers
        if cfg.learned_positions:
            self.embed_positions = VocabParallelEmbedding(cfg.max_position + self.position_offset, cfg.hidden_size)
        else:
            rot_dim = cfg.rotary_dim or cfg.head_dim
            rotary = RotaryEmbedding(cfg.head_dim, rot_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
            local_theta = cfg.get("local_rope_theta")
            local = RotaryEmbedding(cfg.head_dim, rot_dim, cfg.max_position, local_theta) if local_theta else rotary
            rotaries = [rotary if cfg.window(i) is None else local for i in range(cfg.num_layers)]
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotaries[i]) for i in range(cfg.num_layers))
        self.norm = _norm(cfg) if cfg.final_norm else None
        self.embed_scale = cfg.embed_scale
        self.stack: Optional[dict] = None  # mii::decoder_stack's arguments (its held tensors), set by `fuse_stack`

    def fuse_stack(self) -> bool:
        """Run every decoder layer in one `mii::decoder_stack` call (mii's CPU kernels, once the model runner
        has bound the KV cache and set the fused ops) when they are all pre-norm RMSNorm layers with fused qkv,
        optional q/k RMSNorm, rotary, kernel attention and a gated SiLU MLP, unsharded (weights prepacked for
        oneDNN are called as the layers call them); the C++ loop runs the same kernels in the same order as the
        layers below. Returns whether it does."""
        params, caches, windows = [], [], []
        none = torch.empty(0)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            qk_norms = (attn.q_norm, attn.k_norm) if attn.q_norm is not None else ()
            linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
            if not (layer.block == "pre_norm" and all(isinstance(n, RMSNorm) and n.fused for n in norms)
                    and attn.rotary is not None and attn.rotary.fused
                    and attn.attn.backend == "kernel" and attn.attn.k_cache is not None
                    and isinstance(mlp, MLP) and mlp.gated and mlp.fused and mlp.act is F.silu
                    and all(m is not None and getattr(m, "tp_size", 1) == 1 for m in linears)
                    and all(isinstance(n, RMSNorm) and n.fused for n in qk_norms)
                    and {(n.eps, n.offset) for n in norms + qk_norms} == {(self.layers[0].input_layernorm.eps,
                                                                self.layers[0].input_layernorm.offset)}):
                self.stack = None
                return False
            for norm, linear in zip((layer.input_layernorm, None, layer.post_attention_layernorm, None), linears):
                if norm is not None:
                    params.append(norm.weight)
                params += [linear.weight if linear.packed is None else linear.packed,
                           none if linear.bias is None else linear.bias]
            params += [attn.rotary.cos, attn.rotary.sin] + ([n.weight for n in qk_norms] if qk_norms else [none, none])
            caches += [attn.attn.k_cache, attn.attn.v_cache]
            windows.append(attn.attn.window or 0)
        first, a = self.layers[0], self.layers[0].self_attn
        eps, offset = first.input_layernorm.eps, first.input_layernorm.offset
        # the model's last norm joins the call where it is the layers' kind: one Python call fewer a step
        last = self.norm if (isinstance(self.norm, RMSNorm) and self.norm.fused
                             and (self.norm.eps, self.norm.offset) == (eps, offset)) else None
        # the parameters, caches and windows held by the kernels between steps (a tensor handle): a step's call
        # passes one tensor, not ~480
        self.stack = dict(held=torch.ops.mii.stack_params(params, caches, windows), n_heads=a.n_heads,
                          n_kv_heads=a.n_kv_heads, head_dim=a.attn.head_dim, scale=a.attn.scale, eps=eps,
                          norm_offset=offset, act8=any(getattr(m, "act8", False) for m in self.modules()),
                          final_norm=None if last is None else last.weight)
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = (self.embed or self.embed_tokens)(input_ids)  # [T, embed_dim]
        if self.embed_scale is not None:  # rounded to the model dtype first, as transformers does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.cfg.learned_positions:
            x = x + self.embed_positions(positions + self.position_offset)
        residual, normed = None, False
        if self.stack is not None and x.shape[0]:
            st = self.stack
            x, residual = torch.ops.mii.decoder_stack(
                x, positions, st["held"], ctx.slot_mapping, ctx.query_start, ctx.seq_lens, ctx.block_tables,
                ctx.max_query_len, st["n_heads"], st["n_kv_heads"], st["head_dim"], st["scale"], st["eps"],
                st["norm_offset"], st["act8"], st["final_norm"])
            normed = st["final_norm"] is not None
        else:
            for layer in self.layers:
                x, residual = layer(positions, x, residual, ctx)
        if self.norm is not None and not normed:
            x = self.norm(x) if residual is None else self.norm(x, residual)[0]
        elif self.norm is None and residual is not None:
            x = x + residual
        return x if self.project_out is None else self.project_out(x)


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


class CausalLM(nn.Module):
    """A decoder plus LM head. Subclasses set, where the checkpoint names differ from Llama's: `renames`
    (checkpoint substring → ours, applied in order), `packed_modules` (name part → (fused parameter, shard id)),
    `expert_parts` (expert projection name → GATE/UP/DOWN), and may override `checkpoint_tensors` to re-lay out a
    tensor before routing."""

    model_class = DecoderModel
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    renames: dict = {}
    expert_parts: dict = {}
    ignored_keys = ("rotary_emb.inv_freq",)
    head = None  # the LM head's forward bound to its op (`bind_ops`)

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.cfg = cfg
        self.model = self.model_class(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.embed_dim or cfg.hidden_size, bias=cfg.lm_head_bias)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = cfg.get("final_logit_softcap")

    def bind_ops(self) -> None:
        """Bind the embedding's and the LM head's forwards to the ops they reach, once the weights are in their final
        form (the model runner does, once it has set up the model). A single-stream decode step's host part runs
        with caches the weights have just swept, where each Python call costs several times its warm cost: the
        modules' call chains around the two lookups took ~0.1 ms of a ~4.5 ms step."""
        self.model.embed = self.model.embed_tokens.bound()
        self.head = self.lm_head.bound()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions: [T] → hidden states [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self.head or self.lm_head)(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint (name, tensor) → the pairs to route; a family overrides it to split or re-lay out a tensor."""
        yield name, tensor

    def expert_shard(self, name: str) -> Optional[tuple[str, tuple]]:
        """`...experts.3.w1.weight` → (`...experts.w13`, (3, GATE)) for stacked MoE weights; None otherwise."""
        m = _EXPERT.match(name) if self.expert_parts else None
        if m is None or m.group(3) not in self.expert_parts:
            return None
        part = self.expert_parts[m.group(3)]
        return f"{m.group(1)}.{'w2' if part == DOWN else 'w13'}", (int(m.group(2)), part)


__all__ = ["Attention", "CausalLM", "DecoderLayer", "DecoderModel", "GATE", "UP", "DOWN", "build_mlp"]
