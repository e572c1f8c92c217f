"""The reference for a quantized model: `transformers` holding the weights mii's packed linears dequantize to."""
from __future__ import annotations

import torch

from mii.layers.linear import LinearBase
from mii.layers.quant import dequantize, scheme


def load_dequantized(hf_model, mii_model) -> int:
    """Copy every quantized linear of `mii_model` (a Llama-family decoder), dequantized, into `hf_model`'s
    q/k/v/o and gate/up/down projections (mii's fused qkv and gate/up split back). Returns how many."""
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    hf = dict(hf_model.named_parameters())
    n = 0
    for name, m in mii_model.named_modules():
        if not isinstance(m, LinearBase) or scheme(m.weight) is None:
            continue
        w = dequantize(m.weight)
        if name.endswith("qkv_proj"):
            parts = dict(zip(("q_proj", "k_proj", "v_proj"), w.split([q, kv, kv])))
        elif name.endswith("gate_up_proj"):
            parts = dict(zip(("gate_proj", "up_proj"), w.chunk(2)))
        else:
            parts = {name.rsplit(".", 1)[1]: w}
        for part, value in parts.items():
            target = hf[f"{name.rsplit('.', 1)[0]}.{part}.weight"]
            assert target.shape == value.shape, (name, part)
            with torch.no_grad():
                target.copy_(value)
            n += 1
    return n
