"""The engine on mii's CPU kernels (paged attention in place, fused norm/rotary/SiLU·mul) against the same
engine on the torch reference backends (MII_KERNELS=0): fp32 against transformers on both, and bf16 kernels
close to bf16 torch in vLLM's `check_logprobs_close` sense."""
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

import mii
from mii import kernels
from mii.engine import plan as plan_module
from mii.envs import cpu_flags
from tests.reference import TINY, assert_matches_transformers, prompts_for, tiny_checkpoint

VOCAB = 49152


def _pipe(path, monkeypatch, use_kernels: bool, **kw):
    monkeypatch.setenv("MII_KERNELS", "1" if use_kernels else "0")
    pipe = mii.pipeline(str(path), inference_engine_config={
        "state_manager": {"max_ragged_batch_size": 48, "kv_block_size": 8}}, **kw)
    assert pipe.engine_plan.attention == ("kernel" if use_kernels else "torch")
    return pipe


@pytest.mark.parametrize("use_kernels", [False, True])
def test_both_backends_match_transformers(tmp_path, tokenizer_dir, monkeypatch, use_kernels):
    """Mistral (GQA, sliding window shorter than the prompts, prompts chunked): greedy tokens identical to
    transformers and logprobs within 2e-3, on each backend."""
    if use_kernels and kernels.load_cpu_kernels() is not None:
        pytest.skip(f"CPU kernels not built: {kernels.load_cpu_kernels()}")
    monkeypatch.setenv("MII_KERNELS", "1" if use_kernels else "0")
    cfg = MistralConfig(vocab_size=VOCAB, sliding_window=16, **TINY)
    assert_matches_transformers(tiny_checkpoint(cfg, tmp_path, tokenizer_dir))


@pytest.mark.parametrize("native_bf16", [False, True])
def test_bf16_kernels_close_to_bf16_torch(tmp_path, tokenizer_dir, monkeypatch, native_bf16):
    """bf16 changes rounding order between the backends, so tokens may part after a near tie; until they do,
    each step's token must be in the other side's top 5 (vLLM's check_logprobs_close). The kernels' linears as
    planned for a CPU without native bf16 (weights widened to fp32) and with it (k-pair tiles, `vdpbf16ps`; on
    a CPU without it their portable loop): both layouts on any machine."""
    if kernels.load_cpu_kernels() is not None:
        pytest.skip(f"CPU kernels not built: {kernels.load_cpu_kernels()}")
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path, tokenizer_dir)
    prompts = prompts_for(VOCAB, lengths=(5, 37, 90, 12))
    outs = {}
    for use_kernels in (False, True):
        if use_kernels:
            monkeypatch.setattr(plan_module, "cpu_has_fast_bf16", lambda: native_bf16)
        pipe = _pipe(path, monkeypatch, use_kernels, dtype="bfloat16")
        if use_kernels:
            qkv = pipe.engine.loaded.model.model.layers[0].self_attn.qkv_proj.weight
            assert pipe.engine_plan.linear_backend == "kernel" and pipe.engine_plan.bf16_kpairs == native_bf16
            assert qkv.dim() == 3 and qkv.shape[-1] == (32 if native_bf16 else 64)
        outs[use_kernels] = pipe(prompts, max_new_tokens=24, do_sample=False, ignore_eos=True, logprobs=5)
        pipe.destroy()
    for ref, ours in zip(outs[False], outs[True]):
        for a, b in zip(ref.logprobs, ours.logprobs):
            if a["token_id"] != b["token_id"]:
                assert a["token_id"] in b["top_logprobs"] and b["token_id"] in a["top_logprobs"]
                break
            assert abs(a["logprob"] - b["logprob"]) < 0.1


HEAD64 = dict(TINY, hidden_size=256, intermediate_size=256)  # 4 heads of 64, 2 kv heads


@pytest.mark.skipif(not {"avx512_vnni", "avx512_bf16"} <= set(cpu_flags()),
                    reason="an int8 KV cache needs AVX512-VNNI and AVX512-BF16")
def test_int8_kv_cache_close_to_bf16(tmp_path, tokenizer_dir):
    """kv_cache_dtype="int8" (bf16 math, the kernel): the cache holds d + 4 bytes a row; greedy generation stays
    close to the bf16 cache's in vLLM's check_logprobs_close sense, and prompts served again from the prefix cache's
    int8 blocks get the same tokens."""
    if kernels.load_cpu_kernels() is not None:
        pytest.skip(f"CPU kernels not built: {kernels.load_cpu_kernels()}")
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **HEAD64), tmp_path, tokenizer_dir)
    prompts = prompts_for(VOCAB, lengths=(5, 37, 90, 12, 70))
    outs, args = {}, dict(max_new_tokens=24, do_sample=False, ignore_eos=True, logprobs=5)
    for kv in ("bfloat16", "int8"):
        pipe = mii.pipeline(str(path), dtype="bfloat16", kv_cache_dtype=kv, inference_engine_config={
            "state_manager": {"max_ragged_batch_size": 48, "kv_block_size": 16}})
        try:
            cache = pipe.engine.runner.kv_cache
            assert pipe.engine_plan.kv_dtype == kv and cache.dtype == getattr(torch, kv)
            assert cache.shape[-1] == (68 if kv == "int8" else 64)
            outs[kv] = pipe(prompts, **args)
            if kv == "int8":
                assert "kv dtype             int8  (kv_cache_dtype=int8" in pipe.engine_plan.describe()
                # the same prompts again: their full blocks come from the prefix cache, the tokens do not move
                hits = pipe.engine.kv.hit_tokens
                again = pipe(prompts, **args)
                assert pipe.engine.kv.hit_tokens - hits >= 16 * sum(len(p) // 16 for p in prompts) - 16
                assert [o.token_ids for o in again] == [o.token_ids for o in outs[kv]]
        finally:
            pipe.destroy()
    parted, diffs = 0, []
    for ref, ours in zip(outs["bfloat16"], outs["int8"]):
        for a, b in zip(ref.logprobs, ours.logprobs):
            if a["token_id"] != b["token_id"]:
                assert a["token_id"] in b["top_logprobs"] and b["token_id"] in a["top_logprobs"]
                parted += 1
                break
            diffs.append(abs(a["logprob"] - b["logprob"]))
    # (measured: 2 of the 5 part, after 3 and 13 tokens; the logprobs until then 0.024 apart on average, 0.093 at
    # most: a random tiny model's near-flat distributions)
    assert parted < len(prompts) and max(diffs) < 0.15 and sum(diffs) / len(diffs) < 0.05


def test_int8_kv_cache_refused_where_nothing_reads_it(tmp_path, tokenizer_dir, monkeypatch):
    """An int8 cache is read by the CPU kernel under bf16 math only: fp32 math, the torch backend and a head size
    the kernel does not take are refused with the reason."""
    from mii.errors import ValidationError

    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path, tokenizer_dir)  # head size 16
    with pytest.raises(ValidationError, match="kv_cache_dtype: int8 on cpu under float32 math"):
        mii.pipeline(str(path), dtype="float32", kv_cache_dtype="int8")
    if kernels.load_cpu_kernels() is None:
        with pytest.raises(ValidationError, match="int8 with head size 16 and blocks of 32: mii's CPU kernel reads"):
            mii.pipeline(str(path), dtype="bfloat16", kv_cache_dtype="int8")
    monkeypatch.setenv("MII_KERNELS", "0")
    with pytest.raises(ValidationError, match="with the torch attention: an int8 cache is read by mii's CPU"):
        mii.pipeline(str(path), dtype="bfloat16", kv_cache_dtype="int8")


def test_a_start_after_an_interrupted_build_does_not_hang():
    """cpp_extension marks a kernel build in progress with a `lock` file in the build directory and waits for it to
    go away; a build interrupted before (Ctrl-C during the first start) leaves it for good. The next process finds
    nobody holding the build directory, removes the file, loads the kernels, and says so."""
    if kernels.load_cpu_kernels() is not None:
        pytest.skip(f"CPU kernels not built: {kernels.load_cpu_kernels()}")
    baton = kernels.build_dir() / "lock"
    baton.touch()
    try:
        run = subprocess.run([sys.executable, "-c", "from mii.kernels import load_cpu_kernels as f; print(f())"],
                             capture_output=True, text=True, timeout=180)
        left = baton.exists()
    finally:
        baton.unlink(missing_ok=True)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["None"], run.stderr[-2000:]
    assert "left by a kernel build that did not finish" in run.stderr
    assert not left


def test_a_reinstall_loads_the_build_without_compiling_again():
    """A build folder is keyed by its sources' content (build_dir). A reinstall of the same mii gives every source a
    new time, and cpp_extension's ninja compiled them all again at the next start (30-40 s, reported as a load).
    The folder's library now loads as it is: with its objects and library older than every source (a reinstall's
    picture), a new process loads it, compiles nothing and says it loaded them."""
    if kernels.load_cpu_kernels() is not None:
        pytest.skip(f"CPU kernels not built: {kernels.load_cpu_kernels()}")
    build = kernels.build_dir()
    files = [p for p in build.iterdir() if p.suffix in (".o", ".so")]
    assert build / kernels.LIBRARY in files and len(files) > 1
    year_ago = int(time.time()) - 365 * 86400
    for p in files:
        os.utime(p, (year_ago, year_ago))
    run = subprocess.run([sys.executable, "-c", "from mii import kernels as k; print(k.load_cpu_kernels()); "
                          "print(k.cpu_kernels_origin()); import torch; print(hasattr(torch.ops.mii, 'linear_quant'))"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    error, origin, registered = run.stdout.strip().splitlines()[-3:]
    assert error == "None" and origin.startswith("loaded in ") and registered == "True", run.stdout
    assert [p.stat().st_mtime for p in files] == [year_ago] * len(files)  # nothing compiled or linked again


def test_a_library_that_does_not_load_is_built_again(tmp_path, caplog):
    """A build folder whose library does not load (a link cut short) loses it, so that the build runs again."""
    library = tmp_path / kernels.LIBRARY
    library.write_bytes(b"\x7fELF cut short")
    with caplog.at_level(logging.WARNING, logger="mii"):
        assert kernels._load_built(library) is False
    assert not library.exists() and "did not load" in caplog.text
    assert kernels._load_built(library) is False  # (none there: nothing to load)


def test_kernel_builds_unused_for_a_month_are_removed(tmp_path):
    """Every mii upgrade (its kernel sources), torch or CPU makes a new build folder. A loaded build marks its use;
    the builds beside it that nobody loaded for 30 days go, while a recently used one, a fresh one without the mark
    (from before it) and one that another process holds stay."""
    import fcntl

    root = tmp_path / "kernels"
    month = time.time() - 31 * 86400

    def build(name, *, used=None, changed=None):
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "mii_cpu_kernels.so").write_bytes(b"\0" * 1024)
        if used is not None:
            (folder / kernels.USED_MARK).touch()
            os.utime(folder / kernels.USED_MARK, (used, used))
        os.utime(folder, (changed or month, changed or month))
        return folder

    current = build("current", used=month)  # (the one this process loads: never removed)
    stale = build("stale", used=month)
    unmarked_stale = build("unmarked-stale")
    used_lately = build("used-lately", used=time.time() - 86400)
    unmarked_fresh = build("unmarked-fresh", changed=time.time() - 3600)
    held = build("held", used=month)
    with open(held / "build.flock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (flock locks are per open file: this one is another holder)
        os.utime(held, (month, month))
        removed = kernels.remove_unused_builds(current)
    assert sorted(removed) == sorted([stale, unmarked_stale])
    assert not stale.exists() and not unmarked_stale.exists()
    assert all(p.exists() for p in (current, used_lately, unmarked_fresh, held))
    assert sorted(kernels.remove_unused_builds(current, days=0.5)) == sorted([used_lately, held])
    if kernels.load_cpu_kernels() is None:  # (this process's build: marked as it loaded)
        assert time.time() - (kernels.build_dir() / kernels.USED_MARK).stat().st_mtime < 24 * 3600


def test_a_load_waiting_on_a_build_removed_meanwhile_starts_again(tmp_path):
    """A process waiting for a build's lock while another removes that build (unused for 30 days) gets the lock of
    a file that is gone: it starts again on a new folder, so it never builds into or loads from a removed one."""
    import fcntl
    import threading

    build = tmp_path / "kernels" / "old"
    build.mkdir(parents=True)
    entered = []
    with open(build / "build.flock", "a") as remover:
        fcntl.flock(remover, fcntl.LOCK_EX)

        def load():
            with kernels._build_lock(build):
                entered.append((build.is_dir(), os.stat(build / "build.flock").st_ino))

        waiting = threading.Thread(target=load)
        waiting.start()
        waiting.join(0.5)
        assert entered == []  # (waits for the lock)
        shutil.rmtree(build)
    waiting.join(10)
    assert len(entered) == 1 and entered[0][0]
