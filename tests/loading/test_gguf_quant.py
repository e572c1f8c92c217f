"""A GGUF file's quantized blocks kept as int8/int4 (`quantization="auto"`): the packed weights hold exactly the
values the `gguf` package dequantizes (Q8_0, Q4_0, Q4_1), nearly for Q4_K, through fused q/k/v and gate/up and
tensor-parallel shards; formats without a map are re-quantized (auto) and the plan says so; the model's greedy
tokens match `transformers` on the same file."""
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import mii
from mii.layers.linear import LinearBase
from mii.layers.quant import dequantize, group_size, pack_int4, pack_int8, scheme
from mii.loading import gguf_blocks, load_model, resolve_source
from mii.loading.quantize import QuantSpec
from mii.parallel import set_tp
from tests.quant_reference import load_dequantized
from tests.reference import compare_greedy, hf_greedy, prompts_for

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 2, 256, 49152
EXACT = {  # layer → tensor → format: fused parameters whose parts agree on int4 or int8 (Q4_0 with Q4_1 too)
    0: dict(attn_q=Q.Q4_0, attn_k=Q.Q4_0, attn_v=Q.Q4_0, attn_output=Q.Q8_0, ffn_gate=Q.Q4_1, ffn_up=Q.Q4_1,
            ffn_down=Q.Q8_0),
    1: dict(attn_q=Q.Q4_1, attn_k=Q.Q4_0, attn_v=Q.Q4_1, attn_output=Q.Q4_1, ffn_gate=Q.Q8_0, ffn_up=Q.Q8_0,
            ffn_down=Q.Q4_0),
}
# formats without an exact map: Q5_0 (5 bits) inside a fused qkv, Q4_K (random blocks: the gguf package cannot
# quantize to it), F16
FORMATS = {**EXACT, 2: dict(EXACT[0], attn_v=Q.Q5_0, ffn_gate=Q.Q4_K, ffn_up=Q.Q4_K),
           3: dict(EXACT[1], attn_output=Q.F16)}
QKV2, GATE_UP2 = "model.layers.2.self_attn.qkv_proj", "model.layers.2.mlp.gate_up_proj"
O3 = "model.layers.3.self_attn.o_proj"


def _q4k_blocks(rows: int, k: int, rng) -> np.ndarray:
    """Random valid Q4_K rows: small positive fp16 d and dmin, random 6-bit scales and 4-bit values."""
    b = rng.integers(0, 256, (rows * k // 256, 144), dtype=np.uint8)
    for lo in (0, 2):
        b[:, lo:lo + 2] = rng.uniform(1e-5, 1e-4, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def write_gguf(path: Path, formats: dict, seed: int = 0) -> Path:
    """A Llama with the embedded SmolLM2's tokenizer, its matrices in `formats`, tied embeddings (Q8_0)."""
    src = gguf.GGUFReader(str(mii.default_model()))
    w = gguf.GGUFWriter(str(path), "llama")
    for key, f in src.fields.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    w.add_block_count(len(formats))
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(512)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    rng = np.random.default_rng(seed)

    def matrix(name, n, k, qtype):
        if qtype == Q.Q4_K:
            w.add_tensor(name, _q4k_blocks(n, k, rng), raw_dtype=qtype)
            return
        x = (rng.standard_normal((n, k)) * 0.08).astype(np.float32)
        x[:, : k // 4] *= 3  # groups of different ranges
        if qtype == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", VOCAB, HIDDEN, Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    head_dim = HIDDEN // HEADS
    shapes = dict(attn_q=(HIDDEN, HIDDEN), attn_k=(KV_HEADS * head_dim, HIDDEN), attn_v=(KV_HEADS * head_dim, HIDDEN),
                  attn_output=(HIDDEN, HIDDEN), ffn_gate=(INTER, HIDDEN), ffn_up=(INTER, HIDDEN),
                  ffn_down=(HIDDEN, INTER))
    for layer, fmts in formats.items():
        w.add_tensor(f"blk.{layer}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(f"blk.{layer}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for base, (n, k) in shapes.items():
            matrix(f"blk.{layer}.{base}.weight", n, k, fmts[base])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", FORMATS)


@pytest.fixture(scope="module")
def reference(path):
    """The `gguf` package's own reading of the mixed file (the embedded model's tokenizer fields, six formats)."""
    return gguf.GGUFReader(str(path))


def assert_reads_as_the_gguf_package(got, want):
    assert list(got.fields) == [k for k in want.fields if not k.startswith("GGUF.")]  # (its header, as fields)
    for key, value in got.fields.items():
        assert value == want.fields[key].contents(), key
    assert [(t.name, t.tensor_type, tuple(t.shape)) for t in got.tensors] == \
           [(t.name, t.tensor_type, tuple(int(d) for d in t.shape)) for t in want.tensors]
    for a, b in zip(got.tensors, want.tensors):
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_read_gguf_reads_as_the_gguf_package(path, reference):
    """mii's own GGUF reader (a fraction of the package's time: the tokenizer's ~100,000 strings) gives the same
    fields and the same tensors, values or blocks, as views of the file."""
    from mii.loading import gguf_file

    got = gguf_file.read_gguf(path)
    assert len(got.fields["tokenizer.ggml.tokens"]) == VOCAB
    assert_reads_as_the_gguf_package(got, reference)


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_read_gguf_in_either_byte_order(tmp_path, endian):
    from mii.loading import gguf_file

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama", endianess=gguf.GGUFEndian[endian])
    w.add_block_count(3)
    w.add_rope_freq_base(5e5)
    w.add_token_list(["a", "bé", "<s>"])
    w.add_token_scores([0.5, -1.0, 2.0])
    w.add_token_types([1, 1, 3])
    w.add_add_bos_token(True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.add_tensor("q8", gguf.quants.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("bf16", gguf.quants.quantize(x, Q.BF16), raw_dtype=Q.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = gguf_file.read_gguf(tmp_path / "t.gguf")
    assert_reads_as_the_gguf_package(got, gguf.GGUFReader(str(tmp_path / "t.gguf")))
    assert got.fields["tokenizer.ggml.tokens"] == ["a", "bé", "<s>"] and got.fields["llama.block_count"] == 3
    assert np.array_equal(got.tensors[0].data, x) and np.array_equal(got.tensors[1].data, x.astype(np.float16))


def test_read_gguf_refuses_what_is_not_gguf(tmp_path):
    from mii.loading import gguf_file

    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_file.read_gguf(tmp_path / "x.gguf")


@pytest.fixture(autouse=True)
def _one_rank():
    yield
    set_tp(0, 1)


def linears(model) -> dict:
    return {name: m.weight for name, m in model.named_modules() if isinstance(m, LinearBase)}


def load(path, spec, rank=0, size=1):
    set_tp(rank, size)
    try:
        return load_model(resolve_source(str(path)), torch.float32, torch.device("cpu"), quantization=spec)
    finally:
        set_tp(0, 1)


AUTO = QuantSpec(None, 32, keep_file=True)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_round_trip_against_gguf(fmt):
    """A matrix's blocks, packed in mii's layout, dequantize to what `gguf.quants.dequantize` gives: bit for bit."""
    rng = np.random.default_rng(len(fmt))
    x = (rng.standard_normal((6, 320)) * 0.1).astype(np.float32)
    x[2] = 0  # an all-zero row: scale 0
    data = gguf.quants.quantize(x, Q[fmt])
    raw = gguf_blocks.from_gguf(data, fmt)
    packed = pack_int8(raw.q, raw.scale.float()) if raw.offset is None else pack_int4(raw.q, raw.scale.float(),
                                                                                       raw.offset.float())
    assert scheme(packed) == ("int8" if fmt == "Q8_0" else "int4")
    assert torch.equal(dequantize(packed), torch.from_numpy(gguf.quants.dequantize(data, Q[fmt])))
    for scale in (0.1, 300.0):  # the floats a load dequantizes from the blocks (the converted folder keeps none)
        data = gguf.quants.quantize(x * scale, Q[fmt])
        got = gguf_blocks.dequantize(gguf_blocks.from_gguf(data, fmt))
        assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(gguf.quants.dequantize(data, Q[fmt])))


def test_the_converted_folder_keeps_exact_matrices_only_as_blocks(path, reference):
    """The conversion writes no float copy of a Q8_0/Q4_0/Q4_1 matrix (Q4_K's, Q5_0's and F16's it does); what a
    float load reads for them, dequantized from the blocks, is the gguf package's dequantization of the file
    (rows of q and k un-permuted as transformers does), bit for bit."""
    from safetensors import safe_open

    from mii.loading import gguf_file

    folder = gguf_file.cached_folder(path, "mixed")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        floats = set(f.keys())
    config = gguf_file.gguf_config(gguf_file.read_gguf(path))
    table = gguf_blocks.BlockTable(folder)
    exact = set(table.float_names())
    assert "model.embed_tokens.weight" in exact and "model.layers.2.mlp.gate_proj.weight" not in exact
    assert not exact & floats and "model.layers.2.mlp.gate_proj.weight" in floats
    assert len(exact) == 1 + sum(f in (Q.Q8_0, Q.Q4_0, Q.Q4_1) for fmts in FORMATS.values() for f in fmts.values())
    tensors = {t.name: t for t in reference.tensors}
    gguf_name = {v: k for k, v in gguf_file._GGUF_NAMES.items()}
    for name in exact:
        stem = name.removesuffix(".weight")
        if stem.startswith("model.layers."):
            layer, _, part = stem.removeprefix("model.layers.").partition(".")
            t = tensors[f"blk.{layer}.{gguf_name[part]}.weight"]
        else:
            t = tensors[f"{gguf_name[stem]}.weight"]
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            want = gguf_file._unpermute(want, heads)
        assert torch.equal(gguf_blocks.dequantize(table.get(name)), torch.from_numpy(np.ascontiguousarray(want))), name


def test_floats_from_blocks_only_where_a_parameter_takes_them(path, monkeypatch):
    """Under auto, the parameters packed from the file's blocks never dequantize them: only the Q4_0 q and k of
    layer 2's qkv, fused with a Q5_0 v and so re-quantized from floats, do. Without quantization every exact
    matrix is dequantized once."""
    calls = []
    real = gguf_blocks.Deferred.tensor
    monkeypatch.setattr(gguf_blocks.Deferred, "tensor", lambda self: calls.append(self.name) or real(self))
    load(path, AUTO)
    assert sorted(calls) == ["model.layers.2.self_attn.k_proj.weight", "model.layers.2.self_attn.q_proj.weight"]
    calls.clear()
    load(path, None)
    from mii.loading import gguf_file

    assert sorted(calls) == sorted(gguf_blocks.BlockTable(gguf_file.cached_folder(path, "mixed")).float_names())


@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_blocks_kept_as_the_file_holds_them(path, rank, size):
    """Every linear of the exact formats (fused q/k/v and gate/up, each rank's shard) packed from the file's own
    blocks holds exactly the weights the same load without quantization (the gguf package's dequantization) puts
    there; Q4_K's nearly (scales rounded to fp16)."""
    ref = linears(load(path, None, rank, size).model)
    got = load(path, AUTO, rank, size)
    report, w = got.quantization, linears(got.model)
    assert sum(report.kept_raw.values()) == 4 * 4 - 2, report.summary()
    assert report.unquantized == {O3 + ".weight": "F16 in the file"}, report.summary()
    assert "Q4_K (scales rounded to fp16)" in report.kept_raw, report.summary()
    for name in w:
        if name not in (QKV2, GATE_UP2, O3):
            assert scheme(w[name]) is not None and torch.equal(dequantize(w[name]), ref[name]), name
    err = (dequantize(w[GATE_UP2]) - ref[GATE_UP2]).abs()
    assert 0 < err.max() <= 2 ** -10 * ref[GATE_UP2].abs().max()
    assert got.weight_bytes["int4 g32"] > 0 and got.weight_bytes["int8 g32"] > 0


def test_formats_without_a_map(path):
    """A fused qkv with a Q5_0 part: re-quantized to int8 g32 from the file's values (auto); an F16 matrix stays
    float; the report names each."""
    ref = linears(load(path, None).model)
    got = load(path, AUTO)
    report, w = got.quantization, linears(got.model)
    why = report.requantized[QKV2 + ".weight"]
    assert "re-quantized to int8 g32 from the file's Q4_0/Q5_0" in why, report.summary()
    assert scheme(w[QKV2]) == "int8" and scheme(w[O3]) is None and torch.equal(w[O3], ref[O3])
    # int8 g32 from the file's values: within half a step of 1/127 of each group's largest magnitude
    r = ref[QKV2].view(ref[QKV2].shape[0], -1, 32)
    step = r.abs().amax(-1, keepdim=True) / 127
    assert ((dequantize(w[QKV2]).view_as(r) - r).abs() <= step * 0.5 + 1e-6).all()


def test_pipeline_matches_transformers_on_its_weights(path):
    """The quantized engine (auto: the file's blocks, Q4_K nearly, Q5_0 re-quantized; the tied LM head's Q8_0),
    alone and over 2 tensor-parallel ranks (each packing its own shard), against transformers' own reading of
    the same GGUF holding the weights mii's packed linears dequantize to."""
    from transformers import AutoModelForCausalLM

    pipe = mii.pipeline(str(path), dtype="float32")
    prompts = prompts_for(VOCAB, lengths=(5, 40))
    try:
        assert "LM head from its Q8_0 blocks" in pipe.engine_plan.quantization
        assert sum(scheme(w) is not None for w in linears(pipe.engine.runner.model).values()) == 4 * 4 - 1
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        assert load_dequantized(hf, pipe.engine.runner.model) == 7 * 4 - 1
        ref = hf_greedy(None, prompts, 12, hf_model=hf)
        # mii::linear_quant rounds decode rows to int16 per 32 columns (~1e-5 of a dot product's magnitude), which
        # this random model's large logits turn into up to ~2e-3 of a log-probability
        compare_greedy(pipe, prompts, ref, 12, atol=1e-2)
    finally:
        pipe.destroy()
    tp2 = mii.pipeline(str(path), dtype="float32", tensor_parallel=2, num_threads=1)
    try:
        assert "LM head from its Q8_0 blocks" in tp2.engine_plan.quantization
        compare_greedy(tp2, prompts, ref, 12, atol=1e-2)
    finally:
        tp2.destroy()


def test_explicit_scheme_keeps_the_blocks_that_map_to_it(path):
    """quantization="int4" on a GGUF: the Q4_0/Q4_1 linears keep the file's blocks (exact, groups of 32), the others
    are quantized to int4 in groups of 64 from the file's values; the tied LM head keeps its Q8_0 blocks (finer
    than int4, and the file's values)."""
    ref = linears(load(path, None).model)
    got = load(path, QuantSpec("int4", 64))
    w = linears(got.model)
    o0, gate_up1 = "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_up_proj"  # Q8_0 in the file
    assert torch.equal(dequantize(w["model.layers.0.mlp.gate_up_proj"]), ref["model.layers.0.mlp.gate_up_proj"])
    for name in (o0, gate_up1):
        assert scheme(w[name]) == "int4" and w[name].shape[2] == 8 + 64
        r = ref[name].view(ref[name].shape[0], -1, 64)
        step = (r.amax(-1, keepdim=True) - r.amin(-1, keepdim=True)) / 15
        assert ((dequantize(w[name]).view_as(r) - r).abs() <= step * 0.51 + 1e-6).all(), name
    assert got.quantization.quantized["int4 g64"] > 0 and got.quantization.kept_raw
    head = got.model.lm_head.weight
    assert got.quantization.lm_head == "Q8_0" and scheme(head) == "int8" and group_size(head) == 32
    assert torch.equal(dequantize(head), load(path, None).model.lm_head.weight)


def test_a_new_conversion_removes_the_ones_that_cannot_be_used(tmp_path, monkeypatch):
    """Converting a GGUF removes its conversions from before it changed, those of files that are gone, and those
    of its file name from earlier formats (no source recorded); other files' conversions stay."""
    import json
    import os

    from mii.loading import gguf_file

    monkeypatch.setenv("MII_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_gguf(tmp_path / "small.gguf", {0: EXACT[0]})
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    root = tmp_path / "cache" / "gguf"

    def folder(name, source=None):
        (root / name).mkdir(parents=True)
        if source is not None:
            (root / name / gguf_file.SOURCE_FILE).write_text(json.dumps({"path": str(source)}))
        return root / name

    legacy, unrelated = folder("small-0123456789abcdef"), folder("unrelated-0123456789abcdef")
    gone, kept = folder("gone-0123456789abcdef", tmp_path / "gone.gguf"), folder("other-0123456789abcdef", other)
    first = gguf_file.cached_folder(gguf_path, "small")
    assert json.loads((first / gguf_file.SOURCE_FILE).read_text()) == {"path": str(gguf_path.resolve())}
    assert not legacy.exists() and not gone.exists() and unrelated.exists() and kept.exists()
    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed
    second = gguf_file.cached_folder(gguf_path, "small")
    assert second != first and not first.exists() and (second / "model.safetensors").is_file()
    assert sorted(p.name for p in root.iterdir()) == sorted([second.name, unrelated.name, kept.name])
