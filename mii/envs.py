"""The few environment knobs mii reads, all in one place; and the process-wide settings mii takes at start-up."""
import contextlib
import gc
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional


def cache_dir() -> Path:
    """Where converted GGUF checkpoints, packed weights, built kernels and deployment records live (MII_CACHE_DIR,
    default ~/.cache/mii). A folder that cannot be made or written (a read-only home) gives way, with a warning, to
    a private one under the temporary folder: everything works, what is cached lasts as long as that folder."""
    d = Path(os.environ.get("MII_CACHE_DIR") or Path.home() / ".cache" / "mii")
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK | os.X_OK):
            return d
        reason = "it is not writable"
    except OSError as e:
        reason = f"{type(e).__name__}: {e.strerror or e}"
    fallback = Path(tempfile.gettempdir()) / f"mii-cache-{os.getuid()}"
    fallback.mkdir(mode=0o700, exist_ok=True)
    st = fallback.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:  # another user's folder: never load kernels from it
        from mii.errors import MIIError

        raise MIIError(f"the cache folder {d} cannot be used ({reason}), nor {fallback} (owned by another user or "
                       "writable by others): set MII_CACHE_DIR to a folder of yours")
    if (str(d), reason) not in _WARNED:
        _WARNED.add((str(d), reason))
        logging.getLogger("mii").warning("the cache folder %s cannot be used (%s): caching in %s instead (set "
                                         "MII_CACHE_DIR to keep the cache across reboots)", d, reason, fallback)
    return fallback


_WARNED: set = set()


def tune_openmp() -> None:
    """Let idle OpenMP threads sleep sooner (libgomp spins 300k iterations by default). On a CPU shared with
    other busy processes the default makes every parallel region wait for a thread that lost its core: measured
    here: 10x slower matmuls, and a W64 subset (19 s idle) takes over 120 s beside a CPU-bound process, 54 s with
    20k spins; 2-10% slower on an idle machine. Takes effect only when mii is imported before torch; a value
    already set wins."""
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")


def torchrun_env() -> Optional[tuple[int, int, int]]:
    """(rank, world size, local rank) when launched by torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    return None


def ranks_on_this_host(tensor_parallel: int) -> int:
    """Processes of a tensor-parallel group that share this host's cores (torchrun: LOCAL_WORLD_SIZE)."""
    if tensor_parallel == 1:
        return 1
    if torchrun_env() is not None:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return tensor_parallel


# MII_CPU_ISA: the kernels built, and the plan made, as for a lesser CPU than this one (to test those paths here, or
# to build for the lesser machines of a mixed fleet): what each level leaves out of the CPU's flags, and the
# compiler flags that keep it out of the kernels
CPU_ISAS = {
    "avx512": (("avx512_bf16", "amx"), ["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]),
    "avx2": (("avx512", "amx"), ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]),
}


def cpu_isa() -> Optional[str]:
    """MII_CPU_ISA: None (native, the default), "avx512" (AVX-512 without AVX512-BF16 or AMX: an Ice Lake) or
    "avx2" (no AVX-512: a Zen 3)."""
    value = os.environ.get("MII_CPU_ISA", "").strip().lower()
    if value in ("", "native"):
        return None
    if value not in CPU_ISAS:
        raise ValueError(f"MII_CPU_ISA={value!r}: expected native, avx512 (AVX-512 without AVX512-BF16 or AMX) or "
                         f"avx2 (no AVX-512)")
    return value


def cpu_flags() -> frozenset:
    """This CPU's feature flags (/proc/cpuinfo; less what MII_CPU_ISA leaves out), empty where that cannot be
    read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()[2:]
    except OSError:
        return frozenset()
    isa = cpu_isa()
    return frozenset(f for f in flags if not (isa and f.startswith(CPU_ISAS[isa][0])))


def kernels_disabled() -> bool:
    """MII_KERNELS=0 keeps the torch reference backends (attention: gathered blocks + SDPA), for comparison or
    where our kernels cannot run."""
    return os.environ.get("MII_KERNELS", "1") == "0"


def packed_cache_disabled() -> bool:
    """MII_PACKED_CACHE=0: weights laid out for the kernels (int8/int4 packed, bf16 tiles) are laid out at every start,
    never cached (`mii.loading.packed_cache`)."""
    return os.environ.get("MII_PACKED_CACHE", "1") == "0"


def quant_tiles_bf16() -> bool:
    """MII_QUANT_TILES=bf16 (opt-in): where int4/int8 linears of 9+ bf16 rows take AMX tiles, the tiles hold the
    weights rounded to bf16 (a bf16 model's precision) instead of their exact integers scaled per group: W64 ~20%
    faster on the embedded model, outputs close to, not the same as, the exact weights'. Read per call by the
    kernels (`bf16_tiles_chosen` in quant_cpu.cpp), and here for the plan."""
    return os.environ.get("MII_QUANT_TILES", "") == "bf16"


def amx_disabled() -> bool:
    """MII_AMX=0 keeps the CPU kernels off AMX tiles (the AVX-512 path for every row count); read per call by the
    kernels themselves (`mii_vec::amx_usable`), and here for the plan."""
    return os.environ.get("MII_AMX", "1") == "0"


def thread_pace_disabled() -> bool:
    """MII_THREAD_PACE=0 keeps the plan's threads for every step, where by default the steps take fewer while other
    processes take their cores (`mii_team::Pace` in kernels/team.h, which reads it as each model's stack is held);
    here for the plan."""
    return os.environ.get("MII_THREAD_PACE", "1") == "0"


@contextlib.contextmanager
def collections_paused():
    """No garbage collection inside (as it was after): for the start-up's long-lived objects. Importing torch and
    building an engine allocate ~220,000 objects that stay, and each full collection on the way walks all those
    made so far: measured on the Zen 4 EPYC, 7 full and ~80 younger collections, ~0.3 s of a 2.1 s warm start. Once
    resumed, the first collection walks the new objects once."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
