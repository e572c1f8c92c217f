"""A random-weight Llama GGUF of a chosen size, with the embedded SmolLM2's tokenizer and chat template: a model
bigger than the embedded one for the benchmarks (`bench/throughput.py --model`), made here without a model hub.
The linears in Q4_1 and the embedding (tied to the LM head) in Q8_0, as in the embedded model's file, or every
matrix in BF16; mii and llama.cpp read the same file. Its text is noise: only its speed means anything.

    .venv/bin/python -m bench.random_gguf 1b Q4_1 /tmp/llama-1b.Q4_1.gguf
"""
from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf.quants import quantize

import mii

# Llama-3.2's 1B and 3B and SmolLM2's 360M layer shapes, all with SmolLM2's vocabulary (49152)
SHAPES = {
    "360m": dict(hidden=960, intermediate=2560, layers=32, heads=15, kv_heads=5),
    "1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8),
    "3b": dict(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8),
}
TYPES = {"Q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q4_1),
         "BF16": (gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16)}


def write(path: str, shape: dict, ftype: str, seed: int = 0) -> None:
    """`path`: a Llama GGUF of `shape` (SHAPES' keys) with normal weights (std 0.02; the MLP's down projection
    scaled down by the depth), unit norms, and the embedded model's tokenizer, in `ftype` (TYPES' keys)."""
    linear_type, embed_type, file_type = TYPES[ftype]
    hidden, layers, heads, kv = shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"]
    head_dim = hidden // heads
    src = gguf.GGUFReader(mii.default_model())
    out = gguf.GGUFWriter(path, "llama")
    for key, field in src.fields.items():  # the tokenizer, its chat template, the general.* names
        if key.startswith(("GGUF.", "llama.")) or key in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        out.add_key_value(key, field.contents(), kind, field.types[1] if kind == gguf.GGUFValueType.ARRAY else None)
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    out.add_block_count(layers)
    out.add_context_length(8192)
    out.add_embedding_length(hidden)
    out.add_feed_forward_length(shape["intermediate"])
    out.add_head_count(heads)
    out.add_head_count_kv(kv)
    out.add_rope_freq_base(500000.0)
    out.add_layer_norm_rms_eps(1e-5)
    out.add_vocab_size(vocab)
    out.add_rope_dimension_count(head_dim)
    out.add_file_type(file_type)
    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int, kind, std: float = 0.02) -> None:
        out.add_tensor(name, quantize(rng.standard_normal((rows, cols), dtype=np.float32) * std, kind), raw_dtype=kind)

    matrix("token_embd.weight", vocab, hidden, embed_type)
    out.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        out.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        out.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(b + "attn_q.weight", heads * head_dim, hidden, linear_type)
        matrix(b + "attn_k.weight", kv * head_dim, hidden, linear_type)
        matrix(b + "attn_v.weight", kv * head_dim, hidden, linear_type)
        matrix(b + "attn_output.weight", hidden, heads * head_dim, linear_type)
        matrix(b + "ffn_gate.weight", shape["intermediate"], hidden, linear_type)
        matrix(b + "ffn_up.weight", shape["intermediate"], hidden, linear_type)
        matrix(b + "ffn_down.weight", hidden, shape["intermediate"], linear_type, std=0.02 / np.sqrt(2 * layers))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("size", choices=sorted(SHAPES))
    ap.add_argument("type", choices=sorted(TYPES))
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write(args.path, SHAPES[args.size], args.type, args.seed)
    print(args.path)


if __name__ == "__main__":
    main()
