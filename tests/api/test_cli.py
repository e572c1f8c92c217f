"""The README's first command: `mii generate` with the embedded default model (auto dtype: bf16 here)."""
import subprocess
import sys
from pathlib import Path

MII = str(Path(sys.executable).parent / "mii")
# The README's question. Asked plainly ("What is the capital of France?"), the embedded model's first token is a near
# tie ("The" against "L", within one bf16 step of the logits; transformers' fp32 margin 0.08), so any change to the
# rounding of attention or the linears, or another CPU's kernels, can decide it either way; asked for a sentence,
# "The" leads by ~1.4 nats.
QUESTION = "What is the capital of France? Answer in one sentence."


def test_generate_default_model_answers_paris():
    out = subprocess.run([MII, "generate", QUESTION, "--max-new-tokens", "24"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout
    assert "dtype" in out.stderr  # the engine plan is logged


def test_generate_bad_model_is_a_clear_error():
    out = subprocess.run([MII, "generate", "/no/such/dir", "hi"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "not found: /no/such/dir" in out.stderr


def test_help_reads_well():
    out = subprocess.run([MII, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "generate" in out.stdout


def test_generate_with_an_int8_kv_cache():
    """`--kv-cache-dtype int8` on the default model: the plan's kv dtype row says int8 and the answer is still
    right; where this CPU's kernel cannot read an int8 cache, a clear refusal (exit 2) instead."""
    from mii.envs import cpu_flags

    out = subprocess.run([MII, "generate", QUESTION, "--max-new-tokens", "24",
                          "--kv-cache-dtype", "int8"], capture_output=True, text=True, timeout=300)
    if {"avx512_vnni", "avx512_bf16"} <= set(cpu_flags()):
        assert out.returncode == 0, out.stderr[-2000:]
        assert "Paris" in out.stdout and "kv dtype             int8" in out.stderr
    else:
        assert out.returncode == 2 and "kv_cache_dtype: int8" in out.stderr


FROZEN = """
import gc, mii
from mii.children import freeze_heap
pipe = mii.pipeline()
ask = lambda: pipe("The capital of France is", max_new_tokens=16, do_sample=False)[0].generated_text
before, answer = len(gc.get_objects()), ask()
freeze_heap()
after = len(gc.get_objects())
print(before, after, gc.get_freeze_count(), ask() == answer)
"""


def test_a_process_that_keeps_its_pipeline_freezes_its_heap():
    """freeze_heap (`mii generate` after its pipeline is built, a replica after its engine, a deployment's front):
    the model's objects, torch's and transformers' leave the collections that walk them all (~220,000 objects,
    124 ms a full collection here), and the pipeline answers as before."""
    out = subprocess.run([sys.executable, "-c", FROZEN], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, frozen, same = out.stdout.split()
    assert int(before) > 100_000 and int(after) < 1_000 and int(frozen) > 100_000 and same == "True", out.stdout
