"""Fixtures of the engine tests: a tiny random Llama checkpoint (the SmolLM2 tokenizer and vocabulary) and an fp32
pipeline on it, one per test module."""
import pytest
from transformers import LlamaConfig

import mii
from tests.reference import TINY, tiny_checkpoint

VOCAB = 49152


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_dir):
    return tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path_factory.mktemp("llama"), tokenizer_dir)


@pytest.fixture(scope="module")
def pipe(tiny):
    p = mii.pipeline(str(tiny), dtype="float32")
    yield p
    p.destroy()
