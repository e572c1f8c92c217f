"""The benchmarks' pictures (PNG, with matplotlib: the `bench` extra). Each is a function of the results a
benchmark prints and saves with `--json`, so a saved run can be drawn again and runs of several servers drawn
together:

- `plot_throughput`: bench/throughput.py's W64 wall time against the machine's compute floor and the peers
  measured in the same run (bars), and single-stream decode against the weight-bandwidth floor;
- `plot_serving`: bench/serve.py's time to first token and time per output token (p50 solid, p99 dashed)
  against the arrival rate, one line per system.

    .venv/bin/python -m bench.plots throughput w64.json -o docs/w64.png
    .venv/bin/python -m bench.plots serve mii=mii.json llama-server=llama.json -o docs/serve.png
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

FLOOR_COLOR = "#b8bec9"
COLORS = ["#2f6fed", "#e8743b", "#19a979", "#945ecf", "#ed4a7b", "#13a4b4", "#525df4", "#bf399e"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, rows: list[tuple[str, float, str]], unit: str, ratio_to: float, ratio_word: str) -> None:
    """Horizontal bars (label, value, color), top to bottom, each annotated with its value and its ratio to the
    first (the floor)."""
    labels = [r[0] for r in rows]
    values = [r[1] for r in rows]
    y = list(range(len(rows)))[::-1]
    ax.barh(y, values, color=[r[2] for r in rows], height=0.6)
    ax.set_yticks(y, labels)
    for i, (yi, v) in enumerate(zip(y, values)):
        ratio = f" ({v / ratio_to:.2g}x {ratio_word})" if i else ""
        ax.annotate(f" {v:,.1f} {unit}{ratio}", (v, yi), va="center", fontsize=8)
    ax.set_xlim(0, max(values) * 1.45)
    ax.spines[["top", "right"]].set_visible(False)


def plot_throughput(report: dict, path) -> "matplotlib.figure.Figure":
    """W64 wall time of each system of one bench/throughput.py run against its compute floor (left), and
    single-stream decode tokens/s against the weight-bandwidth floor (right). Returns the figure, saved to `path`."""
    plt = _pyplot()
    systems, floors = report["systems"], report["floors"]
    color = {name: COLORS[i % len(COLORS)] for i, name in enumerate(systems)}
    decode = {name: r["decode"] for name, r in systems.items() if r.get("decode")}
    fig, axes = plt.subplots(1, 2 if decode else 1, figsize=(12 if decode else 7, 0.5 * len(systems) + 2.2),
                             squeeze=False)
    w64 = [("compute floor", floors["w64_s"], FLOOR_COLOR)]
    w64 += [(name, r["w64"], color[name]) for name, r in systems.items() if r.get("w64")]
    _bars(axes[0][0], w64, "s", floors["w64_s"], "floor")
    wl = report.get("workload", {})
    axes[0][0].set_title(f"W64 wall time (lower is better)\n{wl.get('requests', '?')} requests, "
                         f"{wl.get('prompt_tokens', '?')} prompt + {wl.get('output_tokens', '?')} output tokens",
                         fontsize=10)
    axes[0][0].set_xlabel("seconds")
    if decode:
        rows = [("bandwidth floor", floors["decode_tok_s"], FLOOR_COLOR)]
        rows += [(name, v, color[name]) for name, v in decode.items()]
        _bars(axes[0][1], rows, "tok/s", floors["decode_tok_s"], "floor")
        axes[0][1].set_title("single-stream decode (higher is better)\n128-token prompt, 256 new tokens",
                             fontsize=10)
        axes[0][1].set_xlabel("tokens / s")
    plan = report.get("plan") or {}
    fig.suptitle(f"bench/throughput.py, one run: {report.get('threads', '?')} threads, {plan.get('dtype', '?')} "
                 f"compute, {plan.get('weights', '?')} weights", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def _rate_positions(rates: list[float]) -> dict[float, float]:
    """Where each rate goes on a log2 axis: as it is, and `inf` (all requests at once) one step past the rest."""
    finite = [r for r in rates if not math.isinf(r)]
    return {r: (2 * max(finite) if finite else 1.0) if math.isinf(r) else r for r in rates}


def plot_serving(reports: dict[str, dict], path) -> "matplotlib.figure.Figure":
    """Time to first token (left) and time per output token (right), p50 solid and p99 dashed, against the
    arrival rate: one color per system (label → a bench/serve.py report). Returns the figure, saved to `path`."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    rates = sorted({row["rate"] for report in reports.values() for row in report["rates"]})
    at = _rate_positions(rates)
    for i, (label, report) in enumerate(reports.items()):
        c = COLORS[i % len(COLORS)]
        eff = (report.get("effective_throughput") or {}).get("rate")
        name = label + (f" (effective {eff:g} req/s)" if eff is not None else "")
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            for q, style in (("p50", "-"), ("p99", "--")):
                pts = [(at[row["rate"]], row[key][q]) for row in report["rates"] if row[key][q] is not None]
                if pts:
                    ax.plot(*zip(*pts), style, color=c, marker="o", markersize=4, label=f"{name} {q}")
    for ax, title in zip(axes, ("time to first token", "time per output token (after the first)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xticks([at[r] for r in rates], ["all at once" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("arrival rate (requests / s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_title(f"{title}: p50 solid, p99 dashed", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].legend(fontsize=8)
    first = next(iter(reports.values()))
    fig.suptitle(f"bench/serve.py: W64 requests, {first.get('requests_per_rate', '?')} per rate", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def load_labelled(specs: list[str]) -> dict[str, dict]:
    """`LABEL=PATH` (or `PATH`, labelled by its file name) → label: the report saved there."""
    out = {}
    for spec in specs:
        label, _, path = spec.rpartition("=")
        out[label or Path(path).stem] = json.loads(Path(path).read_text())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("throughput", help="a bench/throughput.py --json report")
    t.add_argument("report")
    s = sub.add_parser("serve", help="bench/serve.py --json reports, one line per system")
    s.add_argument("reports", nargs="+", metavar="[LABEL=]PATH")
    for p in (t, s):
        p.add_argument("-o", "--output", required=True, metavar="PNG")
    args = ap.parse_args(argv)
    if args.kind == "throughput":
        plot_throughput(json.loads(Path(args.report).read_text()), args.output)
    else:
        plot_serving(load_labelled(args.reports), args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
