"""mii::decoder_stack (all pre-norm decoder layers of a step, and the model's last norm, in one C++ call) against the
layers' own forward and the last norm on the same step: logits bit-identical at every step of a run that mixes decode rows and prompt chunks, for each
variant it covers (Llama with a tied, tiled bf16 LM head, or on CPUs with native bf16 its weights prepacked for
oneDNN; Qwen2's qkv bias; Llama's optional biases on all its linears; Qwen3's q/k norm; Mistral's
sliding window; fp32 weights; int4 and int8 weights, int4 with int8 activations, int4 under fp32 math), steps of 1-8
rows through its few-rows path or in one parallel region included;
and the architectures it does not cover keep the layers."""
import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PhiConfig, Qwen2Config, Qwen3Config

import mii
from mii import kernels
from mii.envs import cpu_flags
from tests.reference import TINY, prompts_for, tiny_checkpoint

pytestmark = pytest.mark.skipif(kernels.load_cpu_kernels() is not None,
                                reason=f"CPU kernels not built: {kernels.load_cpu_kernels()}")

VOCAB = 49152
CASES = {
    "llama-tied-bf16w": (LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, **TINY), "auto"),
    "qwen2-qkv-bias": (Qwen2Config(vocab_size=VOCAB, **TINY), "auto"),
    "llama-all-biases": (LlamaConfig(vocab_size=VOCAB, attention_bias=True, mlp_bias=True, **TINY), "auto"),
    "qwen3-qk-norm": (Qwen3Config(vocab_size=VOCAB, head_dim=16, **TINY), "auto"),
    "mistral-window-fp32": (MistralConfig(vocab_size=VOCAB, sliding_window=16, **TINY), "float32"),
    "mistral-window-int4": (MistralConfig(vocab_size=VOCAB, sliding_window=16, **TINY), "auto",
                            dict(quantization="int4", quantization_group=32)),
    "llama-int4": (LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, **TINY), "auto", dict(quantization="int4",
                                                                                              quantization_group=32)),
    "qwen2-int8": (Qwen2Config(vocab_size=VOCAB, **TINY), "auto", dict(quantization="int8")),
    "llama-int4-act8": (LlamaConfig(vocab_size=VOCAB, **TINY), "auto", dict(quantization="int4", quantization_group=32,
                                                                          quantize_activations=True)),
    "llama-int4-fp32": (LlamaConfig(vocab_size=VOCAB, **TINY), "float32", dict(quantization="int4",
                                                                             quantization_group=32)),
}
ROW_KERNELS_QUANT = {"avx512bw", "avx512_vnni", "avx512vbmi"}  # the packed int4/int8 weights' single-row kernel


def _random_norms_and_biases(model):
    """Norm weights start at 1 and biases at 0: make them matter."""
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, mean=1.0, std=0.5)
        elif name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.1)


def _few_rows(model, plan, takes_rows: bool) -> int:
    """What mii::stack_few_rows should say once a step of 1-8 rows has run: 1, the few-rows path; else 2 where every
    linear of the stack is one of mii's kernels (packed int8/int4, bf16 weights under fp32 math, k-pair tiles), whose
    threads then share one parallel region for the whole step; else 0."""
    if takes_rows:
        return 1
    weights = [lin.weight if lin.packed is None else lin.packed for layer in model.model.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    mine = all(not w.is_mkldnn and (w.dtype in (torch.uint8, torch.int8) or w.dim() == 3
                                    or (w.dtype == torch.bfloat16 and plan.torch_dtype == torch.float32))
               for w in weights)
    return 2 if mine else 0


def _both_paths_per_step(pipe):
    """Run every step twice, through mii::decoder_stack and through the layers (the same KV slots are written with
    the same values), and collect whether each step's logits were identical."""
    runner, dm = pipe.engine.runner, pipe.engine.loaded.model.model
    stack, execute, same = dm.stack, pipe.engine.runner.execute, []

    def both(meta):
        dm.stack = stack
        fused = execute(meta)
        dm.stack = None
        layers = execute(meta)
        dm.stack = stack
        same.append(fused is None and layers is None or torch.equal(fused, layers))
        return fused

    runner.execute = both
    return same


@pytest.mark.parametrize("case", CASES)
def test_stack_equals_layers(tmp_path, tokenizer_dir, case):
    cfg, dtype, *extra = CASES[case]
    path = tiny_checkpoint(cfg, tmp_path, tokenizer_dir, post_init=_random_norms_and_biases)
    pipe = mii.pipeline(str(path), dtype=dtype, inference_engine_config={
        "state_manager": {"max_ragged_batch_size": 40, "kv_block_size": 8}}, **(extra[0] if extra else {}))
    try:
        model = pipe.engine.loaded.model
        assert model.model.stack is not None, "this architecture should run as one decoder_stack call"
        assert model.model.stack["final_norm"] is model.model.norm.weight, "the last norm should join the call"
        if dtype == "auto":  # on CPUs without native bf16 matmul: bf16 weights, the tied head tiled
            assert pipe.engine_plan.linear_backend != "kernel" or model.lm_head.weight.dim() == 3
        if extra:  # every linear of the stack is packed
            expected = torch.uint8 if extra[0]["quantization"] == "int4" else torch.int8
            assert all(layer.mlp.down_proj.weight.dtype == expected and layer.self_attn.qkv_proj.weight.dtype == expected
                       for layer in model.model.layers)
        same = _both_paths_per_step(pipe)
        # prompts longer than the step budget: chunks of several steps next to decode rows
        outs = pipe(prompts_for(VOCAB, lengths=(5, 37, 90, 3)), max_new_tokens=10, do_sample=False,
                    ignore_eos=True)
        # steps of 1-8 rows (the stack's few-rows path, where it takes the layers): one sequence alone (single
        # decode rows), and two short prompts (a first step of 6 rows, two prompt chunks, then pairs of decode rows)
        outs += pipe(prompts_for(VOCAB, lengths=(21,)), max_new_tokens=12, do_sample=False, ignore_eos=True)
        outs += pipe(prompts_for(VOCAB, lengths=(2, 4)), max_new_tokens=12, do_sample=False, ignore_eos=True)
        assert len(same) > 30 and all(same), same
        assert all(o.generated_length in (10, 12) for o in outs)
        # the few-rows path takes bf16 rows (biases and Qwen3's q/k norms too) through weights that are k-pair
        # tiles (bf16 on CPUs with native bf16 dot products) or packed int4 / int8 (on CPUs with AVX512-VNNI and VBMI)
        plan = pipe.engine_plan
        row_kernels = ROW_KERNELS_QUANT <= cpu_flags() if extra else plan.bf16_kpairs
        takes = plan.torch_dtype == torch.bfloat16 and row_kernels
        assert torch.ops.mii.stack_few_rows(model.model.stack["held"]) == _few_rows(model, plan, takes)
    finally:
        pipe.destroy()


@pytest.mark.parametrize("threads", [None, 3])
def test_the_embedded_model_alone_equals_its_layers(threads):
    """The embedded SmolLM2 in its own plan (int4 layers from its GGUF's blocks), one sequence alone: every decode
    step is a single row, which takes the stack's few-rows path on CPUs with its kernels; each step's logits equal
    the layers'. Its linears are large enough to be shared out among the threads of the few-rows path's one parallel
    region (mii_team): the machine's count, and 3 (uneven shares; more threads than cores here)."""
    before = torch.get_num_threads()
    pipe = mii.pipeline(**({} if threads is None else {"num_threads": threads}))
    try:
        model, plan = pipe.engine.loaded.model, pipe.engine_plan
        same = _both_paths_per_step(pipe)
        out = pipe("The capital of France is", max_new_tokens=12, do_sample=False, ignore_eos=True)[0]
        assert out.generated_length == 12 and len(same) == 12 and all(same), same
        takes = plan.torch_dtype == torch.bfloat16 and ROW_KERNELS_QUANT <= cpu_flags()
        assert torch.ops.mii.stack_few_rows(model.model.stack["held"]) == _few_rows(model, plan, takes)
        if threads:
            assert torch.get_num_threads() == threads
    finally:
        pipe.destroy()
        torch.set_num_threads(before)


def test_other_blocks_keep_the_layers(tmp_path, tokenizer_dir):
    """Phi-2 (parallel block, LayerNorm, GELU MLP) is not a pre-norm RMSNorm stack: it runs layer by layer."""
    cfg = PhiConfig(vocab_size=VOCAB, partial_rotary_factor=0.5,
                    **{k: v for k, v in TINY.items() if k != "num_key_value_heads"})
    pipe = mii.pipeline(str(tiny_checkpoint(cfg, tmp_path, tokenizer_dir)))
    try:
        assert pipe.engine.loaded.model.model.stack is None
        assert pipe("hello", max_new_tokens=3, ignore_eos=True)[0].generated_length == 3
    finally:
        pipe.destroy()


def test_the_held_parameters_live_as_long_as_their_handle():
    """mii::stack_params holds the stack's tensors in C++ between steps; the last reference to its handle frees
    them (a numpy array under a tensor counts the tensor's references)."""
    import sys

    import numpy as np

    arr = np.zeros(64, dtype=np.float32)
    base = sys.getrefcount(arr)
    t = torch.from_numpy(arr)
    handle = torch.ops.mii.stack_params([t] * 14, [t, t], [0])
    del t
    assert sys.getrefcount(arr) == base + 1  # the tensor, alive in the handle's record
    assert handle.dtype == torch.long and handle.shape == (2,)
    del handle
    assert sys.getrefcount(arr) == base


def test_a_tensor_that_is_not_a_handle_is_refused():
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="not a handle from mii::stack_params"):
        torch.ops.mii.decoder_stack(x, torch.zeros(1, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                         torch.zeros(1, dtype=torch.long), torch.zeros(2, dtype=torch.int32),
                                         torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1,
                                         4, 2, 16, 0.25, 1e-5, 0.0)
    with pytest.raises(RuntimeError, match="14 parameters and 2 caches per layer"):
        torch.ops.mii.stack_params([x] * 13, [x, x], [0])


def test_an_error_inside_the_few_rows_region_comes_out_and_the_next_steps_run():
    """A step of 1-8 rows runs its layers inside one parallel region (mii_team: the few-rows path, or on CPUs without
    AVX512-BF16 the layers' own kernels); an error raised there (here the attention's check of the block table's
    dtype, on the calling thread) ends the region and comes out as the op's error, and the threads are free for the
    next steps: no hang, the same greedy tokens as before."""
    pipe = mii.pipeline()
    try:
        model = pipe.engine.loaded.model
        before = pipe("The capital of France is", max_new_tokens=8, do_sample=False)[0].generated_text
        region = torch.ops.mii.stack_few_rows(model.model.stack["held"])
        takes = pipe.engine_plan.torch_dtype == torch.bfloat16 and ROW_KERNELS_QUANT <= cpu_flags()
        assert region == _few_rows(model, pipe.engine_plan, takes)
        if region == 0:
            pytest.skip("here the embedded model's steps run each kernel in its own region")
        st = model.model.stack
        x = torch.zeros(1, model.cfg.hidden_size, dtype=pipe.engine_plan.torch_dtype)
        with pytest.raises(RuntimeError, match="int32 query_start/seq_lens/block_tables"):
            torch.ops.mii.decoder_stack(x, torch.zeros(1, dtype=torch.long), st["held"], torch.zeros(1, dtype=torch.long),
                                        torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                        torch.zeros(1, 1, dtype=torch.long), 1, st["n_heads"], st["n_kv_heads"],
                                        st["head_dim"], st["scale"], st["eps"], st["norm_offset"], st["act8"],
                                        st["final_norm"])
        assert pipe("The capital of France is", max_new_tokens=8, do_sample=False)[0].generated_text == before
    finally:
        pipe.destroy()
