"""The token budget when the config leaves it unset: the knee of this machine's matmul rate (at least 256) on
CPU, MII's 768 on GPU; an explicit value always wins."""
import torch

from mii.config import ModelConfig
from mii.engine import plan as plan_mod
from mii.engine.plan import MIN_CPU_TOKEN_BUDGET, EnginePlan, plan_memory, plan_token_budget


def _plan(device="cpu", dtype="float32"):
    return EnginePlan(device=device, dtype=dtype, num_threads=1)


def test_knee_of_measured_rates(monkeypatch):
    rates = {64: 40e9, 128: 70e9, 256: 80e9, 512: 97e9, 768: 100e9}  # 90% of the peak first at 512
    monkeypatch.setattr(plan_mod, "matmul_rates", lambda k, n, dtype: rates)
    p = _plan()
    assert plan_token_budget(p, 576, 1536) == 512
    assert "saturates at 512 rows" in p.reasons["token budget"] and "768: 100" in p.reasons["token budget"]


def test_at_least_the_floor(monkeypatch):
    monkeypatch.setattr(plan_mod, "matmul_rates", lambda k, n, dtype: {64: 99e9, 128: 100e9, 256: 100e9})
    p = _plan()
    assert plan_token_budget(p, 576, 1536) == MIN_CPU_TOKEN_BUDGET
    assert f"at least {MIN_CPU_TOKEN_BUDGET}" in p.reasons["token budget"]


def test_probe_runs_on_this_machine():
    """The real probe: every candidate measured, a positive rate each, a budget among the candidates."""
    rates = plan_mod.matmul_rates(64, 128, torch.float32, repeat=1)
    assert sorted(rates) == list(plan_mod.TOKEN_BUDGETS) and all(r > 0 for r in rates.values())
    assert plan_token_budget(_plan(), 64, 64) in plan_mod.TOKEN_BUDGETS


def test_gpu_and_explicit_values(monkeypatch):
    monkeypatch.setattr(plan_mod, "matmul_rates", lambda *a: (_ for _ in ()).throw(AssertionError("no probe")))
    assert plan_token_budget(_plan(device="cuda"), 576, 1536) == 768
    cfg = ModelConfig(inference_engine_config={"state_manager": {"max_ragged_batch_size": 100,
                                                                  "memory_config": {"mode": "allocate", "size": 4}}})
    p = plan_memory(_plan(), cfg, 1024, 2048, (576, 1536))
    assert p.max_batch_tokens == 100 and "token budget" not in p.reasons


def test_the_plan_says_where_amx_runs(monkeypatch):
    """The plan's "matrix units" row: present only for bf16 math through the CPU kernels on a CPU with AMX, and
    what MII_QUANT_TILES=bf16 and MII_AMX=0 make of it."""
    monkeypatch.setattr(plan_mod, "cpu_flags", lambda: {"avx512_bf16", "amx_bf16"})
    plan = EnginePlan(device="cpu", dtype="bfloat16", num_threads=1, attention="kernel")
    assert "tdpbf16ps" in plan.amx() and "matrix units" in plan.describe() and "bf16 in the tiles" not in plan.amx()
    monkeypatch.setenv("MII_QUANT_TILES", "bf16")
    assert "rounded to bf16 in the tiles: MII_QUANT_TILES=bf16" in plan.amx()
    monkeypatch.setenv("MII_AMX", "0")
    assert plan.amx().startswith("AMX off")
    for other in (dict(dtype="float32", attention="kernel"), dict(dtype="bfloat16", attention="torch")):
        assert EnginePlan(device="cpu", num_threads=1, **other).amx() == ""
    monkeypatch.setattr(plan_mod, "cpu_flags", lambda: {"avx512_bf16"})
    assert plan.amx() == "" and "matrix units" not in plan.describe()
