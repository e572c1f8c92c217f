"""GGUF files: config, tokenizer and dequantized weights read with the `gguf` package, converted once into a
Hugging Face folder (config.json, model.safetensors in float32, tokenizer files) in mii's cache directory, so
later loads take the ordinary folder path and skip the slow parse. The quantized matrices' own blocks are kept
beside them (`gguf_blocks`), for loads that keep the file's quantization; a matrix whose blocks hold its values
exactly (Q8_0, Q4_0, Q4_1) is kept only as blocks, and a load that wants its floats dequantizes them from there
(`gguf_blocks.deferred_floats`: the gguf package's arithmetic, bit for bit). The cache key is the file's path, size
and modification time; converting a file removes the conversions of its earlier versions (and those of earlier
formats of the same file name).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from mii.envs import cache_dir
from mii.errors import ModelLoadError
from mii.loading import gguf_blocks

FORMAT_VERSION = 3  # 2: gguf_blocks/blocks.safetensors; 3: exact blocks without float copies, source.json
SOURCE_FILE = "source.json"  # the GGUF file a folder was converted from

# --- GGUF ------------------------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: "gguf.GGMLQuantizationType"
    shape: tuple  # as stored: columns first
    data: np.ndarray  # a view of the file, as `gguf.GGUFReader` gives it: values, or [rows, bytes a row] of blocks


class GGUF(NamedTuple):
    fields: dict  # key → value (str, int, float, bool, or a list of them)
    tensors: list


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# the tensor types held as values (F32, F16, I8, I16, I32, I64, F64); the others, BF16 too, as their bytes
_VALUE_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def read_gguf(path) -> GGUF:
    """A GGUF file's metadata and its tensors as views of the file, as `gguf.GGUFReader` gives them, read in a few
    hundred milliseconds where the reader takes seconds (it makes a numpy view of every string of the
    tokenizer's vocabulary and merges: ~100,000 for SmolLM2)."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"not a GGUF file (it starts with {bytes(buf[:4])!r})")
        version = struct.unpack_from("<I", buf, 4)[0]
        order = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads byte-swapped
        version = struct.unpack_from(order + "I", buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        pos = 8

        def scalar(code):
            nonlocal pos
            (v,) = struct.unpack_from(order + code, buf, pos)
            pos += struct.calcsize(code)
            return v

        def string():
            nonlocal pos
            n = scalar("Q")
            pos += n
            return buf[pos - n:pos].decode("utf-8", errors="replace")

        def value(kind):
            nonlocal pos
            if kind == _STRING:
                return string()
            if kind != _ARRAY:
                return scalar(_SCALARS[kind])
            item, count = scalar("I"), scalar("Q")
            if item in (_STRING, _ARRAY):
                return [value(item) for _ in range(count)]
            code = f"{order}{count}{_SCALARS[item]}"
            items = list(struct.unpack_from(code, buf, pos))
            pos += struct.calcsize(code)
            return items

        n_tensors, n_fields = scalar("Q"), scalar("Q")
        fields = {}
        for _ in range(n_fields):
            key = string()
            fields[key] = value(scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(scalar("Q") for _ in range(scalar("I")))
            infos.append((name, dims, GGMLQuantizationType(scalar("I")), scalar("Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-pos // align) * align
    data = np.memmap(path, mode="r")
    tensors = []
    for name, dims, kind, offset in infos:
        count, shape = int(np.prod(dims)), tuple(reversed(dims))
        block, size = GGML_QUANT_SIZES[kind]
        dtype = _VALUE_DTYPES.get(int(kind))
        if dtype is None:  # blocks: their bytes, a row of blocks to a row
            dtype, count, shape = np.uint8, count * size // block, quant_shape_to_byte_shape(shape, kind)
        dtype = np.dtype(dtype).newbyteorder(order)
        at = start + offset
        view = data[at:at + count * dtype.itemsize].view(dtype)
        tensors.append(GGUFTensor(name, kind, dims, view.reshape(shape)))
    return GGUF(fields, tensors)


def gguf_config(reader: GGUF) -> dict:
    """A Hugging Face style config.json built from GGUF metadata."""
    meta = reader.fields
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_GGUF_ARCHS)})")
    hf_arch, model_type = _GGUF_ARCHS[arch]
    heads = meta.get(f"{arch}.attention.head_count")
    hidden = meta.get(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens"))
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.get(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.get(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "max_position_embeddings": meta.get(f"{arch}.context_length", 2048),
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs → Hugging Face's rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(reader: GGUF, config: dict) -> Iterator[tuple[str, Optional[torch.Tensor], Optional[gguf_blocks.RawBlocks]]]:
    """(Hugging Face name, dequantized float32 tensor, its blocks in mii's int8/int4 terms where they map); the
    tensor is None where the blocks hold it exactly (`gguf_blocks.EXACT`)."""
    from gguf import quants

    permute = config["model_type"] == "llama"
    for t in reader.tensors:
        stem, _, kind = t.name.rpartition(".")  # e.g. "blk.3.attn_q", "weight"
        parts = stem.split(".")
        if parts[0] == "blk":
            layer, base = parts[1], parts[2]
            if base not in _GGUF_NAMES:
                raise ModelLoadError(f"GGUF tensor {t.name!r} has no known Hugging Face name")
            name = f"model.layers.{layer}.{_GGUF_NAMES[base]}.{kind}"
        elif stem in _GGUF_NAMES:
            name = f"{_GGUF_NAMES[stem]}.{kind}"
        else:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has no known Hugging Face name")
        raw = gguf_blocks.from_gguf(t.data, t.tensor_type.name) if len(t.shape) == 2 else None
        w = None if raw is not None and raw.exact else quants.dequantize(t.data, t.tensor_type)
        if permute and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if parts[2] == "attn_q" else config["num_key_value_heads"]
            w = None if w is None else _unpermute(w, heads)
            if raw is not None:  # the permutation moves whole rows: the blocks' rows move with them
                raw = gguf_blocks.RawBlocks(raw.fmt, *(None if x is None else
                                                       torch.from_numpy(_unpermute(x.numpy(), heads))
                                                       for x in (raw.q, raw.scale, raw.offset)))
        yield name, None if w is None else torch.from_numpy(np.array(w, copy=True)), raw


def folder_for(path: Path) -> Path:
    """Where the folder converted from `path` lives (or will): keyed by the file's path, size and time."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{FORMAT_VERSION}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def is_converted(path: Path) -> bool:
    return (folder_for(path) / "model.safetensors").is_file()


def cached_folder(path: Path, name: str) -> Path:
    """The Hugging Face folder converted from `path`, converting it on first use."""
    folder = folder_for(path)
    if (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        try:
            _convert(path, tmp, name)
        except ModelLoadError:
            raise
        except Exception as e:  # the gguf package's reader fails in many ways on a truncated or damaged file
            raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e} (is the file complete? a "
                                 "truncated or damaged download must be fetched again)") from None
        (tmp / SOURCE_FILE).write_text(json.dumps({"path": str(path.resolve())}))
        try:
            os.rename(tmp, folder)  # atomic: a concurrent conversion of the same file simply loses the race
        except OSError:
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale(path, folder)
    return folder


def _remove_stale(path: Path, kept: Path) -> None:
    """Remove the cached conversions that can no longer be used: those of `path` before it changed (the key holds
    its size and time), those of files that are gone, and, with no source recorded (formats before 3, which this
    version never reads), those of a file of the same name. Each took the model's size again on disk."""
    prefix = f"{path.stem}-"
    source = str(path.resolve())
    for folder in kept.parent.iterdir():
        if folder == kept or not folder.is_dir() or folder.name.startswith("."):
            continue
        try:
            recorded = json.loads((folder / SOURCE_FILE).read_text())["path"]
        except FileNotFoundError:
            recorded = source if folder.name.startswith(prefix) else None
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if recorded == source or (recorded is not None and not Path(recorded).exists()):
            shutil.rmtree(folder, ignore_errors=True)


def _convert(path: Path, out: Path, name: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = read_gguf(path)
    config = gguf_config(reader)
    tensors, blocks, names = {}, {}, []
    for key, w, raw in tqdm(iter_gguf(reader, config), total=len(reader.tensors),
                            desc=f"Converting {name} (GGUF, once)", unit="tensor", leave=False):
        names.append(key)
        if raw is not None:
            blocks[key] = raw
        if w is not None:  # (exact blocks: no float copy, see gguf_blocks.deferred_floats)
            tensors[key] = w
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    formats = dict(zip(names, (t.tensor_type.name for t in reader.tensors)))
    gguf_blocks.save(blocks, formats, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot read the tokenizer of {path}: {type(e).__name__}: {e}") from None
    tok.save_pretrained(str(out))
