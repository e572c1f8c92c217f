"""bench/serve.py against a real `mii serve` of a tiny random model: it starts the server, sends W64 requests at
two rates, reports what it should, and stops the server. Functional only: no speed is asserted."""
import json
import os
import re

import pytest

from bench.serve import SLA, Result, arrivals, effective_throughput, main, parse_args, summarize
from bench.workloads import w64
from tests.bench.test_plots import PEER
from tests.serving.conftest import tiny_model  # noqa: F401  (the session fixture)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sweep_against_spawned_mii(tiny_model, tmp_path, capsys):  # noqa: F811
    out, picture, peer = tmp_path / "report.json", tmp_path / "serve.png", tmp_path / "peer.json"
    peer.write_text(json.dumps(PEER))
    report = main(["--spawn-mii", tiny_model, "--serve-args=--dtype float32 --num-threads 1", "--requests", "3",
                   "--rates", "4,inf", "--json", str(out), "--plot", str(picture), "--plot-with", f"peer={peer}"])
    printed = capsys.readouterr().out
    prompts, outputs = w64(3)

    assert report["model"] == tiny_model and report["prompt_format"] == "ids"
    assert report["sent"] == {"temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                              "ignore_eos": True, "min_tokens": "max_tokens"}
    assert report["probe"]["prefill_tps"] > 0 and report["probe"]["decode_tps"] > 0
    assert report["sla"]["decode_tps"] > 0 and "SLA: first token within" in printed
    assert [r["rate"] for r in report["rates"]] == [4.0, float("inf")]
    for row in report["rates"]:
        assert row["requests"] == 3 and row["errors"] == 0 and row["short"] == 0
        assert row["prompt_tokens"] == row["asked_prompt_tokens"] == sum(map(len, prompts))
        assert row["completion_tokens"] == row["asked_output_tokens"] == sum(outputs)
        assert row["approximate_token_times"] == 0  # --spawn-mii: one chunk per token (--stream-interval-ms 0)
        for key in ("ttft_ms", "tpot_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p99"]
        assert row["request_throughput"] > 0 and 0 <= row["sla_met"] <= 1
    assert set(report["effective_throughput"]) == {"share", "rate", "request_throughput"}
    assert "effective throughput:" in printed
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {picture}" in printed

    per_request = json.loads(out.read_text())["per_request"]
    assert [[r["completion_tokens"] for r in rate] for rate in per_request] == [outputs, outputs]
    assert all(len(r["chunk_times"]) == r["max_tokens"] for rate in per_request for r in rate)

    pid = int(re.search(r"ready in .* \(pid (\d+)\)", printed).group(1))
    assert not alive(pid)  # stopped by the benchmark (and reaped)


def test_text_prompts_and_a_given_sla(tiny_model, tokenizer_dir, capsys):  # noqa: F811
    report = main(["--spawn-mii", tiny_model, "--serve-args=--dtype float32 --num-threads 1", "--requests", "2",
                   "--rates", "inf", "--prompt-format", "text", "--tokenizer", str(tokenizer_dir),
                   "--sla-prefill", "512", "--sla-decode", "4"])
    assert report["probe"] is None and report["sla"]["source"] == "given"
    printed = capsys.readouterr().out
    assert "SLA: first token within 0 ms + prompt tokens / 512 tok/s; generation >= 4.0 tok/s" in printed
    (row,) = report["rates"]
    assert row["errors"] == 0 and row["prompt_tokens"] > 0  # the server's count of the decoded text
    assert row["completion_tokens"] == row["asked_output_tokens"] == sum(w64(2)[1])


def test_sla_rules():
    sla = SLA(overhead_s=0.1, prefill_tps=1000, decode_tps=10, ema_span=4)
    fast = Result(prompt_len=100, max_tokens=4, start=0.0, chunk_times=[0.15, 0.2, 0.25, 0.3], prompt_tokens=100,
                  completion_tokens=4)
    assert sla.met(fast) and sla.miss(fast) is None
    late = Result(100, 4, 0.0, [0.25, 0.3, 0.35, 0.4], completion_tokens=4)
    stall = Result(100, 4, 0.0, [0.15, 0.2, 0.5, 0.55], completion_tokens=4)  # EMA > 0.1 s
    short = Result(100, 5, 0.0, [0.15, 0.2, 0.25, 0.3], completion_tokens=4)
    failed = Result(100, 4, error="HTTP 429: busy")
    for r, why in ((late, "first token"), (stall, "token gap"), (short, "short"), (failed, "error")):
        assert not sla.met(r) and sla.miss(r) == why
    row = summarize(1.0, [fast, late, stall, stall, failed], 1.0, sla)
    assert row["sla_met"] == 0.2 and row["sla_misses"] == {"first token": 1, "token gap": 2, "error": 1}
    two_per_chunk = Result(100, 4, 0.0, [0.15, 0.25], completion_tokens=4)
    assert two_per_chunk.token_gaps() == ([0.0, 0.1, 0.0], False) and two_per_chunk.tpot == (0.25 - 0.15) / 3


def test_arrivals_and_effective_throughput():
    at = arrivals(2000, 4.0, seed=0)
    assert at[0] == 0 and (abs(2000 / at[-1] - 4.0) < 0.4) and (arrivals(5, float("inf"), 0) == 0).all()
    assert (arrivals(50, 1.0, 0) == 2 * arrivals(50, 2.0, 0)).all()  # the same draws, scaled
    rows = [{"rate": 1.0, "sla_met": 1.0, "request_throughput": 0.9}, {"rate": 2.0, "sla_met": 0.99,
            "request_throughput": 1.8}, {"rate": 4.0, "sla_met": 0.5, "request_throughput": 2.1}]
    assert effective_throughput(rows, 0.99)["rate"] == 2.0
    assert effective_throughput(rows[2:], 0.99)["rate"] is None


def test_plot_options_are_checked_before_the_sweep(tmp_path, capsys):
    for argv, message in ((["--plot-with", f"x={tmp_path / 'missing.json'}", "--plot", "p.png"], "no such file"),
                          (["--plot-with", f"x={tmp_path / 'missing.json'}"], "--plot-with goes with --plot")):
        with pytest.raises(SystemExit):
            parse_args(["--base-url", "http://127.0.0.1:1", *argv])
        assert message in capsys.readouterr().err
