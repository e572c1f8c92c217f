"""OPT: learned absolute positions (index offset 2), LayerNorm, ReLU plain MLP, biases everywhere.

Two layouts: pre-norm with a final LayerNorm (most sizes), and OPT-350m's post-norm one without a final norm,
whose 512-wide embeddings go through `project_in` / `project_out` around the 1024-wide decoder.
"""
from mii.errors import UnsupportedModelError
from mii.models.config import llama_like
from mii.models.decoder import CausalLM
from mii.models.registry import register


def opt_config(hf: dict):
    if not hf.get("layer_norm_elementwise_affine", True):
        raise UnsupportedModelError("OPT with layer_norm_elementwise_affine=false is not supported")
    pre_norm = hf.get("do_layer_norm_before", True)
    bias = hf.get("enable_bias", True)
    hidden = hf["hidden_size"]
    return llama_like(
        hf, intermediate_size=hf["ffn_dim"], hidden_act=hf.get("activation_function", "relu"), norm="layer",
        norm_eps=1e-5, mlp="plain", attention_bias=bias, mlp_bias=bias, learned_positions=True,
        block="pre_norm" if pre_norm else "post_norm",
        final_norm=pre_norm and not hf.get("_remove_final_layer_norm", False),
        embed_dim=hf.get("word_embed_proj_dim") or hidden,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        extra={"o_proj_bias": bias, "position_offset": 2})


@register(["OPTForCausalLM"], ["opt"], opt_config)
class OPTForCausalLM(CausalLM):
    # order matters: the decoder's final_layer_norm before the layers' own
    renames = {
        "decoder.final_layer_norm": "norm",
        "final_layer_norm": "post_attention_layernorm",
        "self_attn_layer_norm": "input_layernorm",
        "self_attn.out_proj": "self_attn.o_proj",
        ".fc1.": ".mlp.fc1.",
        ".fc2.": ".mlp.fc2.",
        "model.decoder.": "model.",
    }

    def checkpoint_tensors(self, name, tensor):
        # some OPT checkpoints were saved from OPTModel: "decoder.layers..." without the "model." prefix
        yield ("model." + name if name.startswith("decoder.") else name), tensor
