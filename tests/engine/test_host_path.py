"""A decode step's lean host path: its metadata (`_prepare_decode`, plain Python over the sequences) is what the
general path (`_prepare_any`, numpy over the flat batch) builds for the same batch, and the embedding and LM head
bound to their ops (`CausalLM.bind_ops`) compute what the modules compute."""
import dataclasses

import numpy as np
import pytest
import torch

import mii
from mii.engine.model_runner import StepMeta
from tests.engine.conftest import VOCAB
from tests.reference import TINY, tiny_checkpoint


def test_a_decode_step_builds_the_general_metadata(pipe, monkeypatch):
    runner = pipe.engine.runner
    assert runner.attention == "kernel"  # (the decode path serves the kernels' varlen view)
    bs = runner.block_size
    sizes = []
    run = runner.run

    def checked(batch):
        if all(c.length == 1 for c in batch.chunks):
            fast, general = runner._prepare_decode(batch), runner._prepare_any(batch)
            for f in dataclasses.fields(StepMeta):
                a, b = getattr(fast, f.name), getattr(general, f.name)
                if f.name == "groups":  # (the torch backend's view: the kernels do not read it)
                    continue
                if isinstance(b, np.ndarray):
                    assert a.dtype == b.dtype and np.array_equal(a, b), f.name
                else:
                    assert a == b, f.name
            sizes.append(len(batch.chunks))
        return run(batch)

    monkeypatch.setattr(runner, "run", checked)
    # prompts ending on either side of a block's edge, and decoding across the next ones
    prompts = [" ".join(["word"] * n) for n in (2, bs - 1, bs, bs + 1, 2 * bs + 5)]
    outs = pipe(prompts, max_new_tokens=bs + 3, ignore_eos=True, do_sample=False)
    assert [o.generated_length for o in outs] == [bs + 3] * len(prompts)
    assert max(sizes) == len(prompts) and len(sizes) >= bs


@pytest.fixture(scope="module")
def tied(tmp_path_factory, tokenizer_dir):
    """The tiny Llama with its embedding tied to the LM head (SmolLM2's way): then the embedding's rows come from the
    head's tiled or quantized weight."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, **TINY)
    return tiny_checkpoint(config, tmp_path_factory.mktemp("tied"), tokenizer_dir)


@pytest.mark.parametrize("source,dtype,quantization", [
    *[(m, d, q) for m in ("tiny", "tied") for d, q in (("float32", "none"), ("bfloat16", "none"),
                                                      ("bfloat16", "int4"), ("bfloat16", "int8"))],
    ("default", "bfloat16", "auto"),  # the embedded SmolLM2's own plan: its tied embedding int8 (mii::quant_rows)
])
def test_the_bound_embedding_and_lm_head_are_the_modules(request, source, dtype, quantization):
    if source == "default":
        pipe = mii.pipeline(dtype=dtype)
    else:
        pipe = mii.pipeline(str(request.getfixturevalue(source)), dtype=dtype, quantization=quantization)
    try:
        model = pipe.engine.runner.model
        assert model.model.embed is not None and model.head is not None
        ids = torch.tensor([0, 5, 17, VOCAB - 1, 5])
        rows = model.model.embed(ids)
        expected = model.model.embed_tokens(ids)
        assert rows.dtype == expected.dtype == getattr(torch, dtype) and torch.equal(rows, expected)
        h = torch.randn(3, rows.shape[1]).to(rows.dtype)
        logits = model.head(h)
        assert logits.shape == (3, VOCAB) and torch.equal(logits, model.lm_head(h))
    finally:
        pipe.destroy()
