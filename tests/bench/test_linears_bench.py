"""bench/linears.py on the embedded model (its int4 and int8 weights as mii packs them): it finds every linear the
decoder stack runs, times each row count, and what it reports is consistent with what it timed. Functional only: no
speed is asserted."""
import json

import gguf
import torch

import mii
from bench.linears import in_width, main
from mii.layers import quant
from mii.layers.linear import tile_bf16_kpairs, tile_bf16w


def _model_shape() -> dict:
    """The embedded model's shape, as its GGUF file says (read by the gguf package, not by mii)."""
    fields = gguf.GGUFReader(mii.default_model()).fields
    return {k: int(fields[f"llama.{k}"].contents()) for k in (
        "block_count", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv")}


def test_every_linear_at_each_row_count(tmp_path, capsys):
    out = tmp_path / "linears.json"
    res = main(["--rows", "1,5", "--rounds", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    # every layer's qkv, o, gate/up and down; every input feature of every output row once a row of x
    shape = _model_shape()
    layers, hidden, inter = shape["block_count"], shape["embedding_length"], shape["feed_forward_length"]
    kv = shape["attention.head_count_kv"] * hidden // shape["attention.head_count"]
    assert res["linears"] == 4 * layers
    assert res["macs_per_row"] == layers * (hidden * (hidden + 2 * kv) + hidden * hidden + hidden * 2 * inter
                                            + inter * hidden)
    assert set(res["rows"]) == {1, 5}
    for rows, r in res["rows"].items():
        seconds = r["linears_ms"] / 1e3
        assert seconds > 0 and r["head_ms"] > 0
        assert abs(r["per_row_ms"] - r["linears_ms"] / rows) < 2e-3
        assert abs(r["weights_gb_s"] - res["weight_bytes"] / seconds / 1e9) <= 0.05 + 1e-3 * r["weights_gb_s"]
        assert abs(r["gflop_s"] - 2 * res["macs_per_row"] * rows / seconds / 1e9) <= 0.05 + 1e-3 * r["gflop_s"]
    assert f"{4 * layers} linears" in printed and "copy" in printed and len(printed.strip().splitlines()) >= 4


def test_input_width_of_each_layout():
    assert in_width(quant.quantize_int4(torch.randn(64, 96), 32)) == 96
    plain = torch.randn(32, 48).bfloat16()
    assert in_width(plain) == 48
    assert in_width(tile_bf16w(plain)) == 48 and in_width(tile_bf16_kpairs(plain)) == 48
    assert in_width(quant.quantize_int8(torch.randn(32, 64), None)) == 64
    assert in_width(torch.empty(0)) == 0
