"""Qwen (v1, `QWenLMHeadModel`) against transformers.

transformers has no class for Qwen v1 (it was remote code), so the reference is an equivalent Qwen2 model
(multi-head attention, q/k/v biases, no o_proj bias, RMSNorm, SiLU gated MLP): its tiny random checkpoint is
converted to the Qwen v1 layout and config keys (fused `c_attn`, `w1` = up, `w2` = gate, `c_proj`,
`intermediate_size` doubled, `kv_channels`, `layer_norm_epsilon`, `rotary_emb_base`, `seq_length`, `no_bias`),
and mii runs the converted folder while transformers runs the original.
"""
import json
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.reference import TINY, assert_matches_transformers, prompts_for, tiny_checkpoint

VOCAB = 49152


def to_qwen_v1(src, dst, cfg: Qwen2Config):
    dst.mkdir()
    state = load_file(src / "model.safetensors")
    out = {"transformer.wte.weight": state.pop("model.embed_tokens.weight"),
           "transformer.ln_f.weight": state.pop("model.norm.weight"),
           "lm_head.weight": state.pop("lm_head.weight")}
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            out[q + f"attn.c_attn.{kind}"] = torch.cat([state.pop(p + f"self_attn.{x}_proj.{kind}") for x in "qkv"])
        out[q + "attn.c_proj.weight"] = state.pop(p + "self_attn.o_proj.weight")
        out[q + "ln_1.weight"] = state.pop(p + "input_layernorm.weight")
        out[q + "ln_2.weight"] = state.pop(p + "post_attention_layernorm.weight")
        out[q + "mlp.w1.weight"] = state.pop(p + "mlp.up_proj.weight")
        out[q + "mlp.w2.weight"] = state.pop(p + "mlp.gate_proj.weight")
        out[q + "mlp.c_proj.weight"] = state.pop(p + "mlp.down_proj.weight")
    assert not state, f"unconverted tensors: {list(state)}"
    half = len(out) // 2  # two shards with an index, as real Qwen checkpoints come
    names = sorted(out)
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: out[k].contiguous() for k in keys}, dst / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    (dst / "config.json").write_text(json.dumps({
        "architectures": ["QWenLMHeadModel"], "model_type": "qwen",
        "auto_map": {"AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "kv_channels": cfg.hidden_size // cfg.num_attention_heads,
        "intermediate_size": 2 * cfg.intermediate_size, "layer_norm_epsilon": cfg.rms_norm_eps,
        "rotary_emb_base": cfg.rope_parameters["rope_theta"], "rotary_pct": 1.0, "seq_length": 1024,
        "max_position_embeddings": 1024, "no_bias": True, "tie_word_embeddings": False,
        "use_dynamic_ntk": True, "use_logn_attn": True, "scale_attn_weights": True}))
    for f in src.iterdir():  # tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, dst / f.name)


def test_qwen_v1_converted_from_qwen2(tmp_path, tokenizer_dir):
    def nonzero_bias(model):
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)

    cfg = Qwen2Config(vocab_size=VOCAB, **{**TINY, "num_key_value_heads": TINY["num_attention_heads"]},
                      rope_theta=10000.0)
    src = tiny_checkpoint(cfg, tmp_path / "qwen2", tokenizer_dir, post_init=nonzero_bias)
    to_qwen_v1(src, tmp_path / "qwen", cfg)
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert_matches_transformers(tmp_path / "qwen", prompts=prompts_for(VOCAB), hf_model=reference)
