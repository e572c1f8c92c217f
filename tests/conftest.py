import mii  # noqa: F401  (first: it tunes OpenMP before torch loads)
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # without a GPU our Triton kernels run in Triton's interpreter; set before any test imports Triton (torch may
    # import it on its own), so that the order of the tests does not matter
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    import mii

    return mii.default_model()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, default_model_path) -> Path:
    """The SmolLM2 tokenizer (read from the embedded GGUF) saved in Hugging Face format, for tiny test models: as
    mii's conversion of the file saved it (`AutoTokenizer` on the GGUF, which reads the file for its config with
    the `gguf` package's slow reader first: 7 s where this takes 1)."""
    from transformers import AutoTokenizer

    from mii.loading import gguf_file

    tok = AutoTokenizer.from_pretrained(str(gguf_file.cached_folder(Path(default_model_path), "SmolLM2")))
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def default_pipe():
    """The embedded SmolLM2 in fp32, dequantized (the values transformers reads from its GGUF; by default mii keeps
    its 4-bit blocks: tests/api/test_quantized_quality.py), shared by the tests that only read from it."""
    import mii

    pipe = mii.pipeline(dtype="float32", quantization="none")
    yield pipe
    pipe.destroy()
