"""prompt_logprobs (what scoring needs: OpenAI's echo with logprobs, lm-eval) against transformers' logits on the
same tiny random Llama: a prompt split over several steps, and recomputed after preemption, is scored once."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import mii
from mii.errors import ValidationError
from tests.engine.conftest import VOCAB
from tests.reference import prompts_for


def test_prompt_logprobs_equal_the_models(tiny):
    prompts = prompts_for(VOCAB, lengths=(40, 7, 1))
    pipe = mii.pipeline(str(tiny), dtype="float32", inference_engine_config={"state_manager": {
        "max_ragged_batch_size": 16, "kv_block_size": 8}})  # the 40-token prompt takes three steps
    try:
        outs = pipe(prompts, max_new_tokens=3, do_sample=False, prompt_logprobs=[3, 0, 2], logprobs=1)
        streamed = list(pipe.stream(prompts[:1], max_new_tokens=3, do_sample=False, prompt_logprobs=3))
        with pytest.raises(ValidationError) as e:
            pipe(prompts[:1], prompt_logprobs=21)
        assert e.value.field == "prompt_logprobs"
    finally:
        pipe.destroy()
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    for o, p, k in zip(outs, prompts, (3, 0, 2)):
        with torch.no_grad():
            lp = hf(torch.tensor([p])).logits[0].log_softmax(-1)  # [L, V]
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] == {
            "token_id": p[0], "logprob": None, "top_logprobs": {}}
        for j, x in enumerate(o.prompt_logprobs[1:]):
            assert x["token_id"] == p[j + 1]
            assert abs(x["logprob"] - lp[j, p[j + 1]].item()) < 1e-4
            top = lp[j].topk(k) if k else None
            assert list(x["top_logprobs"]) == (top.indices.tolist() if k else [])
            assert all(abs(v - t) < 1e-4 for v, t in zip(x["top_logprobs"].values(), top.values.tolist() if k else []))
        assert len(o.logprobs) == 3 and o.generated_length == 3
    # streamed: the prompt's logprobs come once, with the first piece
    assert [c[0].prompt_logprobs is not None for c in streamed] == [True, False, False]
    assert streamed[0][0].prompt_logprobs == outs[0].prompt_logprobs


def test_a_preempted_prompt_is_scored_once(tiny):
    prompts = [[11 + i] * 30 for i in range(5)]
    small = mii.pipeline(str(tiny), dtype="float32", inference_engine_config={"state_manager": {
        "kv_block_size": 16, "memory_config": {"mode": "allocate", "size": 10}}})
    try:
        tight = small(prompts, max_new_tokens=40, do_sample=False, ignore_eos=True, prompt_logprobs=1)
        assert small.engine.num_preemptions > 0
    finally:
        small.destroy()
    roomy = mii.pipeline(str(tiny), dtype="float32")
    try:
        free = roomy(prompts, max_new_tokens=40, do_sample=False, ignore_eos=True, prompt_logprobs=1)
    finally:
        roomy.destroy()
    for a, b in zip(tight, free):
        assert len(a.prompt_logprobs) == 30
        assert [x["token_id"] for x in a.prompt_logprobs] == [x["token_id"] for x in b.prompt_logprobs]
        pairs = zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-4 for x, y in pairs)
