"""Incremental detokenization with the real SmolLM2 tokenizer: UTF-8 safe chunks, stop strings cut."""
import pytest
from transformers import AutoTokenizer

from mii.engine.detokenizer import Detokenizer

TEXT = " naïve café — 🤗 emoji, 世界 and ünïcödé ✓ done"


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def feed(detok, ids):
    chunks = [detok.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids)]
    return chunks


def test_multibyte_characters_never_split(tok):
    prompt = tok.encode("Say:")
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any(len(tok.decode([t])) and "\ufffd" in tok.decode([t]) for t in ids)  # some tokens are partial bytes
    chunks = feed(Detokenizer(tok, prompt), ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["世界", "emoji,", "✓ do"])
def test_stop_string_cut_and_held_back(tok, stop, include):
    """Nothing of the stop string is ever released, even when it spans several tokens; with include_stop (vLLM's
    include_stop_str_in_output) the text ends with it."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    whole = tok.decode(ids)
    detok = Detokenizer(tok, [], stop=(stop, "never appears"), include_stop=include)
    out = []
    for t in ids:
        out.append(detok.add(t))
        if detok.stopped:
            break
    assert detok.stopped
    assert "".join(out) == whole[: whole.index(stop) + (len(stop) if include else 0)]


def test_special_tokens_kept_when_asked(tok):
    """skip_special_tokens=False: special tokens the model generates stay in the text; by default they are left out."""
    special = tok.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode(" hi", add_special_tokens=False) + [special] + tok.encode(" there", add_special_tokens=False)
    assert "".join(feed(Detokenizer(tok, []), ids)) == " hi there"
    assert "".join(feed(Detokenizer(tok, [], skip_special=False), ids)) == " hi<|im_start|> there"
