"""The engine on mii's CPU kernels (paged attention in place, fused norm/rotary/SiLU·mul) against the same
engine on the torch reference backends (MII_KERNELS=0): fp32 against transformers on both, and bf16 kernels
close to bf16 torch in vLLM's `check_logprobs_close` sense."""
import pytest
import torch
from transformers import LlamaConfig, MistralConfig

import mii
from mii import kernels
from tests.reference import TINY, assert_matches_transformers, prompts_for, tiny_checkpoint

VOCAB = 49152


def _pipe(path, monkeypatch, use_kernels: bool, **kw):
    monkeypatch.setenv("MII_KERNELS", "1" if use_kernels else "0")
    pipe = mii.pipeline(str(path), inference_engine_config={
        "state_manager": {"max_ragged_batch_size": 48, "kv_block_size": 8}}, **kw)
    assert pipe.engine_plan.attention == ("kernel" if use_kernels else "torch")
    return pipe


@pytest.mark.parametrize("use_kernels", [False, True])
def test_both_backends_match_transformers(tmp_path, tokenizer_dir, monkeypatch, use_kernels):
    """Mistral (GQA, sliding window shorter than the prompts, prompts chunked): greedy tokens identical to
    transformers and logprobs within 2e-3, on each backend."""
    if use_kernels and kernels.load_cpu_kernels() is not None:
        pytest.skip(f"CPU kernels not built: {kernels.load_cpu_kernels()}")
    monkeypatch.setenv("MII_KERNELS", "1" if use_kernels else "0")
    cfg = MistralConfig(vocab_size=VOCAB, sliding_window=16, **TINY)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir))


def test_bf16_kernels_close_to_bf16_torch(tmp_path, tokenizer_dir, monkeypatch):
    """bf16 changes rounding order between the backends, so tokens may part after a near tie; until they do,
    each step's token must be in the other side's top 5 (vLLM's check_logprobs_close)."""
    if kernels.load_cpu_kernels() is not None:
        pytest.skip(f"CPU kernels not built: {kernels.load_cpu_kernels()}")
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path, tokenizer_dir)
    prompts = prompts_for(VOCAB, lengths=(5, 37, 90, 12))
    outs = {}
    for use_kernels in (False, True):
        pipe = _pipe(path, monkeypatch, use_kernels, dtype="bfloat16")
        outs[use_kernels] = pipe(prompts, max_new_tokens=24, do_sample=False, ignore_eos=True, logprobs=5)
        pipe.destroy()
    for ref, ours in zip(outs[False], outs[True]):
        for a, b in zip(ref.logprobs, ours.logprobs):
            if a["token_id"] != b["token_id"]:
                assert a["token_id"] in b["top_logprobs"] and b["token_id"] in a["top_logprobs"]
                break
            assert abs(a["logprob"] - b["logprob"]) < 0.1
