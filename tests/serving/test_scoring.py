"""Scoring through the OpenAI completions route, as lm-eval does it: echo=True with logprobs (max_tokens=0: the prompt
alone) against transformers' logits on the deployment's tiny random Llama; streamed and whole answers agree."""
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

PROMPT = [17, 3000, 45, 912, 8, 77, 1204, 5, 66, 9001, 31]


@pytest.fixture(scope="module")
def reference(tiny_model):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].log_softmax(-1)  # [L, V]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_echo_max_tokens_0_scores_the_prompt(oai, reference, tokenizer):
    tok_text = lambda t: tokenizer.decode([t])  # noqa: E731
    r = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=0, echo=True,
                               logprobs=2)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text == tokenizer.decode(PROMPT) and c.finish_reason == "length"
    assert lp.tokens == [tok_text(t) for t in PROMPT]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j, t in enumerate(PROMPT[1:]):
        assert abs(lp.token_logprobs[j + 1] - reference[j, t].item()) < 1e-4
        top = reference[j].topk(2)
        assert list(lp.top_logprobs[j + 1]) == [tok_text(i) for i in top.indices.tolist()]
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(tok_text(PROMPT[0]))
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 0


def test_echo_with_generated_tokens_streamed_and_whole(oai, reference):
    kwargs = dict(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kwargs).choices[0]
    assert len(whole.logprobs.tokens) == len(PROMPT) + 4
    assert abs(whole.logprobs.token_logprobs[3] - reference[2, PROMPT[3]].item()) < 1e-4
    text, tokens, lps = "", [], []
    for chunk in oai.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens and lps == whole.logprobs.token_logprobs
    zero = oai.completions.create(**{**kwargs, "max_tokens": 0, "stream": True})
    pieces = [c.choices[0] for c in zero if c.choices]
    assert "".join(p.text for p in pieces) == whole.text[: len("".join(p.text for p in pieces))]
    assert sum(len(p.logprobs.tokens) for p in pieces) == len(PROMPT)


def test_max_tokens_0_needs_echo(base_url):
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_on_the_mii_rest_route_and_grpc(base_url, deployment, reference):
    r = httpx.post(f"{base_url}/mii/{deployment.deployment_name}", timeout=60,
                   json={"prompts": [PROMPT], "max_new_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    (out,) = r.json()
    assert out["prompt_logprobs"][0]["logprob"] is None and len(out["prompt_logprobs"]) == len(PROMPT)
    assert abs(out["prompt_logprobs"][4]["logprob"] - reference[3, PROMPT[4]].item()) < 1e-4
    (grpc_out,) = deployment.generate([PROMPT], max_new_tokens=1, prompt_logprobs=1)
    assert [x["token_id"] for x in grpc_out.prompt_logprobs] == PROMPT
    assert grpc_out.prompt_logprobs[4]["logprob"] == out["prompt_logprobs"][4]["logprob"]
