"""`mii.engine.requests` without a model: prompts and keyword arguments → validated `EngineRequest`s."""
import pytest

from mii.engine.requests import InputProcessor, RequestLimits
from mii.errors import KVCacheError, PromptTooLongError, UnknownArgument, ValidationError


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
    assert inputs.process([1] * 40, {})[0][0].max_total == 41  # at least one token after a long prompt
    assert inputs.process([1] * 40, dict(max_new_tokens=20))[0][0].max_total == 48  # the KV cache holds 48
    with pytest.raises(PromptTooLongError, match="maximum context length is 64 tokens"):
        inputs.process([1] * 64, {})
    with pytest.raises(KVCacheError, match="holds only 48"):
        inputs.process([1] * 50, {})
    with pytest.raises(ValidationError, match="max_length"):
        inputs.process([1] * 10, dict(max_length=10))


@pytest.mark.parametrize("prompts, kwargs, error, words", [
    (["ok", [1, 200]], {}, ValidationError, "outside the vocabulary"),
    (["ok", ""], {}, ValidationError, r"prompts\[1\]"),
    (["ok"], dict(max_new_tokenz=[1, 2]), UnknownArgument, "max_new_tokenz"),
    (["a", "b"], dict(top_p=[0.5, 2.0]), ValidationError, "top_p"),
])
def test_any_bad_prompt_or_value_fails_the_whole_call(prompts, kwargs, error, words):
    with pytest.raises(error, match=words):
        InputProcessor(_Tokenizer(), LIMITS).process(prompts, kwargs)
