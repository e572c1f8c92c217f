"""Every Triton kernel of ours compiled to an H100/H200's machine code (sm90) without a GPU: Triton's compiler and
the `ptxas` its wheel ships run on any machine. The interpreter (test_paged_attention_cuda.py, test_fused_cuda.py)
checks what the kernels compute; this checks that they compile, in each dtype and with the constants their wrappers
launch them with, which otherwise only a GPU session (15 minutes, now and then) would find out. In a process of its
own: the tests' process imports Triton in interpreter mode (tests/conftest.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the `gpu` extra)")

ROOT = Path(__file__).resolve().parents[2]
# pointer parameters whose element type is not the model's dtype; float parameters (the others are ints)
POINTERS = {"pos_ptr": "i64", "slot_ptr": "i64", "cos_ptr": "fp32", "sin_ptr": "fp32", "block_tables_ptr": "i32",
            "seq_lens_ptr": "i32", "query_start_ptr": "i32"}
FLOATS = {"eps", "offset", "scale_log2"}


def launches():
    """(kernel, dtype, constants, options) for each way the wrappers launch our kernels."""
    from mii.kernels import fused_cuda as fc
    from mii.kernels import paged_attention_cuda as pa

    for dtype in ("bf16", "fp16", "fp32"):
        for res, offset, block in ((True, False, 2048), (False, True, 64)):
            yield (fc._rms_norm_kernel, dtype, dict(HAS_RES=res, HAS_OFFSET=offset, BLOCK=block),
                   dict(num_warps=fc._warps(block)))
        yield fc._rotary_kernel, dtype, dict(BLOCK_H=32, BLOCK_HALF=64), dict(num_warps=4, enable_fp_fusion=False)
        yield fc._silu_and_mul_kernel, dtype, dict(BLOCK=1024), dict(num_warps=fc._warps(1024))
        yield pa._write_kv_kernel, dtype, dict(ROW=512, BLOCK=512, HEAD_DIM=64, BLOCK_SIZE=16), {}
        for decode in (True, False):
            cfg = pa.tile_config(4, decode, 64)
            options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
            yield (pa._paged_attention_kernel, dtype, dict(WINDOW=0, BLOCK_SIZE=16, GROUP=4, HEAD_DIM=64, BLOCK_D=64,
                                                           IEEE=dtype == "fp32", UPCAST=False, **cfg), options)


def compile_all(arch: int = 90) -> list[str]:
    """Compile every launch for sm`arch`; returns a line per compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    done = []
    for kernel, dtype, constants, options in launches():
        signature = {}
        for p in kernel.params:
            if p.is_constexpr:
                assert p.name in constants, f"{kernel.fn.__name__}: no value for {p.name}"
                signature[p.name] = "constexpr"
            elif p.name.endswith("_ptr"):
                signature[p.name] = "*" + POINTERS.get(p.name, dtype)
            else:
                signature[p.name] = "fp32" if p.name in FLOATS else "i32"
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        done.append(f"{kernel.fn.__name__} {dtype} {constants}: {len(compiled.asm['cubin'])} bytes")
    return done


def test_every_triton_kernel_compiles_for_sm90():
    import inspect

    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip("this Triton's compiler API is older than the one compile_all() calls (ASTSource without constexprs)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (Triton 3.9 warns that its default will change; the kernels set theirs)
    code = "from tests.kernels.test_triton_compiles import compile_all; print('\\n'.join(compile_all()))"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == len(list(launches())) == 21 and all(int(x.rsplit(": ", 1)[1].split()[0]) > 0 for x in lines), lines
