"""PNG figures of the benchmarks' JSON files (matplotlib, Agg backend; ``pip install -e ".[benchmarks]"``).

The benchmark scripts call these after writing their JSON; this entry point renders a figure again from a JSON
file already written, without rerunning anything (``cluster.py`` needs root and network namespaces):

    python benchmarks/plots.py cluster benchmarks/cluster.json benchmarks/cluster.png
    python benchmarks/plots.py convergence benchmarks/convergence.json benchmarks/convergence.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MISSING_MATPLOTLIB = 'matplotlib is not installed: pip install -e ".[benchmarks]" (skipping the PNG)'


def _pyplot():
    """``matplotlib.pyplot`` on the Agg backend; raises ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def try_plot(plot, *args: Any) -> bool:
    """Runs ``plot(*args)``; without matplotlib prints :data:`MISSING_MATPLOTLIB` and returns ``False``."""
    try:
        _pyplot()
    except ImportError:
        print(MISSING_MATPLOTLIB, file=sys.stderr)
        return False
    plot(*args)
    return True


def _convergence_rows(data: dict | list) -> tuple[list[dict], dict]:
    """Rows and meta of ``convergence.py``'s JSON (a list of rows in its first version, then ``{meta, rows}``)."""
    return (data, {}) if isinstance(data, list) else (data["rows"], data.get("meta", {}))


def convergence_png(data: dict | list, path: Path) -> None:
    """Validation loss against step, one line per configuration; below it each one's gap to ``zero3`` in percent
    (the gaps of interest are a tenth of a percent: invisible on the loss axis) with the goals' bands."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    rows, meta = _convergence_rows(data)
    base = next((r for r in rows if r["config"] == "zero3"), None)
    fig, (ax_loss, ax_gap) = plt.subplots(
        2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]} if base else None
    )
    for row in rows:
        steps, losses = zip(*row["val_curve"], strict=True) if row["val_curve"] else ((), ())
        style = dict(color="black", linewidth=2.2) if row["config"] == "zero3" else dict(linewidth=1.4)
        ax_loss.plot(steps, losses, marker="o", markersize=3, label=row["config"], **style)
        if base and row is not base:
            ref = dict((int(s), v) for s, v in base["val_curve"])
            gap = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in row["val_curve"] if s in ref]
            if gap:
                ax_gap.plot(*zip(*gap, strict=True), marker="o", markersize=3, label=row["config"], linewidth=1.4)
    title = "Validation loss"
    if meta.get("nodes"):
        title += f" ({meta['nodes']} nodes x {meta['ranks_per_node']} ranks, {meta['steps']} steps)"
    ax_loss.set_title(title)
    ax_loss.set_ylabel("validation loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if base:
        ax_gap.axhline(0, color="black", linewidth=1.2)
        for goal, shade in ((0.2, 0.08), (0.1, 0.12)):
            ax_gap.axhspan(-goal, goal, color="tab:green", alpha=shade, linewidth=0)
        ax_gap.set_ylabel("gap vs zero3 (%)\nbands: ±0.1%, ±0.2%")
        ax_gap.grid(alpha=0.3)
    ax_gap.set_xlabel("optimizer steps done")
    ax_gap.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rate_label(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g} Mbit/s"


def cluster_png(data: dict, path: Path) -> None:
    """``cluster.py``'s sweep: per link rate, grouped bars of each configuration's median step time (log scale)
    and, below, its speedup over ``zero3`` at the same rate."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    rows = data["rows"]
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by_key = {(r["rate"], r["config"]): r for r in rows}
    fig, (ax_time, ax_speed) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    width = 0.8 / len(configs)
    colors = plt.get_cmap("tab10").colors
    for i, config in enumerate(configs):
        xs, times, speedups = [], [], []
        for j, rate in enumerate(rates):
            row = by_key.get((rate, config))
            if row is not None:
                xs.append(j + (i - (len(configs) - 1) / 2) * width)
                times.append(row["step_s"])
                speedups.append(row.get("speedup_vs_zero3", float("nan")))
        color = colors[i % len(colors)]
        bars = ax_time.bar(xs, times, width, label=config, color=color)
        ax_time.bar_label(bars, labels=[f"{t:.2f}" for t in times], fontsize=6, padding=1)
        bars = ax_speed.bar(xs, speedups, width, label=config, color=color)
        ax_speed.bar_label(bars, labels=[f"{s:.1f}x" for s in speedups], fontsize=6, padding=1)
    meta = data.get("meta", {})
    model = meta.get("model", {})
    what = "4 ranks as 2 nodes x 2"
    if model:
        what += f", GPT {model.get('n_layer')}x{model.get('n_embd')}, batch {meta.get('batch_size')}"
        what += f" x {model.get('block_size')} per rank"
    ax_time.set_title(f"Emulated two-node cluster: step time by link rate\n({what})")
    ax_time.set_ylabel("step time, s (median, log scale)")
    ax_time.set_yscale("log")
    ax_time.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax_time.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:e}"[0] in "235" else ""))
    ax_time.tick_params(axis="y", which="minor", labelsize=7)
    ax_time.grid(axis="y", alpha=0.3, which="both")
    ax_time.legend(ncol=len(configs), fontsize=8, loc="upper right")
    ax_speed.axhline(1.0, color="black", linewidth=1)
    ax_speed.set_ylabel("speedup vs zero3")
    ax_speed.grid(axis="y", alpha=0.3)
    ax_speed.set_xticks(range(len(rates)), [_rate_label(r) for r in rates])
    ax_speed.set_xlabel("link between the nodes (per direction)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOTS = {"cluster": cluster_png, "convergence": convergence_png}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=list(PLOTS))
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    if try_plot(PLOTS[args.kind], json.loads(args.json.read_text()), args.png):
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
