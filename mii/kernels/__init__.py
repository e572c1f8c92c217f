"""Kernels of our own, behind PyTorch custom ops so that eager code and `torch.compile` call them alike.

- `mii::paged_attention` writes a step's K/V into their cache slots and attends through the block tables in
  place, for a whole ragged batch (decode tokens and prompt chunks) in one call (`paged_attention_cpu.cpp`), and
  `mii::keys_paired`, whether it keeps a cache's keys in its paired layout (`paired_keys`);
- `mii::rms_norm` (with the residual add folded in), `mii::rotary_` (in place on q and k) and
  `mii::silu_and_mul`: one call each where eager PyTorch takes 5-10 small ops (`fused_cpu.cpp`);
- `mii::linear_bf16w`: a linear whose weight is stored in bf16 and whose math is fp32, for CPUs without native
  bf16 matmul: decode streams half the bytes of fp32 weights, and `mii::tiled_rows`, rows of its tiled weight
  (the embedding lookup of a tied LM head) (`linear_cpu.cpp`);
- `mii::linear_quant`: a linear whose weight is int8 or int4 (group-wise scales, `mii/layers/quant.py`'s
  layouts) and whose math is fp32: decode streams 2-4x fewer bytes than bf16 (`quant_cpu.cpp`); `mii::quant_rows`,
  rows of such a weight dequantized (the embedding lookup of a tied, quantized LM head);
- `mii::sample_race`: the sampled rows of a step (temperature, top-k, top-p, min-p, the seeded exponential race)
  in one pass over each row, drawing what the torch sampler draws, `mii::argmax_rows`, the greedy rows'
  tokens straight from bf16 logits, `mii::penalize_`, the repetition, frequency and presence penalties on the
  ids that occur, in place, and `mii::logprobs_rows`, rows' log-probabilities of a target and their top k
  without the [N, V] log-softmax (`sampler_cpu.cpp`);
- `mii::decoder_stack`: all the pre-norm decoder layers of a step (RMSNorm, qkv, rotary, attention, o, gated SiLU
  MLP) in one call, running the kernels above in the eager order without the Python between them, on the
  parameters, caches and windows that `mii::stack_params` holds for it between steps (`decoder_cpu.cpp`), and
  `mii::stack_threads`, the threads its next step takes: fewer while other processes take their cores (`team.h`).

The ops are defined here; their CPU kernels are C++, built once per machine with the system compiler and cached under
`~/.cache/mii/kernels` (`$MII_CACHE_DIR`). Why our own: no maintained package offers CPU paged attention for
current PyTorch without bringing a whole serving framework, and `flex_attention` on CPU only runs fast as a
compiled template (one compile per shape, ~1.4-2.1 ms a call measured here), too slow for decode. When the
kernels cannot be built (no compiler), `load_cpu_kernels()` returns the reason, and the engine keeps the torch
backends (gathered blocks + SDPA, eager element-wise ops).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from mii.envs import CPU_ISAS, cache_dir, cpu_flags, cpu_isa

log = logging.getLogger("mii")

# the longest to compile first: ninja starts its jobs in this order, and quant_cpu.cpp alone is a third of the build
# (2 cores, ninja's 3 jobs: the first build 40.7-46.0 s with it fourth, 36.3-44.1 s first; 5 pairs, alternated)
_SOURCES = [Path(__file__).with_name(n) for n in ("quant_cpu.cpp", "paged_attention_cpu.cpp", "linear_cpu.cpp",
                                                  "fused_cpu.cpp", "decoder_cpu.cpp", "sampler_cpu.cpp")]
_HEADERS = [Path(__file__).with_name(n) for n in ("bf16_vec.h", "team.h")]  # included by the sources: part of the build's hash
_lib = torch.library.Library("mii", "DEF")
_lib.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "Tensor slot_mapping, Tensor query_start, Tensor seq_lens, Tensor block_tables, int max_query_len, "
            "float scale, int window) -> Tensor")
_lib.define("keys_paired(Tensor q, Tensor k_cache) -> bool")
_lib.define("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, float offset) -> (Tensor, Tensor)")
_lib.define("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()")
_lib.define("silu_and_mul(Tensor x) -> Tensor")
_lib.define("linear_bf16w(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.define("linear_quant(Tensor x, Tensor weight, Tensor? bias, bool act8=False) -> Tensor")
_lib.define("quant_rows(Tensor weight, Tensor ids, ScalarType? dtype=None) -> Tensor")
_lib.define("sample_race(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor seeds, "
            "Tensor steps) -> Tensor")
_lib.define("argmax_rows(Tensor logits) -> Tensor")
_lib.define("logprobs_rows(Tensor logits, Tensor targets, int k) -> (Tensor, Tensor, Tensor)")
_lib.define("penalize_(Tensor(a!) logits, Tensor rep, Tensor presence, Tensor frequency, Tensor prompt_ids, "
            "Tensor output_ids) -> ()")
_lib.define("tiled_rows(Tensor tiles, Tensor ids) -> Tensor")
_lib.define("stack_params(Tensor[] params, Tensor[] caches, int[] windows) -> Tensor")
_lib.define("decoder_stack(Tensor x, Tensor positions, Tensor stack, Tensor slot_mapping, Tensor query_start, "
            "Tensor seq_lens, Tensor block_tables, int max_query_len, int n_heads, int n_kv_heads, int head_dim, "
            "float scale, float eps, float norm_offset, bool act8=False, Tensor? final_norm=None) -> (Tensor, Tensor)")
_lib.define("stack_few_rows(Tensor stack) -> int")
_lib.define("stack_threads(Tensor stack, int configured) -> int")
_lib.define("stack_pace(Tensor stack) -> int[]")
_lib.define("pace_trace(Tensor times, Tensor losses) -> Tensor")
_lib.define("tile_block_rows() -> int")


@torch.library.register_fake("mii::paged_attention")
def _(q, k, v, k_cache, v_cache, slot_mapping, query_start, seq_lens, block_tables, max_query_len, scale, window):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.register_fake("mii::rms_norm")
def _(x, residual, weight, eps, offset):
    return torch.empty_like(x), torch.empty_like(x) if residual is not None else x.new_empty(0)


@torch.library.register_fake("mii::rotary_")
def _(q, k, positions, cos, sin):
    return None


@torch.library.register_fake("mii::silu_and_mul")
def _(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.register_fake("mii::stack_params")
def _(params, caches, windows):
    return torch.empty(2, dtype=torch.long)


@torch.library.register_fake("mii::decoder_stack")
def _(x, positions, stack, slot_mapping, query_start, seq_lens, block_tables, max_query_len, n_heads, n_kv_heads,
      head_dim, scale, eps, norm_offset, act8=False, final_norm=None):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("mii::linear_bf16w")
def _(x, weight, bias):  # weight [N, K], tiled [N/8, K/8, 64] or k-pair tiled [N/16, K/2, 32]
    from mii.layers.linear import bf16w_rows

    return x.new_empty(*x.shape[:-1], bf16w_rows(weight))


@torch.library.register_fake("mii::sample_race")
def _(logits, temperature, top_k, top_p, min_p, seeds, steps):
    return logits.new_empty(logits.shape[0], dtype=torch.long)


@torch.library.register_fake("mii::tiled_rows")
def _(tiles, ids):
    from mii.layers.linear import bf16w_rows

    return tiles.new_empty(*ids.shape, tiles.numel() // bf16w_rows(tiles))


@torch.library.register_fake("mii::logprobs_rows")
def _(logits, targets, k):
    n = logits.shape[0]
    return (logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, k, dtype=torch.float32),
            logits.new_empty(n, k, dtype=torch.long))


@torch.library.register_fake("mii::argmax_rows")
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.long)


@torch.library.register_fake("mii::linear_quant")
def _(x, weight, bias, act8=False):  # weight packed int4 [N/2, K/G, 8 + G] (uint8) or int8 [N/2, K/G, 8 + 2G]
    return x.new_empty(*x.shape[:-1], weight.shape[0] * 2)


@torch.library.register_fake("mii::quant_rows")
def _(weight, ids, dtype=None):
    from mii.layers.quant import in_features

    return weight.new_empty(*ids.shape, in_features(weight), dtype=dtype or torch.float32)


def paired_keys(k_cache: torch.Tensor, paired: bool = True) -> torch.Tensor:
    """A copy of a key cache [blocks, kv_heads, block_size, d] with each block's keys as rows (the torch backend's
    layout) turned into the layout `mii::paged_attention` keeps where `mii::keys_paired` says so: 16-key groups,
    each d / 2 vectors whose lane u holds key u's values 2i and 2i + 1 (or back, with paired=False)."""
    n, kvh, bs, d = k_cache.shape
    rows, pairs = (n, kvh, bs // 16, 16, d // 2, 2), (n, kvh, bs // 16, d // 2, 16, 2)
    x = k_cache.reshape(rows if paired else pairs).transpose(3, 4)
    return x.contiguous().view(n, kvh, bs, d)


_lock = threading.Lock()
_state: dict = {}
_present: set = set()


def cpu_op(name: str) -> bool:
    """Whether `mii::<name>` has its CPU kernel (the kernels are loaded). Remembered once true (kernels are never
    unloaded): the dispatcher's lookup by name costs ~5 µs warm and ~50 in a decode step's cold host part, and a
    step asked it three times."""
    if name in _present:
        return True
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"mii::{name}", "CPU"):
        _present.add(name)
        return True
    return False


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` wheel (a dependency) puts it next to this Python, which
    is not on PATH when the venv is not activated (`.venv/bin/python -m ...`)."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_dir() -> Path:
    """Where the CPU kernels are built: specific to this torch, this source and this CPU's instruction set
    (-march=native)."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + torch.__version__.encode()
                         + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / key


@contextlib.contextmanager
def _build_lock(build: Path):
    """Hold the build directory against other mii processes, and clear a build baton nobody holds.

    cpp_extension marks a build in progress with a `lock` file, and a process that finds one waits until it goes
    away: after a build that was interrupted (Ctrl-C during the first start, a killed process) it never does, and
    every later start hung without a word. An advisory lock (`flock`, released by the system when its holder
    exits, however it exits) tells a live builder from a dead one: whoever holds it while `lock` exists is looking
    at a dead build's leftover, and removes it."""
    try:
        import fcntl
    except ImportError:  # (not POSIX: cpp_extension's own baton only)
        yield
        return
    while True:
        build.mkdir(parents=True, exist_ok=True)
        held = open(build / "build.flock", "a")
        fcntl.flock(held, fcntl.LOCK_EX)  # another mii process building or loading here: wait for it
        try:  # (the lock of a build removed meanwhile as unused, `remove_unused_builds`: start again)
            if os.fstat(held.fileno()).st_ino == os.stat(build / "build.flock").st_ino:
                break
        except FileNotFoundError:
            pass
        held.close()
    with held:
        try:
            baton = build / "lock"
            if baton.exists():
                log.warning("mii: removing %s, left by a kernel build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


USED_MARK = "used"  # touched by every process that loads a build: its time is the build's last use
LIBRARY = "mii_cpu_kernels.so"  # what a build folder holds once built (cpp_extension names it after the extension)
UNUSED_DAYS = 30


def remove_unused_builds(kept: Path, days: float = UNUSED_DAYS) -> list:
    """Remove the kernel builds beside `kept` that no process has loaded for `days` (4.8 MB each, one per mii
    source, torch and CPU: every upgrade left one for good). Another installed mii version, or a machine of
    another CPU sharing this home, still loads its own and so keeps it (a build from before the mark counts from
    the folder's last change). A build another process holds (building or loading) is left alone. Returns the
    removed paths."""
    try:
        import fcntl
    except ImportError:
        return []
    cutoff = time.time() - days * 86400
    removed = []
    for build in kept.parent.iterdir():
        if build == kept or not build.is_dir():
            continue
        try:
            if max(p.stat().st_mtime for p in (build, build / USED_MARK) if p.exists()) >= cutoff:
                continue
            with open(build / "build.flock", "a") as held:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (held elsewhere: OSError, kept)
                shutil.rmtree(build)
            removed.append(build)
        except OSError:
            continue
    if removed:
        log.info("mii: removed %d CPU kernel build(s) unused for %d days from %s", len(removed), days, kept.parent)
    return removed


def cpu_kernels_origin() -> str:
    """How this process got the CPU kernels: built into the cache or loaded from it, in how long, where ("" before
    `load_cpu_kernels`, or when they could not be built)."""
    return _state.get("how", "")


def _load_built(library: Path) -> bool:
    """Load a build folder's library as it is, if it has one. The folder's key is the sources' content (build_dir),
    so its library is theirs whatever their files' times: a reinstall of the same mii touches every source, and
    cpp_extension (ninja) then compiled them all again at the next start (30-40 s, shown as a load). A library that
    does not load (a link cut short) is removed, to be built again."""
    if not library.exists():
        return False
    try:
        torch.ops.load_library(str(library))
        return True
    except OSError as e:
        log.warning("mii: the CPU kernels in %s did not load (%s); building them again", library.parent, e)
        library.unlink(missing_ok=True)
        return False


def load_cpu_kernels() -> Optional[str]:
    """Build (first time on this machine) or load the CPU kernels; returns None when ready, else the reason."""
    with _lock:
        if "error" in _state:
            return _state["error"]
        try:
            from torch.utils import cpp_extension

            _ninja_on_path()

            build = build_dir()
            build.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            with _build_lock(build):
                built = not _load_built(build / LIBRARY)
                if built:
                    log.info("mii: building the CPU kernels (once per machine, under a minute) in %s", build)
                    isa = cpu_isa()  # (MII_CPU_ISA: as for a lesser CPU; its flags are in the folder's key)
                    cflags = ["-O3", "-march=native", *(CPU_ISAS[isa][1] if isa else []), "-ffast-math", "-fopenmp"]
                    cpp_extension.load(name="mii_cpu_kernels", sources=[str(p) for p in _SOURCES],
                                       build_directory=str(build), extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                                       is_python_module=False, verbose=False)
            _state["error"] = None
            _state["how"] = (f"{'built' if built else 'loaded'} in {time.perf_counter() - start:.1f} s "
                             f"{'into' if built else 'from'} {build}")
            (build / USED_MARK).touch()
            remove_unused_builds(build)
        except Exception as e:  # no compiler, or a failed build: the torch backend stays
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
            log.warning("mii: the CPU kernels could not be built (%s); using the torch backends", reason)
            _state["error"] = reason
        return _state["error"]
