"""Quantization at load time from a float checkpoint (a tiny random Llama): int4 and int8 through `mii.pipeline`
against transformers holding the weights the packed linears dequantize to; the group fallback; the options'
errors."""
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import mii
from mii.config import ModelConfig, build_config
from mii.errors import ValidationError
from mii.loading.quantize import pick_group, quant_spec
from tests.quant_reference import load_dequantized
from tests.reference import TINY, compare_greedy, hf_greedy, prompts_for, tiny_checkpoint

VOCAB = 49152


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_dir):
    return tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path_factory.mktemp("llama"), tokenizer_dir)


@pytest.mark.parametrize("quantization,group,formats", [
    ("int4", None, {"int4 g64"}),  # default group
    ("int8", None, {"int8 per-channel"}),
    ("int4", 128, {"int4 g64", "int4 g128"}),  # 128 does not divide the hidden size 64: those take 64
])
def test_matches_transformers_on_the_dequantized_weights(tiny, quantization, group, formats):
    pipe = mii.pipeline(str(tiny), dtype="float32", quantization=quantization, quantization_group=group,
                        inference_engine_config={"state_manager": {"max_ragged_batch_size": 48, "kv_block_size": 8}})
    try:
        plan = pipe.engine_plan
        assert set(plan.weight_bytes) - {"fp32"} == formats, plan.weight_bytes
        if group == 128:
            assert "group 64 (128 does not divide its 64 inputs)" in plan.quantization, plan.quantization
        hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
        before = {n: p.clone() for n, p in hf.named_parameters() if "proj" in n}
        assert load_dequantized(hf, pipe.engine.runner.model) == 7 * TINY["num_hidden_layers"]
        # the quantized weights are near the checkpoint's (a wrong scale or offset would not be)
        for name, p in hf.named_parameters():
            if name in before:
                step = before[name].abs().max() / (7 if quantization == "int4" else 127)
                assert 0 < (p - before[name]).abs().max() <= step, name
        prompts = prompts_for(VOCAB, lengths=(5, 37))
        compare_greedy(pipe, prompts, hf_greedy(None, prompts, 16, hf_model=hf), 16, atol=2e-3)
    finally:
        pipe.destroy()


def test_options_are_validated():
    with pytest.raises(ValidationError, match="quantization: Input should be 'auto', 'none', 'int8' or 'int4'"):
        build_config(ModelConfig, None, quantization="int3")
    with pytest.raises(ValidationError, match="quantization_group=48 is not a multiple of 32"):
        build_config(ModelConfig, None, quantization_group=48)
    with pytest.raises(ValidationError, match="quantization_group: .*greater than or equal to 32"):
        build_config(ModelConfig, None, quantization_group=16)
    with pytest.raises(ValidationError, match="quantization='int8' / 'int4'"):
        build_config(ModelConfig, None, quantization_mode="wf6af16")
    assert build_config(ModelConfig, None, quantization=None).quantization == "none"
    with pytest.raises(ValidationError, match="quantization: 'int4' runs on CPU only"):
        quant_spec("int4", None, "cuda", "folder")
    spec, why = quant_spec("auto", None, "cuda", "gguf")
    assert not spec.active and "dequantized on a GPU" in why
    assert quant_spec("auto", None, "cpu", "folder")[0].active is False
    assert quant_spec("auto", None, "cpu", "gguf")[0].keep_file
    assert [pick_group(k, 128) for k in (256, 576, 64, 48)] == [128, 64, 64, None]


def test_cli_quantization_options(tiny, capsys):
    """`mii explain MODEL --quantization int4 --quantization-group 32` shows the plan's quantization and weight bytes;
    a value outside the choices is refused by the command line."""
    from mii.cli import main

    args = ["explain", str(tiny), "--dtype", "float32", "--quantization", "int4", "--quantization-group", "32"]
    logged = []
    catch = logging.Handler()
    catch.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("mii").addHandler(catch)
    try:
        assert main(args) == 0
    finally:
        logging.getLogger("mii").removeHandler(catch)
    out = capsys.readouterr().out
    assert "quantization         8 quantized to int4 g32" in out and "int4 g32" in out.split("weight bytes")[1], out
    # the plan is the command's output, not logged a second time
    assert out.count("quantization  ") == 1 and not [m for m in logged if "engine plan" in m], logged
    with pytest.raises(SystemExit):
        main(["explain", str(tiny), "--quantization", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    assert main(["explain", str(tiny), "--quantization", "int4", "--quantization-group", "40"]) == 2
    assert "quantization_group=40 is not a multiple of 32" in capsys.readouterr().err
    assert main(args + ["--quantize-activations"]) == 0
    assert "activations          int8 per 32 columns in the 8 int4 linears" in capsys.readouterr().out
    for other in ("none", "int8"):  # no int4 linears: refused before loading
        assert main(["explain", str(tiny), "--quantization", other, "--quantize-activations"]) == 2
        assert "quantize_activations: rounds the inputs of int4 linears" in capsys.readouterr().err


def test_int8_activations_close_to_int16(tiny):
    """quantize_activations on a tiny int4 model: every int4 linear rounds its input to int8 (the plan says so),
    and the next-token logprobs (the 5 largest, in order) stay close to the default int16 path's without being the
    same."""
    runs = {}
    for act8 in (False, True):
        pipe = mii.pipeline(str(tiny), dtype="float32", quantization="int4", quantization_group=32,
                            quantize_activations=act8)
        try:
            assert bool(pipe.engine_plan.activations) == act8
            out = pipe(prompts_for(VOCAB, lengths=(5, 37)), max_new_tokens=1, do_sample=False, logprobs=5)
            runs[act8] = torch.tensor([sorted(r.logprobs[0]["top_logprobs"].values()) for r in out])
        finally:
            pipe.destroy()
    assert not torch.equal(runs[True], runs[False])
    torch.testing.assert_close(runs[True], runs[False], atol=0.05, rtol=0)


def test_moe_quantizes_attention_not_routers_or_experts(tmp_path, tokenizer_dir):
    """A tiny Mixtral with int4: the attention linears are packed; the router (it picks the experts) and the
    stacked experts stay float; greedy tokens match transformers holding the dequantized attention weights."""
    from transformers import MixtralConfig

    from mii.layers.quant import scheme

    cfg = MixtralConfig(vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, **TINY)
    path = tiny_checkpoint(cfg, tmp_path, tokenizer_dir)
    pipe = mii.pipeline(str(path), dtype="float32", quantization="int4",
                        inference_engine_config={"state_manager": {"max_ragged_batch_size": 48, "kv_block_size": 8}})
    try:
        model = pipe.engine.runner.model
        for layer in model.model.layers:
            assert scheme(layer.self_attn.qkv_proj.weight) == "int4" and scheme(layer.self_attn.o_proj.weight)
            assert scheme(layer.mlp.gate.weight) is None
            assert all(scheme(p) is None for p in layer.mlp.experts.parameters())
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        assert load_dequantized(hf, model) == 4 * TINY["num_hidden_layers"]
        prompts = prompts_for(VOCAB, lengths=(5, 37))
        compare_greedy(pipe, prompts, hf_greedy(None, prompts, 12, hf_model=hf), 12, atol=2e-3)
    finally:
        pipe.destroy()
