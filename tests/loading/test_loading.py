"""Loading from folders (safetensors, sharded, .bin), the hub cache offline, and clear errors."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

import mii
from mii.envs import cache_dir
from mii.errors import ModelLoadError, UnsupportedModelError
from tests.reference import TINY, assert_matches_transformers, tiny_checkpoint

VOCAB = 49152


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    return tiny_checkpoint(LlamaConfig(vocab_size=VOCAB, **TINY), tmp_path_factory.mktemp("llama"), tokenizer_dir)


def greedy(path, **kw):
    pipe = mii.pipeline(str(path), dtype="float32", **kw)
    try:
        return pipe([[5, 6, 7, 8]], max_new_tokens=8, do_sample=False, ignore_eos=True)[0].token_ids
    finally:
        pipe.destroy()


def test_pytorch_bin_weights(tiny_llama, tmp_path):
    from safetensors.torch import load_file

    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert greedy(tmp_path) == greedy(tiny_llama)


def test_hub_id_from_local_cache_offline(tiny_llama, tmp_path):
    """A hub id resolved by huggingface_hub from a cache laid out as the hub writes it, with HF_HUB_OFFLINE=1."""
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_llama, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    code = ("import mii; p = mii.pipeline('tiny-org/tiny-llama', dtype='float32'); "
            "print(p([[5, 6, 7, 8]], max_new_tokens=8, do_sample=False, ignore_eos=True)[0].token_ids)")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(greedy(tiny_llama))
    env["HF_HUB_CACHE"] = str(tmp_path / "empty")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "tiny-org/tiny-llama" in out.stderr


def test_missing_path():
    with pytest.raises(ModelLoadError, match="not found: /no/such/model"):
        mii.pipeline("/no/such/model")
    with pytest.raises(ModelLoadError, match="not found"):
        mii.pipeline("/no/such/model.gguf")


def test_unknown_architecture(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["FancyNewForCausalLM"], model_type="fancy")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"FancyNewForCausalLM.*supported model_types: .*llama"):
        mii.pipeline(str(tmp_path))


@pytest.mark.parametrize("edit, words", [
    ({"num_hidden_layers": "2"}, r"config.json: num_hidden_layers must be a positive integer \(it is '2'\)"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number ≥ 0"),
    ({"hidden_size": 10 ** 12}, r"cannot build LlamaForCausalLM from .*config.json: RuntimeError: .*allocate"),
])
def test_a_config_that_builds_no_model_is_a_load_error(tiny_llama, tmp_path, edit, words):
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ModelLoadError, match=words):
        mii.pipeline(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="holds a JSON list, not an object"):
        mii.pipeline(str(tmp_path))


@pytest.mark.parametrize("text, words", [("{", "is not a JSON object"), ("[2]", "is not a JSON object"),
                                         ('{"eos_token_id": [2, "x"]}', "eos_token_id must be an integer or a list")])
def test_a_damaged_generation_config_is_a_load_error(tiny_llama, tmp_path, text, words):
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=f"generation_config.json.*{words}"):
        mii.pipeline(str(tmp_path))


def _edit_weights(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))


def test_missing_and_mismatched_tensors(tiny_llama, tmp_path):
    _edit_weights(tiny_llama, tmp_path / "a", lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        mii.pipeline(str(tmp_path / "a"))

    def shrink(s):
        s["model.layers.0.mlp.down_proj.weight"] = s["model.layers.0.mlp.down_proj.weight"][:, :100].contiguous()
    _edit_weights(tiny_llama, tmp_path / "b", shrink)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.mlp\.down_proj\.weight.*\(64, 100\).*\(64, 128\)"):
        mii.pipeline(str(tmp_path / "b"))

    def extra(s):
        s["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2)
    _edit_weights(tiny_llama, tmp_path / "c", extra)
    with pytest.raises(ModelLoadError, match="surprise"):
        mii.pipeline(str(tmp_path / "c"))


def test_gguf_file_loads_and_caches(default_model_path, tmp_path):
    """The embedded GGUF converts once into the cache, and its packed weights are cached as loaded; a second load
    reuses both and gives the same tokens. The engine plan's start-up row says so, with the time of each part."""
    env = {**os.environ, "MII_CACHE_DIR": str(tmp_path / "cache")}
    (tmp_path / "cache").mkdir()
    kernels = cache_dir() / "kernels"  # the CPU kernels this session built: only the GGUF's conversion is new here
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / "kernels").symlink_to(kernels)
    code = (f"import json, mii; p = mii.pipeline({default_model_path!r}, dtype='float32'); "
            "print(json.dumps([p.engine_plan.startup, p.engine_plan.reasons['start-up'], p.engine_plan.describe()])); "
            "print(p('Hello', max_new_tokens=6, do_sample=False)[0].token_ids)")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    converted = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    assert (converted[0] / "tokenizer.json").is_file() or (converted[0] / "tokenizer_config.json").is_file()
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.stdout.splitlines()[-1] == first.stdout.splitlines()[-1]
    assert "Converting" not in second.stderr

    packed = list((tmp_path / "cache" / "packed").iterdir())  # (the int8/int4 weights as loaded, for the next start)
    assert len(packed) == 1 and (packed[0] / "model.safetensors").is_file()
    for run, gguf, weights in ((first, "converted now", f"packed now, saving to {packed[0]}"),
                               (second, "read as converted before", f"read as packed before from {packed[0]}")):
        times, why, text = json.loads(run.stdout.splitlines()[-2])
        parts = ("kernels", "checkpoint", "weights", "tokenizer", "engine")
        assert set(times) == {*parts, "total"} and all(times[k] >= 0 for k in parts)
        assert sum(times[k] for k in parts) <= times["total"] + 1e-3
        assert f"start-up             {times['total']:.1f} s  (" in text
        assert re.match(rf"CPU kernels loaded in \d+\.\d s from {re.escape(str(tmp_path / 'cache' / 'kernels'))}/", why)
        assert f"GGUF {gguf} in {times['checkpoint']:.1f} s ({converted[0]})" in why
        assert f"weights {times['weights']:.1f} s (int8/int4 {weights})" in why
    assert json.loads(first.stdout.splitlines()[-2])[0]["checkpoint"] > json.loads(second.stdout.splitlines()[-2])[0]["checkpoint"]


def _damaged_copy(src, dst, name, damage):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    path = dst / name
    path.write_bytes(damage(path.read_bytes()))
    return dst


@pytest.mark.parametrize("damage, words", [
    (lambda b: b[: len(b) // 2], "incomplete metadata"),          # a download cut in the middle
    (lambda b: b[:5], "header too small"),
    (lambda b: b[:8] + b"{garbage" + b[16:], "invalid JSON in header"),
])
def test_damaged_safetensors_is_a_clear_error(tiny_llama, tmp_path, damage, words):
    folder = _damaged_copy(tiny_llama, tmp_path, "model.safetensors", damage)
    with pytest.raises(ModelLoadError, match=rf"cannot read {folder / 'model.safetensors'}: .*{words}.*fetched again"):
        mii.pipeline(str(folder))


def test_damaged_bin_and_index_are_clear_errors(tiny_llama, tmp_path):
    from safetensors.torch import load_file

    state = load_file(str(tiny_llama / "model.safetensors"))
    folder = tmp_path / "bin"
    shutil.copytree(tiny_llama, folder)
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=rf"cannot read {folder / 'pytorch_model.bin'}"):
        mii.pipeline(str(folder))
    index = tmp_path / "index"
    shutil.copytree(tiny_llama, index)
    (index / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ModelLoadError, match=rf"cannot read {index / 'model.safetensors.index.json'}: JSONDecodeError"):
        mii.pipeline(str(index))


class _Payload:
    """Unpickling this runs code: what a malicious `.bin` does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_bin_weights_never_run_code(tiny_llama, tmp_path):
    from safetensors.torch import load_file

    folder = tmp_path / "evil"
    shutil.copytree(tiny_llama, folder)
    state = dict(load_file(str(folder / "model.safetensors")))
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    state["model.norm.weight"] = _Payload(marker)  # torch.save pickles it; a plain torch.load would run it
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=rf"cannot read {folder / 'pytorch_model.bin'}: UnpicklingError"):
        mii.pipeline(str(folder))
    assert not marker.exists()
    with pytest.raises(mii.errors.ValidationError, match="trust_remote_code=True is not supported: mii never runs"):
        mii.pipeline(str(tiny_llama), trust_remote_code=True)


def test_damaged_gguf_is_a_clear_error(default_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MII_CACHE_DIR", str(tmp_path / "cache"))
    with open(default_model_path, "rb") as f:
        head = f.read(4_000_000)  # metadata and the first tensors' offsets: the data is cut off
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(ModelLoadError, match=rf"cannot read GGUF file {cut}: ValueError.*fetched again"):
        mii.pipeline(str(cut))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 100)
    with pytest.raises(ModelLoadError, match=rf"cannot read GGUF file {garbage}"):
        mii.pipeline(str(garbage))
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == []  # no half-converted folder left


# --- the tokenizer -----------------------------------------------------------------------------------------------

TEXTS = ["Hello world<|im_end|>", "  leading spaces, émojis 🙂 and\ttabs\n", "<|im_start|>user\nHi<|im_end|>", ""]


def test_a_generic_tokenizer_loads_as_autotokenizer_would_and_without_its_imports(tokenizer_dir):
    """A folder whose tokenizer_config.json names transformers' generic class (the GGUF's extracted folder,
    tokenizer_dir) loads through that class alone: the class, ids, text and chat template AutoTokenizer gives,
    in a process that never imports AutoTokenizer's module (it imports every family's configuration)."""
    from transformers import AutoTokenizer

    from mii.loading.loader import load_tokenizer

    assert json.loads((tokenizer_dir / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        "TokenizersBackend", "PreTrainedTokenizerFast")
    ours, ref = load_tokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert type(ours) is type(ref)
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids and ours.decode(ids) == ref.decode(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, len(ours)) == (
        ref.eos_token_id, ref.bos_token_id, ref.pad_token_id, len(ref))
    probe = ("import sys; from mii.loading.loader import load_tokenizer; load_tokenizer(sys.argv[1]); "
             "print('transformers.models.auto.tokenization_auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(tokenizer_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_another_tokenizer_class_goes_through_autotokenizer(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from mii.loading.loader import load_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(ref) and type(ours).__name__ != "TokenizersBackend", type(ours)
    assert ours(TEXTS[1]).input_ids == ref(TEXTS[1]).input_ids


@pytest.mark.parametrize("quantization, packed", [("none", False), ("int8", True)])
def test_the_plan_says_what_the_start_up_took(tiny_llama, caplog, quantization, packed):
    """A safetensors folder: the plan's start-up row has the kernels (loaded from the cache, or already in this
    process), no GGUF part, and says what of the weights was packed (int8/int4, bf16 tiles) and where it was cached;
    the logged plan carries the row."""
    with caplog.at_level("INFO", logger="mii"):
        pipe = mii.pipeline(str(tiny_llama), quantization=quantization)
    plan = pipe.engine_plan
    why = plan.reasons["start-up"]
    assert re.match(r"CPU kernels (already loaded in this process|loaded in \d+\.\d s from .+/kernels/[0-9a-f]{16});",
                    why), why
    assert "GGUF" not in why and f"tokenizer {plan.startup['tokenizer']:.1f} s" in why
    tiles = plan.linear_backend == "kernel"  # (bf16 weights tiled for mii::linear_bf16w: cached too)
    what = " and ".join(["int8/int4"] * packed + ["bf16 tiles"] * tiles)
    assert bool(re.search(rf"weights \d+\.\d s \({what} (packed now, saving to|read as packed before from) "
                          rf"{re.escape(str(cache_dir() / 'packed'))}/", why)) == (packed or tiles)
    assert plan.describe().splitlines()[-1].startswith(f"  start-up             {plan.startup['total']:.1f} s  (")
    assert plan.describe() in caplog.text
    if packed and plan.dtype == "bfloat16" and not plan.amx():  # how the int8/int4 tiles take rows on this CPU
        rows = torch.ops.mii.tile_block_rows()
        assert f"rows in blocks of {rows} (" in plan.reasons["linears"], plan.reasons["linears"]
    pipe.destroy()


@pytest.mark.parametrize("enabled", [True, False])
def test_no_garbage_collection_while_an_engine_builds(tiny_llama, monkeypatch, enabled):
    """What an engine builds stays, so collections while it builds only walk it again and again (~0.3 s of a warm
    start): none runs while `build_engine` loads the model, and the collector is left as it was found."""
    import gc

    from mii.engine import factory

    ran, inside = [], []
    load = factory.load_model

    def watch(phase, info):
        if phase == "start" and inside:
            ran.append(info["generation"])

    def watched_load(*args, **kwargs):
        inside.append(True)
        try:
            return load(*args, **kwargs)
        finally:
            inside.clear()

    monkeypatch.setattr(factory, "load_model", watched_load)
    was, thresholds = gc.isenabled(), gc.get_threshold()
    (gc.enable if enabled else gc.disable)()
    gc.callbacks.append(watch)
    try:
        gc.set_threshold(1, 1, 1)  # (a collection at almost every allocation, were the collector on)
        pipe = mii.pipeline(str(tiny_llama))
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(watch)
        now = gc.isenabled()
        (gc.enable if was else gc.disable)()
    assert ran == [] and now == enabled
    assert pipe("Hello", max_new_tokens=2)[0].generated_length == 2
    pipe.destroy()


def test_a_cache_folder_that_cannot_be_written_gives_way_to_a_private_one(tmp_path, monkeypatch, caplog):
    import tempfile

    from mii.errors import MIIError

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MII_CACHE_DIR", str(tmp_path / "a-file" / "mii"))  # cannot be made: a file is in the way
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with caplog.at_level("WARNING", logger="mii"):
        got = cache_dir()
    assert got == tmp_path / "tmp" / f"mii-cache-{os.getuid()}" and got.is_dir()
    assert (got.stat().st_mode & 0o777) == 0o700
    assert "a-file/mii cannot be used (NotADirectoryError" in caplog.text and str(got) in caplog.text
    got.chmod(0o777)  # a folder others can write is never used: kernels are loaded from it
    with pytest.raises(MIIError, match="writable by others"):
        cache_dir()
    monkeypatch.setenv("MII_CACHE_DIR", str(tmp_path / "fine"))
    assert cache_dir() == tmp_path / "fine" and cache_dir().is_dir()
