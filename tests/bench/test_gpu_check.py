"""bench/gpu_check.py's step profile (run only on a GPU): what it makes of the profiler's activities per decode step.
The GPU part itself cannot run here; its arithmetic can."""
from bench.gpu_check import kernel_table


def test_kernel_table_per_step_and_most_first():
    steps = 4
    # per step: 16 layers' gemv (5 us each), 16 attention kernels (9 us), one LM head (40 us) and one copy (2 us)
    acts = []
    for _ in range(steps):
        acts += [("gemv_bf16", 5.0)] * 16 + [("paged_attention_decode", 9.0)] * 16
        acts += [("lm_head_gemm", 40.0), ("Memcpy HtoD (Pinned -> Device)", 2.0)]
    t = kernel_table(acts, steps, step_us=500.0, top=3)
    assert t["steps"] == steps and t["wall_us_per_step"] == 500.0
    assert t["kernels_per_step"] == 34
    busy = 16 * 5 + 16 * 9 + 40 + 2
    assert t["kernel_us_per_step"] == busy and t["gpu_busy"] == round(busy / 500, 3)
    assert [k["kernel"] for k in t["top"]] == ["paged_attention_decode", "gemv_bf16", "lm_head_gemm"]
    assert t["top"][0] == {"kernel": "paged_attention_decode", "per_step": 16, "us_per_step": 144.0}
    assert t["top"][2]["per_step"] == 1 and t["top"][2]["us_per_step"] == 40.0


def test_kernel_table_cuts_long_names():
    t = kernel_table([("k" * 300, 1.0)], 1, step_us=10.0)
    assert len(t["top"][0]["kernel"]) == 120 and t["gpu_busy"] == 0.1
