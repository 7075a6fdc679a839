"""The paired gap of one study's runs against a baseline kept in another study file or regime.

``convergence.py`` pairs configurations that share one regime and one file. Some questions need a pair across them:
a ZeRO-3 run with only its learning rate cut by 1% (its own regime, ``lr0.000297-warmup30``) against calm ZeRO-3 at
the same seed, or a rerun kept in a scratch file against the study's baseline. This script reads both files and
prints, per seed present in both, the relative gap (run - baseline) / baseline of the mean training loss over the
first and the second half of the steps and of the final validation loss, then their mean and 2 standard errors (the
study's resolution) where there are two seeds or more. Nothing is trained.

    python benchmarks/paired_gap.py --json benchmarks/data/accuracy/convergence_lr_cut.json \\
        --regime lr0.000297-warmup30 --baseline benchmarks/data/accuracy/convergence_calm_fp32.json \\
        --baseline-regime calm --steps 500

``--windows 50`` adds the mean gap over the seeds in each window of 50 steps (does it grow with training?);
``--seeds 1 2 3`` pairs those seeds only; ``--resolution 0.03`` adds, per measure, how many seeds would bring 2 SE
to 0.03% at the spread the seeds show (the study's size for a goal); ``--out FILE`` writes the tables' numbers as JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from convergence import halves, load, mean_se

MEASURES = ("first_half", "second_half", "final_val")


def pick(path: Path, config: str, regime: str, steps: int) -> dict[int, dict]:
    """The finished runs of ``config`` in ``regime`` at ``steps`` in the study file at ``path``, by seed."""
    if not path.exists():
        raise SystemExit(f"no study file at {path}: give an existing --json / --baseline")
    return {
        r["seed"]: r
        for r in load(path)["runs"]
        if (r["config"], r["regime"], r["steps"]) == (config, regime, steps) and "error" not in r and r.get("val_curve")
    }


def gaps(run: dict, base: dict, steps: int) -> dict[str, float]:
    """The relative gaps of ``run`` against ``base``: mean training loss per half, final validation loss."""
    (r1, r2), (b1, b2) = halves(run["train_curve"], steps), halves(base["train_curve"], steps)
    rf, bf = run["val_curve"][-1][1], base["val_curve"][-1][1]
    return {"first_half": (r1 - b1) / b1, "second_half": (r2 - b2) / b2, "final_val": (rf - bf) / bf}


def paired(runs: dict[int, dict], base: dict[int, dict], steps: int) -> dict:
    """Per seed in both, the gaps; and over the seeds, each measure's mean and standard error (None below 2)."""
    per_seed = {seed: gaps(runs[seed], base[seed], steps) for seed in sorted(set(runs) & set(base))}
    summary = {}
    for m in MEASURES:
        mean, se = mean_se([g[m] for g in per_seed.values()])
        summary[m] = {"mean": mean, "se": se}
    return {"per_seed": per_seed, "summary": summary}


def seeds_for(se: float | None, n: int, resolution: float) -> int | None:
    """Seeds for 2 SE <= ``resolution`` (a fraction) at the spread ``n`` seeds show (their SE ``se``): the sample
    standard deviation ``se * sqrt(n)`` over ``resolution / 2``, squared, rounded up; None without a spread."""
    if se is None:
        return None
    return max(2, math.ceil((2 * se * math.sqrt(n) / resolution) ** 2 - 1e-9))


def windows(runs: dict[int, dict], base: dict[int, dict], steps: int, width: int) -> list[dict]:
    """Over the seeds in both, the relative gap of the mean training loss in each window of ``width`` steps (the last
    one may be shorter): its mean and standard error, whether the gap grows with training."""
    seeds = sorted(set(runs) & set(base))
    out = []
    for start in range(1, steps + 1, width):
        end = min(start + width - 1, steps)
        values = []
        for seed in seeds:
            r = [v for s, v in runs[seed]["train_curve"] if start <= s <= end]
            b = [v for s, v in base[seed]["train_curve"] if start <= s <= end]
            values.append(sum(r) / sum(b) - 1)
        mean, se = mean_se(values)
        out.append({"steps": [start, end], "mean": mean, "se": se})
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.3f}%"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="the study file of the runs")
    parser.add_argument("--config", default="zero3", help="their configuration (default zero3)")
    parser.add_argument("--regime", required=True, help="their regime, as the study file names it")
    parser.add_argument("--baseline", type=Path, required=True, help="the study file of the baseline runs")
    parser.add_argument("--baseline-config", default="zero3")
    parser.add_argument("--baseline-regime", default="calm")
    parser.add_argument("--steps", type=int, required=True, help="the runs' length (both sides)")
    parser.add_argument(
        "--windows",
        type=int,
        default=None,
        metavar="STEPS",
        help="also the mean gap over the seeds in each window of this many steps",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="pair only these seeds (default: all)")
    parser.add_argument(
        "--resolution",
        type=float,
        default=None,
        metavar="PERCENT",
        help="also the seeds that would bring 2 SE to this many percent, at the spread measured",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    runs = pick(args.json, args.config, args.regime, args.steps)
    base = pick(args.baseline, args.baseline_config, args.baseline_regime, args.steps)
    if args.seeds is not None:
        missing = sorted(set(args.seeds) - (set(runs) & set(base)))
        if missing:
            raise SystemExit(
                f"--seeds {' '.join(map(str, args.seeds))}: seeds {missing} lack a finished {args.config} run or its"
                f" {args.baseline_config} baseline (paired seeds: {sorted(set(runs) & set(base))}); drop them"
            )
        runs = {seed: runs[seed] for seed in args.seeds}
    if args.resolution is not None and not args.resolution > 0:
        raise SystemExit(f"--resolution {args.resolution}: give the 2 SE wanted in percent, above 0, e.g. 0.03")
    if not set(runs) & set(base):
        raise SystemExit(
            f"no seed has both a finished {args.config} run ({args.regime}, {args.steps} steps; seeds {sorted(runs)})"
            f" and a {args.baseline_config} baseline ({args.baseline_regime}; seeds {sorted(base)}): check --regime,"
            " --steps and the files"
        )
    result = paired(runs, base, args.steps)
    print(
        f"{args.config} ({args.regime}) against {args.baseline_config} ({args.baseline_regime}), {args.steps} steps\n"
    )
    print("| seed | first half | second half | final validation loss |\n|---|---|---|---|")
    for seed, g in result["per_seed"].items():
        print(f"| {seed} | " + " | ".join(pct(g[m]) for m in MEASURES) + " |")
    if len(result["per_seed"]) > 1:
        cells = [f"{pct(s['mean'])} ± {pct(2 * s['se'])[1:]}" for s in (result["summary"][m] for m in MEASURES)]
        print("| mean ± 2 SE | " + " | ".join(cells) + " |")
    if args.resolution is not None:
        n = len(result["per_seed"])
        result["seeds_for_resolution"] = {
            m: seeds_for(result["summary"][m]["se"], n, args.resolution / 100) for m in MEASURES
        }
        cells = [str(result["seeds_for_resolution"][m] or "-") for m in MEASURES]
        print(f"| seeds for ± {args.resolution:g}% | " + " | ".join(cells) + " |")
    if args.windows is not None:
        if args.windows < 1:
            raise SystemExit(f"--windows {args.windows}: give a window of 1 step or more, e.g. --windows 50")
        result["windows"] = windows(runs, base, args.steps, args.windows)
        print("\n| steps | mean gap ± 2 SE |\n|---|---|")
        for w in result["windows"]:
            spread = "" if w["se"] is None else f" ± {pct(2 * w['se'])[1:]}"
            print(f"| {w['steps'][0]}-{w['steps'][1]} | {pct(w['mean'])}{spread} |")
    if args.out:
        data = {"args": {k: str(v) for k, v in vars(args).items()}, **result}
        record.write(args.out, data, None if argv is None else [__file__, *argv])
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
