"""The packed weights' cache (`mii.loading.packed_cache`): a second start of the same checkpoint and settings maps
the int8/int4 weights and bf16 tiles as the first laid them out, bit for bit, 64-byte aligned, and says so; a changed
checkpoint, other code or a damaged cache never serves stale values."""
import json
import os
import re

import pytest
import torch
from transformers import LlamaConfig

import mii
import mii.engine.plan
from mii.envs import cache_dir
from mii.loading import packed_cache
from tests.reference import TINY, tiny_checkpoint

VOCAB = 49152
PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty mii cache, but for the CPU kernels this session built."""
    root = tmp_path / "cache"
    root.mkdir()
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (root / "kernels").symlink_to(kernels)
    monkeypatch.setenv("MII_CACHE_DIR", str(root))
    return root


def _load(path, quantization="int4", **kwargs):
    """(the parameters as the engine holds them, greedy tokens, the plan's start-up reason and quantization row,
    what of the weights is packed as the plan's start-up row names it)."""
    pipe = mii.pipeline(str(path), quantization=quantization, **kwargs)
    params = {n: p.detach().clone() for n, p in pipe.engine.runner.model.named_parameters()}
    tokens = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=8, do_sample=False, ignore_eos=True)]
    plan = pipe.engine_plan
    tiles = plan.linear_backend == "kernel"  # (bf16 weights tiled for mii::linear_bf16w)
    what = " and ".join(["int8/int4"] * (quantization != "none") + ["bf16 tiles"] * tiles)
    pipe.destroy()
    packed_cache.wait_for_writes()  # (a copy is written on a thread of its own)
    return params, tokens, plan.reasons["start-up"], plan.quantization, what


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_second_start_reads_the_weights_as_packed(tmp_path, tokenizer_dir, cache, monkeypatch, quantization):
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    first = _load(path, quantization)
    (entry,) = (cache / "packed").iterdir()
    assert f"({first[4]} packed now, saving to {entry})" in first[2]
    second = _load(path, quantization)
    assert f"({first[4]} read as packed before from {entry})" in second[2]
    monkeypatch.setenv("MII_PACKED_CACHE", "0")
    fresh = _load(path, quantization)
    assert f"({first[4]} packed as they load, at every start)" in fresh[2]
    assert any(p.dtype in (torch.uint8, torch.int8) for p in fresh[0].values())  # (packed: the cache has a role)
    assert _same(first[0], second[0]) and _same(second[0], fresh[0])
    assert first[1] == second[1] == fresh[1] and first[3] == second[3] == fresh[3]


@pytest.mark.parametrize("native_bf16", ["as this CPU", "without"])
def test_bf16_tiles_are_mapped_from_the_cache_aligned(tmp_path, tokenizer_dir, cache, monkeypatch, native_bf16):
    """No quantization, bf16 weights tiled for mii::linear_bf16w (the plan on any CPU the kernels build for: k-pair
    tiles under bf16 math where the CPU has native bf16, else 8x8 tiles under fp32 math, planned here as on such a
    CPU): the tiles are cached; the next start maps them from the file (no copy), each on a 64-byte boundary (the
    kernels' loads), with the same parameters and tokens as a start without the cache."""
    if native_bf16 == "without":
        monkeypatch.setattr(mii.engine.plan, "cpu_has_fast_bf16", lambda: False)
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    first = _load(path, "none")
    assert first[4] == "bf16 tiles"
    (entry,) = (cache / "packed").iterdir()
    assert f"(bf16 tiles packed now, saving to {entry})" in first[2]
    pipe = mii.pipeline(str(path), quantization="none")
    assert f"(bf16 tiles read as packed before from {entry})" in pipe.engine_plan.reasons["start-up"]
    mapped = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(entry / "model.safetensors")):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                mapped.append((lo, hi))
    params = [p for p in pipe.engine.runner.model.parameters() if p.numel()]
    kpairs = pipe.engine_plan.bf16_kpairs
    assert kpairs == (native_bf16 == "as this CPU" and mii.engine.plan.cpu_has_fast_bf16())
    tiled = [p for p in params if p.dim() == 3]  # (k-pair tiles [N/16, K/2, 32], else 8x8 tiles [N/8, K/8, 64])
    assert tiled and all(p.shape[-1] == (32 if kpairs else 64) for p in tiled)
    assert mapped and all(any(lo <= p.data_ptr() < hi for lo, hi in mapped) for p in params)
    assert all(p.data_ptr() % 64 == 0 for p in params)
    second = ({n: p.detach().clone() for n, p in pipe.engine.runner.model.named_parameters()},
              [r.token_ids for r in pipe(PROMPTS, max_new_tokens=8, do_sample=False, ignore_eos=True)])
    pipe.destroy()
    monkeypatch.setenv("MII_PACKED_CACHE", "0")
    fresh = _load(path, "none")
    assert "(bf16 tiles packed as they load, at every start)" in fresh[2]
    assert _same(first[0], second[0]) and _same(second[0], fresh[0])
    assert first[1] == second[1] == fresh[1]


def test_nothing_is_cached_where_nothing_is_packed_or_when_off(tmp_path, tokenizer_dir, cache, monkeypatch):
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    plain = _load(path, "none", dtype="float32")  # (fp32 weights as loaded: nothing laid out for a kernel)
    assert plain[4] == "" and re.search(r"weights \d+\.\d s;", plain[2])
    assert not (cache / "packed").exists()
    monkeypatch.setenv("MII_PACKED_CACHE", "0")
    _load(path, "int4")
    assert not (cache / "packed").exists()


def test_a_changed_checkpoint_is_packed_again_and_stale_copies_go(tmp_path, tokenizer_dir, cache):
    """The key holds the checkpoint's files: new weights in the same folder are packed again (never the old
    values), and the copies of the old files go, under every quantization; so do those of a folder that is gone.
    Other quantizations of the current files stay."""
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir, seed=0)
    gone = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "gone", tokenizer_dir, seed=2)
    old4, old8, gone4 = _load(path, "int4"), _load(path, "int8"), _load(gone, "int4")
    assert len(list((cache / "packed").iterdir())) == 3
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()

    tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), path, tokenizer_dir, seed=1)  # new weights, same folder
    new4 = _load(path, "int4")
    assert "packed now" in new4[2] and not _same(new4[0], old4[0])
    entries = list((cache / "packed").iterdir())
    assert len(entries) == 1 and json.loads((entries[0] / "record.json").read_text())["source"] == str(path.resolve())
    new8 = _load(path, "int8")
    assert "packed now" in new8[2] and len(list((cache / "packed").iterdir())) == 2
    assert "read as packed before" in _load(path, "int4")[2]


def test_other_code_packs_again(tmp_path, tokenizer_dir, cache, monkeypatch):
    """The key holds the source of the code that lays out and packs the weights (here: its format version)."""
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    _load(path)
    monkeypatch.setattr(packed_cache, "FORMAT_VERSION", packed_cache.FORMAT_VERSION + 1)
    assert "packed now" in _load(path)[2]
    assert len(list((cache / "packed").iterdir())) == 1  # (the other code's copy of the same files: removed)


@pytest.mark.parametrize("damage", ["weights", "record", "parameters"])
def test_a_damaged_cache_is_ignored_with_a_warning(tmp_path, tokenizer_dir, cache, caplog, damage):
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    first = _load(path)
    (entry,) = (cache / "packed").iterdir()
    if damage == "weights":
        (entry / "model.safetensors").write_bytes((entry / "model.safetensors").read_bytes()[:1000])
    elif damage == "record":
        (entry / "record.json").write_text("{")
    else:  # a parameter the model does not have
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(entry / "model.safetensors"))
        tensors["model.extra"] = torch.zeros(2)
        save_file(tensors, str(entry / "model.safetensors"))
    with caplog.at_level("WARNING", logger="mii"):
        again = _load(path)
    assert f"ignoring the packed weights cached in {entry}" in caplog.text
    assert "packed now" in again[2] and _same(first[0], again[0]) and first[1] == again[1]
    assert "read as packed before" in _load(path)[2]


def test_a_cache_that_cannot_be_written_only_warns(tmp_path, tokenizer_dir, cache, caplog):
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    (cache / "packed").write_text("a file where the folder goes")
    with caplog.at_level("WARNING", logger="mii"):
        loaded = _load(path)
    assert "could not cache the packed weights" in caplog.text
    assert "packed as they load, at every start" in loaded[2]
    os.remove(cache / "packed")


def test_the_start_does_not_wait_for_the_write(tmp_path, tokenizer_dir, cache, monkeypatch):
    """The copy is written on a thread of its own: the engine is built and answers while the write is held back; the
    copy appears, and is read by the next start, once the write is let go."""
    import threading

    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    held, write = threading.Event(), packed_cache._write_aligned
    monkeypatch.setattr(packed_cache, "_write_aligned", lambda *a: (held.wait(60), write(*a)))
    pipe = mii.pipeline(str(path), quantization="int4")
    assert re.search(r"packed now, saving to .+\)", pipe.engine_plan.reasons["start-up"])
    assert pipe(PROMPTS[:1], max_new_tokens=4, do_sample=False)[0].token_ids
    assert not [e for e in (cache / "packed").iterdir() if not e.name.startswith(".writing-")]
    pipe.destroy()
    held.set()
    packed_cache.wait_for_writes()
    (entry,) = (cache / "packed").iterdir()
    assert f"read as packed before from {entry})" in _load(path)[2]


def test_a_disk_nearly_full_is_left_alone(tmp_path, tokenizer_dir, cache, caplog, monkeypatch):
    """A copy that would leave the cache's disk with less than MIN_FREE_BYTES (or a twentieth of it) free is not
    written: the start goes on, packing at every start, and says why."""
    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    full = packed_cache.shutil.disk_usage(cache)._replace(free=packed_cache.MIN_FREE_BYTES + 1000)
    monkeypatch.setattr(packed_cache.shutil, "disk_usage", lambda _: full)
    with caplog.at_level("WARNING", logger="mii"):
        loaded = _load(path)
    assert re.search(r"not caching the packed weights \(0\.\d GB\) in .*: the disk has 2\.1 GB free", caplog.text)
    assert "packed as they load, at every start" in loaded[2]
    assert not list((cache / "packed").iterdir())


def test_a_read_marks_its_copy_used_and_unused_copies_go(tmp_path, tokenizer_dir, cache):
    """A read touches its copy's record (its last use). Copies nobody read for 30 days go, whatever their source,
    and so do writes that died a day ago; on a read, this checkpoint's copies from other files or code stay (another
    mii version may be reading its own)."""
    import time

    path = tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path / "model", tokenizer_dir)
    _load(path)
    (entry,) = (cache / "packed").iterdir()
    now = time.time()

    def fake(name, age_days, dot=False):
        folder = cache / "packed" / name
        folder.mkdir()
        if not dot:
            (folder / "record.json").write_text(json.dumps({"source": str(path.resolve()), "identity": "other",
                                                            "code": "other"}))
            os.utime(folder / "record.json", (now - age_days * 86400,) * 2)
        os.utime(folder, (now - age_days * 86400,) * 2)
        return folder

    unused, other_version = fake("model-unused", 31), fake("model-other", 29)
    dead, writing = fake(".writing-dead", 2, dot=True), fake(".writing-now", 0, dot=True)
    os.utime(entry / "record.json", (now - 10 * 86400,) * 2)
    assert "read as packed before" in _load(path)[2]
    assert time.time() - (entry / "record.json").stat().st_mtime < 3600
    assert not unused.exists() and not dead.exists()
    assert other_version.exists() and writing.exists() and entry.exists()
