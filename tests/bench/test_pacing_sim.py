"""bench/pacing_sim.py: the real scheduler and pacer on a modelled clock. Without noise a 16 ms target keeps every
stream within an 18 ms SLA (no token-gap misses), where filling the budget misses it; the report says so."""
import pytest

from bench.pacing_sim import main, parse_costs, simulate


def test_the_target_holds_the_streams_and_the_report_shows_both(capsys):
    report = main(["--targets", "16", "--rates", "0.5", "--requests", "16", "--draws", "2", "--noise", "0",
                   "--sla-decode", "55"])
    printed = capsys.readouterr().out
    plain, paced = report["rows"]
    assert plain["target_ms"] is None and paced["target_ms"] == 16.0
    assert plain["token_gap"] > 0 and paced["token_gap"] == 0
    assert "no target: 0.5 req/s" in printed and "16 ms: 0.5 req/s" in printed


def test_every_request_gets_its_tokens_in_order():
    costs = parse_costs("1:5,64:50,512:400")
    for target in (None, 16.0):
        results = simulate(1.0, target, costs, requests=8, noise=0.3)
        for r in results:
            assert len(r.chunk_times) == r.max_tokens
            assert r.chunk_times == sorted(r.chunk_times) and r.chunk_times[0] > r.start


def test_bad_costs_are_refused():
    with pytest.raises(Exception, match="at least two"):
        parse_costs("1:5")
