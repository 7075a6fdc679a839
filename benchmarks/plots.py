"""PNG figures of the benchmarks' JSON files (matplotlib, Agg backend; ``pip install -e ".[benchmarks]"``).

The benchmark scripts call these after writing their JSON; this entry point renders a figure again from a JSON
file already written, without rerunning anything (``cluster.py`` needs root and network namespaces):

    python benchmarks/plots.py cluster benchmarks/data/slow_link/cluster.json benchmarks/data/slow_link/cluster.png
    python benchmarks/plots.py convergence benchmarks/data/archive/convergence.json \\
        benchmarks/data/archive/convergence.png
    python benchmarks/plots.py convergence study.json study.png --regime calm --steps 100   # a file of several studies
"""

from __future__ import annotations

import argparse
import functools
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


def _convergence_runs(data: dict | list) -> tuple[list[dict], dict]:
    """Runs and meta of ``convergence.py``'s JSON: ``{meta, runs}`` (paired seeds), or the one-seed layouts before it
    (a list of rows, then ``{meta, rows}``), read as runs at one unnamed seed."""
    if isinstance(data, list):
        data = {"rows": data}
    if "runs" in data:
        return data["runs"], data.get("meta", {})
    meta = data.get("meta", {})
    runs = [dict(row, seed=None, regime=None, steps=meta.get("steps")) for row in data["rows"]]
    return runs, meta


def _mean_band(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """At the steps every curve has: the mean, min and max over the curves."""
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    values = [[c[s] for c in curves] for s in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def convergence_png(data: dict | list, path: Path, regime: str | None = None, steps: int | None = None) -> None:
    """Each configuration's validation loss against step, the mean over its seeds with a min..max band; below it the
    mean of its paired gaps to ``zero3`` (same seed) in percent with a band of 1 SE (the gaps of interest are a tenth
    of a percent: invisible on the loss axis), and the goals' bands. One seed: plain lines.

    A file holding several studies (regime, steps) needs ``regime`` and ``steps`` to choose one."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    runs, meta = _convergence_runs(data)
    runs = [r for r in runs if r.get("val_curve") and "error" not in r]
    studies = sorted({(r["regime"], r["steps"]) for r in runs}, key=str)
    chosen = [s for s in studies if regime in (None, s[0]) and steps in (None, s[1])]
    if len(chosen) != 1:
        raise ValueError(f"choose one study (regime, steps) of {studies} to plot; asked {(regime, steps)}")
    regime, steps = chosen[0]
    runs = [r for r in runs if (r["regime"], r["steps"]) == (regime, steps)]
    by_config: dict[str, dict] = {}
    for r in runs:
        by_config.setdefault(r["config"], {})[r["seed"]] = {int(s): v for s, v in r["val_curve"]}
    base = by_config.get("zero3")
    fig, (ax_loss, ax_gap) = plt.subplots(
        2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]} if base else None
    )
    for name, curves in by_config.items():
        x, mean, low, high = _mean_band(list(curves.values()))
        style = dict(color="black", linewidth=2.2) if name == "zero3" else dict(linewidth=1.4)
        label = name if len(curves) == 1 else f"{name} ({len(curves)} seeds)"
        (line,) = ax_loss.plot(x, mean, marker="o", markersize=3, label=label, **style)
        if len(curves) > 1:
            ax_loss.fill_between(x, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
        if base is None or name == "zero3":
            continue
        gaps = [{s: 100 * (v - base[seed][s]) / base[seed][s] for s, v in curve.items() if s in base[seed]}
                for seed, curve in curves.items() if seed in base]  # fmt: skip
        x, mean, _, _ = _mean_band(gaps)
        if not x:
            continue
        (line,) = ax_gap.plot(x, mean, marker="o", markersize=3, label=name, linewidth=1.4)
        if len(gaps) > 1:
            se = [_std([g[s] for g in gaps]) / len(gaps) ** 0.5 for s in x]
            ax_gap.fill_between(x, [m - e for m, e in zip(mean, se, strict=True)],
                                [m + e for m, e in zip(mean, se, strict=True)],
                                color=line.get_color(), alpha=0.15, linewidth=0)  # fmt: skip
    title = "Validation loss"
    if regime is not None:
        lr, warmup = runs[0].get("lr"), runs[0].get("warmup")
        title += f", {regime} (lr {lr:g}, warm-up {warmup})"
    if meta.get("nodes") or runs[0].get("nodes"):
        nodes, per_node = (
            runs[0].get("nodes", meta.get("nodes")),
            runs[0].get("ranks_per_node", meta.get("ranks_per_node")),
        )
        title += f"\n{nodes} nodes x {per_node} ranks, {steps} steps"
    if any(len(curves) > 1 for curves in by_config.values()):
        title += "; bands: min..max over seeds"
    ax_loss.set_title(title)
    ax_loss.set_ylabel("validation loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if base:
        ax_gap.axhline(0, color="black", linewidth=1.2)
        for goal, shade in ((0.2, 0.08), (0.1, 0.12)):
            ax_gap.axhspan(-goal, goal, color="tab:green", alpha=shade, linewidth=0)
        ax_gap.set_ylabel("paired gap vs zero3 (%)\nmean ± 1 SE; green: ±0.1%, ±0.2%")
        ax_gap.grid(alpha=0.3)
    ax_gap.set_xlabel("optimizer steps done")
    ax_gap.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _std(values: list[float]) -> float:
    m = sum(values) / len(values)
    return (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5


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
    parser.add_argument("--regime", help="convergence: the study to plot, where the file holds several")
    parser.add_argument("--steps", type=int, help="convergence: the study to plot, where the file holds several")
    args = parser.parse_args(argv)
    study = {k: v for k, v in (("regime", args.regime), ("steps", args.steps)) if v is not None}
    if study and args.kind != "convergence":
        parser.error("--regime and --steps choose a convergence study")
    if try_plot(functools.partial(PLOTS[args.kind], **study), json.loads(args.json.read_text()), args.png):
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
