"""bench/plots.py on fixed results in the shapes bench/throughput.py and bench/serve.py save (`--json`): the
pictures are PNG files, and what they draw is those numbers (bar lengths, line points, labels)."""
import json
import math
import subprocess
import sys

from matplotlib.colors import to_hex

from bench.plots import FLOOR_COLOR, load_labelled, plot_serving, plot_throughput

PNG = b"\x89PNG\r\n\x1a\n"

THROUGHPUT = {
    "workload": {"requests": 64, "prompt_tokens": 17709, "output_tokens": 9388}, "threads": 2,
    "plan": {"dtype": "float32", "weights": "bfloat16", "attention": "kernel", "linears": "kernel"},
    "floors": {"w64_s": 50.5, "decode_tok_s": 125.0},
    "systems": {"mii": {"w64": 104.4, "ttft": 0.304, "decode": 33.9, "pp512": 418.0},
                "mii, torch backends": {"w64": 181.3, "ttft": 0.349, "decode": 14.9, "pp512": 425.0},
                "transformers": {"w64": 287.6}},
    "startup_s": {"cold": 52.6, "warm": 5.6}}


def _row(rate, ttft, tpot):
    return {"rate": rate, "ttft_ms": {"p50": ttft[0], "p99": ttft[1]}, "tpot_ms": {"p50": tpot[0], "p99": tpot[1]}}


MII = {"requests_per_rate": 16, "effective_throughput": {"share": 0.99, "rate": 1.0, "request_throughput": 0.9},
       "rates": [_row(0.5, (300, 900), (40, 60)), _row(1.0, (450, 1500), (55, 90)),
                 _row(float("inf"), (5000, 9000), (120, 200))]}
PEER = {"requests_per_rate": 16, "effective_throughput": {"share": 0.99, "rate": None, "request_throughput": None},
        "rates": [_row(0.5, (200, 700), (30, 50)), _row(1.0, (None, None), (None, None)),
                  _row(float("inf"), (7000, 12000), (150, 260))]}


def _bars(ax) -> list:
    """(label, length, color) of each bar, top to bottom."""
    names = {round(y): t.get_text() for y, t in zip(ax.get_yticks(), ax.get_yticklabels())}
    bars = sorted(ax.patches, key=lambda p: -(p.get_y() + p.get_height() / 2))
    return [(names[round(p.get_y() + p.get_height() / 2)], float(p.get_width()), to_hex(p.get_facecolor()))
            for p in bars]


def test_throughput_bars_are_the_results(tmp_path):
    fig = plot_throughput(THROUGHPUT, tmp_path / "w64.png")
    assert (tmp_path / "w64.png").read_bytes()[:8] == PNG
    w64, decode = fig.axes
    bars = _bars(w64)
    assert [(name, length) for name, length, _ in bars] == [
        ("compute floor", 50.5), ("mii", 104.4), ("mii, torch backends", 181.3), ("transformers", 287.6)]
    assert bars[0][2] == FLOOR_COLOR and len({color for _, _, color in bars}) == 4
    notes = [t.get_text() for t in w64.texts]
    assert " 104.4 s (2.1x floor)" in notes and " 287.6 s (5.7x floor)" in notes
    # decode: the systems that measured it (not transformers), against the bandwidth floor, in the same colors
    assert [(name, length) for name, length, _ in _bars(decode)] == [
        ("bandwidth floor", 125.0), ("mii", 33.9), ("mii, torch backends", 14.9)]
    assert [color for _, _, color in _bars(decode)] == [color for _, _, color in bars[:3]]
    assert "2 threads, float32 compute, bfloat16 weights" in fig._suptitle.get_text()


def test_serving_lines_per_system_and_percentile(tmp_path):
    fig = plot_serving({"mii": MII, "peer": PEER}, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == PNG
    ttft, tpot = fig.axes
    lines = {line.get_label(): line for line in ttft.get_lines()}
    assert list(lines) == ["mii (effective 1 req/s) p50", "mii (effective 1 req/s) p99", "peer p50", "peer p99"]
    # all at once (rate inf) is drawn one step past the highest finite rate, on a log2 axis
    assert list(lines["mii (effective 1 req/s) p50"].get_xdata()) == [0.5, 1.0, 2.0]
    assert list(lines["mii (effective 1 req/s) p99"].get_ydata()) == [900, 1500, 9000]
    assert list(lines["peer p50"].get_xdata()) == [0.5, 2.0]  # the rate without answers is left out
    assert lines["peer p99"].get_linestyle() == "--" and lines["peer p50"].get_linestyle() == "-"
    mii_color = lines["mii (effective 1 req/s) p50"].get_color()
    assert lines["peer p50"].get_color() == lines["peer p99"].get_color() != mii_color
    assert [list(line.get_ydata()) for line in tpot.get_lines()] == [[40, 55, 120], [60, 90, 200], [30, 150], [50, 260]]
    assert [t.get_text() for t in ttft.get_xticklabels()] == ["0.5", "1", "all at once"]
    assert ttft.get_xscale() == "log" and ttft.get_yscale() == "log"


def test_command_line_draws_saved_reports(tmp_path):
    (tmp_path / "mii.json").write_text(json.dumps(MII))  # inf is written as Infinity, as bench/serve.py does
    (tmp_path / "peer.json").write_text(json.dumps(PEER))
    (tmp_path / "w64.json").write_text(json.dumps(THROUGHPUT))
    assert math.isinf(load_labelled([str(tmp_path / "mii.json")])["mii"]["rates"][-1]["rate"])
    for args in (["serve", f"mii={tmp_path / 'mii.json'}", f"llama-server={tmp_path / 'peer.json'}"],
                 ["throughput", str(tmp_path / "w64.json")]):
        out = tmp_path / f"{args[0]}.png"
        subprocess.run([sys.executable, "-m", "bench.plots", *args, "-o", str(out)], check=True, timeout=120,
                       capture_output=True)
        assert out.read_bytes()[:8] == PNG
