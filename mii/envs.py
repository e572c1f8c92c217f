"""The few environment knobs mii reads, all in one place."""
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted GGUF checkpoints and deployment records live (MII_CACHE_DIR, default ~/.cache/mii)."""
    return Path(os.environ.get("MII_CACHE_DIR") or Path.home() / ".cache" / "mii")


def tune_openmp() -> None:
    """Let idle OpenMP threads sleep sooner (libgomp spins 300k iterations by default). On a CPU shared with
    other busy processes the default makes every parallel region wait for a thread that lost its core: measured
    here: 10x slower matmuls, and a W64 subset (19 s idle) takes over 120 s beside a CPU-bound process, 54 s with
    20k spins; 2-10% slower on an idle machine. Takes effect only when mii is imported before torch; a value
    already set wins."""
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
