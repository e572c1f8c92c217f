"""The few environment knobs mii reads, all in one place."""
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted GGUF checkpoints and deployment records live (MII_CACHE_DIR, default ~/.cache/mii)."""
    return Path(os.environ.get("MII_CACHE_DIR") or Path.home() / ".cache" / "mii")
