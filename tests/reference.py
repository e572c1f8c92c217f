"""Reference checks against Hugging Face `transformers` on the same weights.

`tiny_checkpoint` saves a small random model (safetensors + the SmolLM2 tokenizer) from a `transformers`
config; `assert_matches_transformers` runs the same token-id prompts through mii and through `transformers`
(fp32, greedy) and asserts identical tokens and close log-probabilities at every step.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

import mii

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.08)


def tiny_checkpoint(config, path: Path, tokenizer_dir: Path, seed: int = 0, sharded: bool = False,
                    post_init=None) -> Path:
    """Build `AutoModelForCausalLM.from_config(config)` with random weights and save it as safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if post_init is not None:
        post_init(model)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB" if sharded else "10GB")
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, path / f.name)
    return path


def prompts_for(vocab: int, lengths=(5, 37, 90), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 30000), (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int, hf_model=None):
    """Greedy tokens and per-step log-softmax of `transformers` (fp32), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = hf_model or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos=True: EOS may be generated, it just does not stop
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                                 do_sample=False, output_scores=True, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(ids):].tolist()
            logprobs = [step[0].float().log_softmax(-1) for step in out.logits]
            results.append((tokens, logprobs))
    return results


def assert_matches_transformers(model_dir, prompts=None, new_tokens: int = 32, budget: int = 48,
                                atol: float = 2e-3, hf_model=None, **pipeline_kwargs):
    """mii (fp32, chunked prompts) vs transformers: same greedy tokens, close log-probabilities."""
    from transformers import AutoConfig

    prompts = prompts or prompts_for(AutoConfig.from_pretrained(model_dir).vocab_size)
    ref = hf_greedy(model_dir, prompts, new_tokens, hf_model)
    pipe = mii.pipeline(str(model_dir), dtype="float32", inference_engine_config={
        "state_manager": {"max_ragged_batch_size": budget, "kv_block_size": 8}}, **pipeline_kwargs)
    try:
        return compare_greedy(pipe, prompts, ref, new_tokens, atol)
    finally:
        pipe.destroy()


def compare_greedy(pipe, prompts, ref, new_tokens: int, atol: float, top: int = 5):
    """Run `prompts` through `pipe` greedily and compare with `hf_greedy`'s results `ref`: every step's token, its
    log-probability, and the `top` most likely tokens (ours are theirs: the same values, within `atol`)."""
    outs = pipe(prompts, max_new_tokens=new_tokens, do_sample=False, ignore_eos=True, logprobs=top)
    assert len(outs) == len(ref) == len(prompts)
    for i, (out, (tokens, hf_lp)) in enumerate(zip(outs, ref)):
        assert out.token_ids == tokens, f"prompt {i}: mii {out.token_ids} != transformers {tokens}"
        assert len(out.logprobs) == len(hf_lp) == len(tokens) == new_tokens, f"prompt {i}: lengths"
        for step, (ours, theirs) in enumerate(zip(out.logprobs, hf_lp)):
            assert ours["token_id"] == tokens[step]
            assert abs(ours["logprob"] - theirs[ours["token_id"]].item()) < atol, f"prompt {i} step {step}"
            assert len(ours["top_logprobs"]) == top, f"prompt {i} step {step}: {len(ours['top_logprobs'])} top entries"
            for tok, lp in ours["top_logprobs"].items():
                assert abs(lp - theirs[tok].item()) < atol, f"prompt {i} step {step} token {tok}"
            # the same top values (ids may differ only between near-equal log-probabilities)
            want = theirs.topk(top).values.tolist()
            got = sorted(ours["top_logprobs"].values(), reverse=True)
            assert all(abs(a - b) < atol for a, b in zip(got, want)), f"prompt {i} step {step}: top {got} != {want}"
    return outs
