"""`mii.engine.requests` without a model: prompts and keyword arguments → validated `EngineRequest`s."""
import re

import pytest

from mii.engine.params import GenerationParams
from mii.engine.requests import InputProcessor, RequestLimits
from mii.errors import PromptTooLongError, UnknownArgument, ValidationError


class _Tokenizer:
    """One token per character (ids 1..), BOS = 0 when special tokens are added."""

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) % 90 + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i + 31) for i in ids if i)


LIMITS = RequestLimits(max_context=64, default_max_length=32, kv_capacity_tokens=48, vocab_size=100)


def test_n_expansion_seeds_prefix_and_per_prompt_values():
    inputs = InputProcessor(_Tokenizer(), LIMITS)
    reqs, single = inputs.process(["ab", [5, 6, 7]], dict(n=2, seed=9, max_new_tokens=[4, 5], return_full_text=True))
    assert not single and len(reqs) == 4
    assert [r.params.seed for r in reqs] == [9, 10, 9, 10]
    assert [r.max_total for r in reqs] == [3 + 4, 3 + 4, 3 + 5, 3 + 5]
    assert reqs[0].prompt_ids == [0, 8, 9] and reqs[0].prefix == "ab"
    assert reqs[2].prefix == _Tokenizer().decode([5, 6, 7])
    chat, _ = inputs.process("ab", {}, add_special_tokens=False)
    assert chat[0].prompt_ids == [8, 9] and chat[0].prefix == ""


def test_length_limits():
    inputs = InputProcessor(_Tokenizer(), LIMITS)
    assert inputs.process([1] * 10, {})[0][0].max_total == 32  # MII's default max_length
    assert inputs.process([1] * 10, dict(max_length=20))[0][0].max_total == 20
    assert inputs.process([1] * 10, dict(max_new_tokens=30))[0][0].max_total == 40  # explicit: past the default
    assert inputs.process([1] * 10, dict(max_new_tokens=30, max_length=25))[0][0].max_total == 25
    assert inputs.process([1] * 40, {})[0][0].max_total == 41  # at least one token after a long prompt
    assert inputs.process([1] * 40, dict(max_new_tokens=8))[0][0].max_total == 48  # the KV cache holds 48
    with pytest.raises(PromptTooLongError, match="maximum context length is 64 tokens"):
        inputs.process([1] * 64, {})
    with pytest.raises(ValidationError, match="^prompt: .*KV cache of this engine holds only 48"):
        inputs.process([1] * 50, {})  # a 400-class error: it can never run, retrying will not help
    with pytest.raises(ValidationError, match="max_length"):
        inputs.process([1] * 10, dict(max_length=10))
    # min_new_tokens past what the request may generate (EOS banned until then): refused, not run to the end
    assert inputs.process([1] * 10, dict(min_new_tokens=22))[0][0].max_total == 32
    with pytest.raises(ValidationError, match="^min_new_tokens: 23 exceeds the 22 tokens .* 10-token prompt"):
        inputs.process([1] * 10, dict(min_new_tokens=23))
    with pytest.raises(ValidationError, match="^min_new_tokens: 39 exceeds the 38 tokens"):
        inputs.process([1] * 10, dict(min_new_tokens=39, max_length=48))


def test_explicit_length_beyond_the_context_is_an_error():
    """OpenAI's and vLLM's rule: an explicit completion length that does not fit is refused, not shortened."""
    inputs = InputProcessor(_Tokenizer(), RequestLimits(64, 32, 1000, 100))
    with pytest.raises(PromptTooLongError) as e:
        inputs.process([1] * 10, dict(max_new_tokens=60))
    assert str(e.value) == ("prompt: This model's maximum context length is 64 tokens. However, you requested 70 "
                            "tokens (10 in the prompt, 60 for the completion). Please reduce the length of the "
                            "prompt or of the completion.")
    assert (e.value.prompt_length, e.value.completion_tokens, e.value.max_context) == (10, 60, 64)
    with pytest.raises(PromptTooLongError, match=r"requested 100 tokens \(10 in the prompt, 90 for"):
        inputs.process([1] * 10, dict(max_length=100))
    assert inputs.process([1] * 10, dict(max_new_tokens=54))[0][0].max_total == 64  # exactly the context fits
    assert inputs.process([1] * 10, dict(max_length=64))[0][0].max_total == 64
    with pytest.raises(ValidationError, match="^max_new_tokens: .*need 60 tokens.*holds only 48"):
        InputProcessor(_Tokenizer(), LIMITS).process([1] * 40, dict(max_new_tokens=20))


def test_error_info_keeps_the_completion_length():
    from mii.errors import error_from_info, error_info

    e = error_from_info(error_info(PromptTooLongError(10, 64, 60)))
    assert isinstance(e, PromptTooLongError) and str(e) == str(PromptTooLongError(10, 64, 60))


@pytest.mark.parametrize("prompts, kwargs, error, words", [
    (["ok", [1, 200]], {}, ValidationError, "outside the vocabulary"),
    (["ok", ""], {}, ValidationError, r"prompts\[1\]"),
    (["ok"], dict(max_new_tokenz=[1, 2]), UnknownArgument, "max_new_tokenz"),
    (["a", "b"], dict(top_p=[0.5, 2.0]), ValidationError, "top_p"),
    # the sampler adds j to the seed of sample j, in int64: seed + n - 1 must fit
    (["ok"], dict(seed=2**63 - 2, n=3), ValidationError, r"seed: must be <= 9223372036854775805.*seed \+ j"),
    (["ok"], dict(seed=2**64), ValidationError, "seed: must be <= 9223372036854775807"),
    (["ok"], dict(seed=-2**63 - 1), ValidationError, "seed: must be >= -9223372036854775808"),
    (["ok"], dict(stop_token_ids=[5, 100], min_new_tokens=2), ValidationError, "stop_token_ids: token id 100 is outside"),
    (["ok"], dict(stop_token_ids=[-3]), ValidationError, "stop_token_ids: token ids are >= 0"),
    (["ok"], dict(top_k=2**70), ValidationError, "top_k: must be <="),
    # a lone surrogate: valid JSON ("\\ud800"), but no tokenizer encodes it and gRPC cannot carry it
    (["ok", "a \ud800 b"], {}, ValidationError, r"prompts\[1\]: is not valid Unicode: '\\ud800' at character 2"),
    ("\udfff", {}, ValidationError, "prompts: is not valid Unicode"),
    (["ok"], dict(stop=["x\ud800"]), ValidationError, r"stop: 'x\\ud800' is not valid Unicode"),
])
def test_any_bad_prompt_or_value_fails_the_whole_call(prompts, kwargs, error, words):
    with pytest.raises(error, match=words):
        InputProcessor(_Tokenizer(), LIMITS).process(prompts, kwargs)


def test_largest_and_smallest_seeds_are_accepted():
    reqs, _ = InputProcessor(_Tokenizer(), LIMITS).process("ok", dict(seed=2**63 - 3, n=3))
    assert [r.params.seed for r in reqs] == [2**63 - 3, 2**63 - 2, 2**63 - 1]
    reqs, _ = InputProcessor(_Tokenizer(), LIMITS).process("ok", dict(seed=-2**63, n=2))  # vLLM takes any int64
    assert [r.params.seed for r in reqs] == [-2**63, -2**63 + 1]


NONFINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                  "frequency_penalty"])
@pytest.mark.parametrize("value", NONFINITE + [10**400])
def test_non_finite_numbers_are_refused(name, value):
    with pytest.raises(ValidationError, match=f"^{name}: must be a finite number"):
        GenerationParams.from_kwargs({name: value})


@pytest.mark.parametrize("kwargs, words", [
    (dict(repetition_penalty=0), "repetition_penalty: must be > 0, got 0"),
    (dict(n=129), "n: must be <= 128"),
    (dict(logprobs=21), "logprobs: must be <= 20"),
    (dict(stop=[f"s{i}" for i in range(17)]), "stop: at most 16 stop strings, got 17"),
    (dict(stop="x" * 257), "stop: a stop string may have at most 256 characters, got 257"),
    (dict(stop_token_ids=list(range(65))), "stop_token_ids: at most 64 ids, got 65"),
])
def test_request_bounds(kwargs, words):
    with pytest.raises(ValidationError, match=f"^{re.escape(words)}"):
        GenerationParams.from_kwargs(kwargs)
    # the bounds themselves are accepted
    at_bound = {k: (v[:-1] if isinstance(v, list) else v[:-1] if isinstance(v, str) else
                    v - 1 if k != "repetition_penalty" else 0.01) for k, v in kwargs.items()}
    GenerationParams.from_kwargs(at_bound)


def test_more_sequences_than_the_engine_holds_is_a_validation_error():
    """prompts × n beyond max_tracked_sequences could never be admitted: a 400-class error, not a 429 to retry."""
    inputs = InputProcessor(_Tokenizer(), RequestLimits(64, 32, 48, 100, max_sequences=8))
    assert len(inputs.process(["a", "b"], dict(n=4))[0]) == 8
    with pytest.raises(ValidationError, match=r"^prompts: 3 prompt\(s\) × n make 9 sequences; .* at most 8"):
        inputs.process(["a", "b", "c"], dict(n=[4, 4, 1]))
