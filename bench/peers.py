"""llama.cpp as a peer measured in the same run: `llama-bench`'s pp512 and tg128 on the same model file and cores,
and tg256 @ d128 — 256 tokens generated after a 128-token context, the workload of our single-stream decode
(tg128 starts from an empty context, so its attention reads fewer cached tokens per step).

llama.cpp is not a dependency. Build it once (a few minutes on 2 cores; `cmake -B build -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF && cmake --build build -j2 --target llama-bench llama-quantize`) and point the benchmarks at the
binary with `--llama-bench PATH` or `$LLAMA_BENCH`, or put it on PATH. With `llama-quantize` next to it, the GGUF
is also re-quantized to the other types asked for (BF16 for "the same weights" as mii's bf16 plan), once, under
the mii cache directory.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from mii.envs import cache_dir


def find_llama_bench(path: Optional[str] = None) -> Optional[Path]:
    found = path or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    return Path(found) if found and Path(found).is_file() else None


def _as_type(binary: Path, gguf: Path, ftype: str) -> Optional[Path]:
    """The GGUF re-quantized to `ftype` by the llama-quantize next to `binary` (cached); None without it."""
    quantize = binary.with_name("llama-quantize")
    if not quantize.is_file():
        return None
    out = cache_dir() / "bench" / f"{gguf.stem}.{ftype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(quantize), "--allow-requantize", str(gguf), str(out), ftype], check=True,
                       capture_output=True, timeout=600)
    return out


def llama_bench(binary: Path, gguf: Path, threads: int, types: tuple = (), repeat: int = 3) -> dict:
    """{type: {"pp512": tok/s, "tg128": tok/s, "tg256@d128": tok/s, "file": path}} for the file as it is ("file")
    and each of `types`."""
    results = {}
    for ftype in ("file",) + tuple(types):
        path = gguf if ftype == "file" else _as_type(binary, gguf, ftype)
        if path is None:
            continue
        row = {"file": str(path)}
        for args in (["-p", "512", "-n", "128"], ["-p", "0", "-n", "256", "-d", "128"]):
            for test in _run(binary, path, threads, args, repeat):
                name = f"pp{test['n_prompt']}" if test["n_gen"] == 0 else f"tg{test['n_gen']}"
                if test.get("n_depth"):
                    name += f"@d{test['n_depth']}"
                row[name] = float(test["avg_ts"])
        results[ftype] = row
    return results


def llama_decode(binary: Path, gguf: Path, threads: int, new: int = 256, depth: int = 128) -> float:
    """llama-bench's generation rate (tok/s) of `new` tokens after a `depth`-token context, one repetition: the
    single measurement that `bench/throughput.py` alternates with its own decode."""
    return float(_run(binary, gguf, threads, ["-p", "0", "-n", str(new), "-d", str(depth)], 1)[0]["avg_ts"])


def _run(binary: Path, gguf: Path, threads: int, args: list, repeat: int) -> list:
    """llama-bench's JSON results (one per test) for `args` on `gguf`."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), *args, "-r", str(repeat), "-o", "json"],
                         check=True, capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout)

