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
    """The SmolLM2 tokenizer (read from the embedded GGUF) saved in Hugging Face format, for tiny test models."""
    from transformers import AutoTokenizer

    path = Path(default_model_path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
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
