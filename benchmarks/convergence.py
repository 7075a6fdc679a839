"""Does ZeRO++ train as well as ZeRO-3? The example GPT on the standard-library corpus, paired over seeds.

Runs the CPU demo configuration (``examples/gpt/configs/cpu_demo.yaml``: AdamW, batch 8 x 128 bytes per rank, linear
warm-up then cosine decay to 10% over the run) through LightningCLI on ``--nodes x --ranks-per-node`` CPU processes of
this machine, emulated as that many nodes (``devices=nodes*ranks_per_node``, ``num_nodes=1``, the strategy's
``ranks_per_node``), once per configuration and seed. The default configurations:

    zero3             ZeRO-3: no quantization, no secondary partition (the baseline)
    zeropp            ZeRO++ defaults: INT8 weights, hpZ, qgZ (INT8 intra-node, INT4 inter-node), parameter-aligned
    zeropp+ef         ... with error feedback on the quantized gradients at decay 0.8 (the default until 1.0)
    zeropp-deltas+ef  ... with weight deltas (the hpZ copies kept and updated by INT4 deltas) and error feedback
    zeropp-qgz-half   ... with qgZ for the first half of the steps, then the exact reduce-scatter
                      (quantize_gradients_steps = steps // 2: the paper's remedy for late-training accuracy)

and, with ``--configs``: zeropp-int4w (INT4 weights), zeropp-int4w+ef, zeropp-deltas, the attribution pair
zeropp-qwz-only (INT8 weights and hpZ, gradients reduce-scattered exactly) and zeropp-qgz-only (qgZ alone: exact
weights, no secondary partition), the long-run candidates zeropp+rot (Hadamard-rotated gradient blocks on the inter-node
hop), zeropp+sr (stochastic rounding), zeropp+ef1 (error feedback as it is now: decay 1, the error telescopes),
zeropp+rot+ef1, zeropp-qgz8 (the inter-node hop in INT8: twice its bytes), zeropp+smc (the second-moment correction:
qgZ's noise variance taken out of AdamW's exp_avg_sq, no bytes more), zeropp+smc-matrices (the same, on the
parameters of two or more dimensions only: ``second_moment_scope="matrices"``), zeropp+smc-vectors (that, with the
gradients of norm gains and biases reduced exactly: ``gradient_quantization_scope="matrices"``), and reference-like
(the ablation of the reference implementation's choices: INT4 on both gradient hops, blocks over each unit's flat
buffer, so that a block may hold elements of two parameters, INT8 weights, no error feedback).

Seeds: ``--seed_everything`` sets the initial weights, dropout and the data order, and every configuration runs at
every seed of ``--seeds``, so each gap is paired: at one seed, (config - zero3) / zero3. The seed alone moves ZeRO-3's
own loss by several percent at lr 1e-3 and 10 warm-up steps: one seed is an anecdote, not a result.

Regimes (``--regime``; ``--lr`` / ``--warmup`` set either explicitly, and the regime is then named after them):
    aggressive  lr 1e-3, 10 warm-up steps (the demo YAML's; the default)
    calm        lr 3e-4, 30 warm-up steps

Report, per (regime, steps) and configuration against zero3 at the same seeds: the paired gap of the final
validation loss and of the mean validation loss over the last quarter of the run (the validation points after 3/4 of
the steps; ``--evals 8`` or more puts two or more there), at each seed, their mean, standard error (std over seeds /
sqrt(seeds)) and the study's resolution, 2 SE (a mean gap within it is not told apart from zero); ZeRO-3's own
seed-to-seed spread (std and min..max of its final loss); spikes: a run spikes when its training loss (rank 0's),
smoothed by a trailing mean over 5 steps, exceeds zero3's at the same seed and step by more than ``--spike-margin``
(relative), with the step of its first spike. Every run also carries ``ZeroGradientMonitor``: a parameter whose
reduced gradient was exactly zero at some step (rounded away inside a quantization block shared with larger values)
counts as starved. Goals: the defaults within 0.1% of ZeRO-3's final validation loss; INT4 weights with error feedback
within 0.2% (met when the mean gap and its resolution lie within the goal).

Results: a markdown table on stdout; ``--json`` holds ``meta``, ``runs`` (one per config, seed, regime and steps: the
settings, ``val_curve`` and ``train_curve`` as ``[steps done, loss]``, seconds, starved parameters) and ``summary``
(the table's numbers). It is rewritten after every run, and a rerun with the same ``--json`` skips the runs done
(failed ones run again): a study continues across sessions, and one file holds several regimes and lengths.
``--png`` (default: beside the JSON): each configuration's mean validation curve over the seeds with its min..max band,
and below it the mean paired gap with a band of 1 SE.

Precision: the demo's bf16-mixed where the CPU multiplies bf16 natively; otherwise (AVX2-only CPUs: PyTorch's bf16
matmul there is ~50x slower than fp32, ~36 s a step on 8 ranks) ``32-true`` (``--precision`` overrides).

Duration, on this machine (2 shared cores), 8 ranks (4 nodes x 2), fp32: ~3.2 s a step, ~55 s start-up per run and
~8.5 s per validation of 512 windows; so a run takes 55 s + steps x 3.2 s + evals x 8.5 s. The calm study's runs
(bf16-mixed, 100 steps, 20 evaluations) took 14-26 minutes each, with other jobs sharing the cores. The three studies:

    # calm: 5 configurations x 3 seeds x ~545 s = about 2.3 hours
    python benchmarks/convergence.py --regime calm --seeds 1 2 3 --steps 100 --evals 20 \\
        --json benchmarks/data/accuracy/convergence_calm.json
    # length: 3 configurations x 2 seeds x ~1825 s = about 3 hours (<chosen>: the best of the calm study)
    python benchmarks/convergence.py --regime calm --seeds 1 2 --steps 500 --evals 20 \\
        --configs zero3 zeropp <chosen> --json benchmarks/data/accuracy/convergence_calm.json
    # aggressive (spikes): 5 configurations x 6 seeds x ~217 s = about 1.8 hours
    python benchmarks/convergence.py --regime aggressive --seeds 1 2 3 4 5 6 --steps 40 --evals 4 \\
        --json benchmarks/data/accuracy/convergence_aggressive.json

A smoke run (2 ranks, ~3 minutes; weight deltas need 2 ranks per node, so zeropp-deltas+ef is left out):
``--nodes 2 --ranks-per-node 1 --steps 4 --evals 2 --val-windows 16 --seeds 1 2 --configs zero3 zeropp zeropp+ef
zeropp-qgz-half --json /tmp/smoke.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "gpt" / "configs" / "cpu_demo.yaml"
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # noqa: E402
from plots import convergence_png, try_plot  # noqa: E402

# Strategy arguments by configuration; a callable takes the run's steps (settings that depend on the run's length).
# Every configuration runs without the second-moment correction and with every gradient quantized unless it names the
# setting (``+smc``, ``-vectors``): the stored runs predate those defaults (AS_RECORDED below), so "zeropp" is ZeRO++
# without the correction.
RUNS: dict[str, dict[str, Any] | Callable[[int], dict[str, Any]]] = {
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "zeropp": dict(),
    "zeropp+ef": dict(gradient_error_feedback=True, error_feedback_decay=0.8),  # the runs before decay 1.0
    "zeropp-deltas+ef": dict(weight_deltas=True, gradient_error_feedback=True),
    "zeropp-qgz-half": lambda steps: dict(quantize_gradients_steps=steps // 2),
    "zeropp-int4w": dict(weight_bits=4),
    "zeropp-int4w+ef": dict(weight_bits=4, gradient_error_feedback=True),
    "reference-like": dict(intra_node_gradient_bits=4, block_alignment="flat", weight_bits=8,
                           gradient_error_feedback=False),
    "zeropp-deltas": dict(weight_deltas=True),
    "zeropp-qwz-only": dict(quantize_gradients=False),
    "zeropp-qgz-only": dict(quantize_weights=False, hpz_partition_size=1),
    "zeropp+rot": dict(gradient_rotation="hadamard"),
    "zeropp+sr": dict(gradient_rounding="stochastic"),
    "zeropp+ef1": dict(gradient_error_feedback=True, error_feedback_decay=1.0),
    "zeropp+rot+ef1": dict(gradient_rotation="hadamard", gradient_error_feedback=True, error_feedback_decay=1.0),
    "zeropp-qgz8": dict(gradient_bits=8),
    "zeropp+smc": dict(second_moment_correction=True, second_moment_scope="all"),  # the defaults until 2026-12-07
    "zeropp+smc-matrices": dict(second_moment_correction=True, second_moment_scope="matrices"),
    "zeropp+smc-vectors": dict(second_moment_correction=True, second_moment_scope="matrices",
                               gradient_quantization_scope="matrices"),
    "zeropp+ef1+smc": dict(gradient_error_feedback=True, error_feedback_decay=1.0, second_moment_correction=True,
                           second_moment_scope="all"),
    "hsdp": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=False),
    "qhsdp": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True),
    "qhsdp-bf16": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True,
                       hsdp_gather_bits=16),
    "qhsdp-int4": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True,
                       hsdp_gather_bits=4),
    "qhsdp-int4+ef": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True,
                          hsdp_gather_bits=4, gradient_error_feedback=True),
}  # fmt: skip
AS_RECORDED = dict(second_moment_correction=False, gradient_quantization_scope="all")
"""What every configuration sets unless it names the setting itself: its runs were made before the correction was on
by default and while every gradient was quantized (``False`` and ``"all"`` are accepted everywhere, HSDP and ZeRO-3
included)."""
DEFAULT_CONFIGS = ["zero3", "zeropp", "zeropp+ef", "zeropp-deltas+ef", "zeropp-qgz-half"]
BASE = "zero3"
REGIMES = {"aggressive": (1e-3, 10), "calm": (3e-4, 30)}  # (peak learning rate, warm-up steps)
DEFAULT_REGIME = "aggressive"  # the demo YAML's
DEFAULT_SEED = 1234  # the demo YAML's seed_everything
SMOOTHING = 5  # steps of the trailing mean of the training curves that spike detection compares
GOALS = {"zeropp": 0.001, "zeropp-int4w+ef": 0.002}  # |relative gap of the final validation loss vs zero3|
# What a run must share with the runs it is compared with (besides its key); a resumed file is checked against them.
SETUP = ("nodes", "ranks_per_node", "evals", "val_windows", "precision", "lr", "warmup")
MONITOR = "lightning_zeropp.callback.ZeroGradientMonitor"
# ZeroGradientMonitor's end-of-training line (rank 0): the names of the starved parameters
_STARVED_LINE = re.compile(r"ZeroGradientMonitor: \d+ parameter\(s\) had an all-zero gradient at some step: (.*)")

Curve = list[tuple[int, float]]  # [steps done, loss]
Key = tuple[str, int, str, int]  # (config, seed, regime, steps)


# ----------------------------------------------------------------------------------------------- running
def strategy_arguments(name: str, steps: int) -> dict[str, Any]:
    """The strategy arguments of configuration ``name`` for a run of ``steps`` optimizer steps."""
    spec = RUNS[name]
    return AS_RECORDED | (spec(steps) if callable(spec) else spec)


def unfit(name: str, args: argparse.Namespace) -> str | None:
    """Why configuration ``name`` cannot run on this job shape (weight deltas need two or more ranks per node), or
    None: the strategy's own checks, before any run starts."""
    from lightning_zeropp import ZeroPPConfig

    world = args.nodes * args.ranks_per_node
    try:
        config = ZeroPPConfig(**strategy_arguments(name, args.steps), ranks_per_node=args.ranks_per_node)
        config.resolve(world, world)
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def regime_name(lr: float, warmup: int) -> str:
    """The named regime with this learning rate and warm-up, else ``lr<lr>-warmup<warmup>``."""
    for name, (rlr, rwarmup) in REGIMES.items():
        if math.isclose(lr, rlr, rel_tol=1e-9) and warmup == rwarmup:
            return name
    return f"lr{lr:g}-warmup{warmup}"


def command(name: str, seed: int, args: argparse.Namespace, save_dir: Path) -> list[str]:
    """The LightningCLI command line of one configuration at one seed."""
    cmd = [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "fit", "--config", str(CONFIG)]
    strategy = dict(strategy_arguments(name, args.steps), ranks_per_node=args.ranks_per_node)
    for key, value in strategy.items():
        cmd += [f"--trainer.strategy.init_args.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    cmd += [
        "--seed_everything", str(seed),
        "--model.learning_rate", repr(args.lr), "--model.warmup_steps", str(args.warmup),
        "--trainer.devices", str(args.nodes * args.ranks_per_node), "--trainer.num_nodes", "1",
        "--trainer.precision", args.precision,
        "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(max(1, args.steps // args.evals)),
        "--trainer.check_val_every_n_epoch", "null", "--trainer.limit_val_batches", "1.0",
        "--data.val_windows", str(args.val_windows), "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(save_dir), "--model.decay_steps", str(args.steps),
        "--trainer.log_every_n_steps", "1",  # every step: the training curve, and the starved count of the last step
        f"--trainer.callbacks+={MONITOR}",
    ]  # fmt: skip
    return cmd


def setup_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in SETUP}


def run(name: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    save_dir = out / f"{name}-seed{seed}"
    cmd = command(name, seed, args, save_dir)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{name} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    (metrics,) = save_dir.glob("lightning_logs/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    # the CSV's step is the 0-based index of the last optimizer step; the curves count the steps done
    val = [(int(r["step"]) + 1, float(r["val/loss"])) for r in rows if r.get("val/loss")]
    train = [(int(r["step"]) + 1, float(r["train/loss"])) for r in rows if r.get("train/loss")]
    starved = [float(r["zeropp/starved_parameters"]) for r in rows if r.get("zeropp/starved_parameters")]
    if not starved:
        raise RuntimeError(f"{name}: no zeropp/starved_parameters in {metrics}; was {MONITOR} added?")
    names = next((m.group(1).split(", ") for m in map(_STARVED_LINE.search, (proc.stdout + proc.stderr).splitlines())
                  if m), [])  # fmt: skip
    return {
        "strategy": strategy_arguments(name, args.steps),
        "seconds": seconds,
        "val_curve": val,
        "train_curve": train,
        "starved_parameters": int(max(starved)),
        "starved_names": names,
    }


def cpu_bf16_is_fast(ratio: float = 4.0) -> bool:
    """Whether this CPU multiplies bf16 matrices at least ``1/ratio`` as fast as fp32. Without native bf16
    (AVX512-BF16, AMX) PyTorch falls back to a scalar path about 50x slower than fp32, and bf16-mixed training of
    the demo takes ~36 s a step on 8 ranks instead of ~3 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(256, 256, dtype=dtype), torch.randn(256, 256, dtype=dtype)
            a @ b
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            seconds[dtype] = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return seconds[torch.bfloat16] <= ratio * seconds[torch.float32]


# ----------------------------------------------------------------------------------------------- resuming
def key_of(run: dict) -> Key:
    return run["config"], run["seed"], run["regime"], run["steps"]


def pending(plan: Iterable[Key], runs: list[dict]) -> list[Key]:
    """The runs of ``plan`` not done yet in ``runs`` (a failed run counts as not done), in the plan's order."""
    done = {key_of(r) for r in runs if "error" not in r}
    return [k for k in plan if k not in done]


def conflicts(plan: Iterable[Key], runs: list[dict], setup: dict[str, Any]) -> list[str]:
    """The runs done under ``plan``'s keys with other settings than ``setup`` (they cannot be paired with new ones)."""
    keys = set(plan)
    out = []
    for r in runs:
        if key_of(r) in keys and "error" not in r:
            differ = {k: (r.get(k), v) for k, v in setup.items() if r.get(k) != v}
            if differ:
                out.append(
                    f"{key_of(r)}: " + ", ".join(f"{k} {old!r} there, {new!r} now" for k, (old, new) in differ.items())
                )
    return out


def add_run(runs: list[dict], result: dict) -> None:
    """Adds ``result`` to ``runs``, replacing a record of the same key (a failed attempt)."""
    runs[:] = [r for r in runs if key_of(r) != key_of(result)]
    runs.append(result)


def load(path: Path | None) -> dict[str, Any]:
    """The study file at ``path`` (a new one if it does not exist); refuses the first layout (one seed, ``rows``)."""
    if path is None or not path.exists():
        return {"meta": {"commands": []}, "runs": [], "summary": []}
    data = json.loads(path.read_text())
    if "runs" not in data:
        raise SystemExit(
            f"{path} was written by the one-seed version of this script (no `runs`); give another --json, or move it."
        )
    data.setdefault("meta", {}).setdefault("commands", [])
    return data


# ----------------------------------------------------------------------------------------------- statistics
def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard error (sample std / sqrt(n)); the SE is None for fewer than two values."""
    if not values:
        return None, None
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    return m, std(values) / math.sqrt(len(values))


def std(values: list[float]) -> float | None:
    """Sample standard deviation (n - 1); None for fewer than two values."""
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def last_quarter(curve: Curve, steps: int) -> tuple[float, int]:
    """The mean of the validation points after 3/4 of the ``steps``, and how many there are (the last point always
    is: the runs validate at their last step)."""
    points = [v for s, v in curve if 4 * s > 3 * steps]
    if not points:
        raise ValueError(f"no validation point after step {3 * steps / 4:g} of {steps}: {curve}")
    return sum(points) / len(points), len(points)


def halves(curve: Curve, steps: int) -> tuple[float, float]:
    """The mean training loss over the first half of the ``steps`` (steps 1 to steps/2) and over the second: where
    a cost that grows with training shows, and one number per half that many points average (a final loss is one)."""
    first = [v for s, v in curve if 2 * s <= steps]
    second = [v for s, v in curve if 2 * s > steps]
    if not first or not second:
        raise ValueError(f"a training curve of {steps} steps needs points in both halves: {len(curve)} points")
    return sum(first) / len(first), sum(second) / len(second)


def smoothed(curve: Curve, window: int = SMOOTHING) -> dict[int, float]:
    """Each step's trailing mean over ``window`` points of the curve (fewer at its start)."""
    values = [v for _, v in curve]
    return {
        s: sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i, (s, _) in enumerate(curve)
    }


def first_spike(curve: Curve, base: Curve, margin: float, window: int = SMOOTHING) -> int | None:
    """The first step at which ``curve``, smoothed, exceeds ``base``, smoothed, by more than ``margin`` (relative),
    at the same step; None if it never does."""
    mine, theirs = smoothed(curve, window), smoothed(base, window)
    return next((s for s in sorted(mine) if s in theirs and mine[s] > theirs[s] * (1 + margin)), None)


def paired(values: dict[int, float], base: dict[int, float]) -> dict[str, Any]:
    """The relative gap ``(value - base) / base`` at each seed both have, its mean, SE and the resolution 2 SE."""
    seeds = sorted(set(values) & set(base))
    gaps = [(values[s] - base[s]) / base[s] for s in seeds]
    m, se = mean_se(gaps)
    return {
        "per_seed": [[s, g] for s, g in zip(seeds, gaps, strict=True)],
        "mean": m,
        "se": se,
        "resolution": None if se is None else 2 * se,
    }


def summarize(runs: list[dict], margin: float, window: int = SMOOTHING) -> list[dict[str, Any]]:
    """The report's numbers per (regime, steps): ZeRO-3's spread, and each other configuration against it."""
    done = [r for r in runs if "error" not in r and r.get("val_curve")]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in done:
        groups.setdefault((r["regime"], r["steps"]), []).append(r)
    out = []
    for (regime, steps), group in groups.items():
        by_config: dict[str, dict[int, dict]] = {}
        for r in group:
            by_config.setdefault(r["config"], {})[r["seed"]] = r
        base = by_config.get(BASE, {})
        final = {name: {s: r["val_curve"][-1][1] for s, r in rs.items()} for name, rs in by_config.items()}
        quarter = {
            name: {s: last_quarter(r["val_curve"], steps) for s, r in rs.items()} for name, rs in by_config.items()
        }
        base_finals = list(final.get(BASE, {}).values())
        entry: dict[str, Any] = {
            "regime": regime,
            "lr": group[0]["lr"],
            "warmup": group[0]["warmup"],
            "steps": steps,
            "last_quarter_points": min((n for q in quarter.values() for _, n in q.values()), default=0),
            BASE: {
                "seeds": sorted(base),
                "final_val_loss": {
                    "mean": mean_se(base_finals)[0],
                    "std": std(base_finals),
                    "relative_std": None if len(base_finals) < 2 else std(base_finals) / mean_se(base_finals)[0],
                    "min": min(base_finals, default=None),
                    "max": max(base_finals, default=None),
                },
            },
            "configs": [],
        }
        base_quarter = {s: v for s, (v, _) in quarter.get(BASE, {}).items()}
        half = {name: {s: halves(r["train_curve"], steps) for s, r in rs.items()} for name, rs in by_config.items()}
        for name, rs in by_config.items():
            if name == BASE:
                continue
            spikes = {
                s: first_spike(r["train_curve"], base[s]["train_curve"], margin, window)
                for s, r in sorted(rs.items())
                if s in base
            }
            entry["configs"].append(
                {
                    "config": name,
                    "seeds": sorted(set(rs) & set(base)),
                    "unpaired_seeds": sorted(set(rs) - set(base)),
                    "final_gap": paired(final[name], final.get(BASE, {})),
                    "last_quarter_gap": paired({s: v for s, (v, _) in quarter[name].items()}, base_quarter),
                    "first_half_train_gap": paired(
                        {s: h[0] for s, h in half[name].items()}, {s: h[0] for s, h in half.get(BASE, {}).items()}
                    ),
                    "second_half_train_gap": paired(
                        {s: h[1] for s, h in half[name].items()}, {s: h[1] for s, h in half.get(BASE, {}).items()}
                    ),
                    "spikes": {
                        "runs": sum(step is not None for step in spikes.values()),
                        "of": len(spikes),
                        "first_step": [[s, step] for s, step in spikes.items()],
                    },
                    "starved_parameters": max(r["starved_parameters"] for r in rs.values()),
                    "minutes": sum(r["seconds"] for r in rs.values()) / len(rs) / 60,
                }
            )
        out.append(entry)
    return out


def verdict(gap: dict[str, Any], goal: float) -> str:
    """A goal is met when the mean gap and its resolution lie within it, missed when they lie outside."""
    if gap["mean"] is None:
        return "n/a (no paired run)"
    if gap["resolution"] is None:
        return f"no verdict: one seed ({gap['mean']:+.3%})"
    low, high = abs(gap["mean"]) - gap["resolution"], abs(gap["mean"]) + gap["resolution"]
    if high <= goal:
        return f"met ({gap['mean']:+.3%} ± {gap['resolution']:.3%})"
    if low > goal:
        return f"NOT met ({gap['mean']:+.3%} ± {gap['resolution']:.3%})"
    return f"undecided: the resolution is too coarse ({gap['mean']:+.3%} ± {gap['resolution']:.3%})"


# ----------------------------------------------------------------------------------------------- report
def _pct(value: float | None, digits: int = 3, sign: str = "+") -> str:
    """A fraction in percent; ``sign``: "+" (signed), "" (a spread), "±" (a resolution)."""
    if value is None:
        return "n/a"
    return f"±{value:.{digits}%}" if sign == "±" else f"{value:{sign}.{digits}%}"


def _pcts(pairs: list[list]) -> str:
    return ", ".join(f"{_pct(g, 2)}" for _, g in pairs) or "n/a"


def report(summary: list[dict[str, Any]], margin: float, window: int = SMOOTHING) -> None:
    """The summary as markdown: one section per (regime, steps)."""
    for entry in summary:
        base = entry[BASE]
        f = base["final_val_loss"]
        print(f"\n### {entry['regime']}: lr {entry['lr']:g}, warm-up {entry['warmup']}, {entry['steps']} steps\n")
        if f["mean"] is None:
            print(f"no {BASE} run: no gaps\n")
        else:
            spread = "n/a (one seed)" if f["std"] is None else f"{f['std']:.4f} ({f['relative_std']:.2%})"
            print(
                f"{BASE} final validation loss over seeds {', '.join(map(str, base['seeds']))}: mean {f['mean']:.4f},"
                f" std {spread}, min..max {f['min']:.4f}..{f['max']:.4f}\n"
            )
        quarter = entry["last_quarter_points"]
        print(
            f"Gaps: (config - {BASE}) / {BASE} at the same seed, in seed order; SE over seeds; resolution = 2 SE."
            f" Last quarter: mean of the validation points after 3/4 of the steps ({quarter} per run"
            f"{': the final point alone, use more --evals' if quarter < 2 else ''}). Spikes: training loss (trailing"
            f" mean over {window} steps) above {BASE}'s at the same seed and step by more than {margin:.0%}.\n"
        )
        print(
            "| config | seeds | final gap per seed | final gap mean | SE | resolution | last-quarter gap per seed"
            " | last-quarter mean | SE | resolution | spiking runs | first spike (seed: step) | starved | minutes/run |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in entry["configs"]:
            fg, qg, sp = c["final_gap"], c["last_quarter_gap"], c["spikes"]
            first = ", ".join(f"{s}: {step}" for s, step in sp["first_step"] if step is not None) or "none"
            print(
                f"| {c['config']} | {len(c['seeds'])} | {_pcts(fg['per_seed'])} | {_pct(fg['mean'])} |"
                f" {_pct(fg['se'], sign='')} | {_pct(fg['resolution'], sign='±')} | {_pcts(qg['per_seed'])} |"
                f" {_pct(qg['mean'])} | {_pct(qg['se'], sign='')} | {_pct(qg['resolution'], sign='±')} |"
                f" {sp['runs']} of {sp['of']} | {first} |"
                f" {c['starved_parameters']} | {c['minutes']:.1f} |"
            )
        print()
        half = entry["steps"] // 2
        print(
            f"Training loss by half (mean over steps 1-{half} and {half + 1}-{entry['steps']}), gap to {BASE} at the"
            " same seed: where a cost that grows with training shows.\n"
        )
        print("| config | seeds | first half per seed | mean | resolution | second half per seed | mean | resolution |")
        print("|---|---|---|---|---|---|---|---|")
        for c in entry["configs"]:
            a, b = c["first_half_train_gap"], c["second_half_train_gap"]
            print(
                f"| {c['config']} | {len(c['seeds'])} | {_pcts(a['per_seed'])} | {_pct(a['mean'])} |"
                f" {_pct(a['resolution'], sign='±')} | {_pcts(b['per_seed'])} | {_pct(b['mean'])} |"
                f" {_pct(b['resolution'], sign='±')} |"
            )
        print()
        for c in entry["configs"]:
            if c["config"] in GOALS:
                goal = GOALS[c["config"]]
                print(f"goal {c['config']} within {goal:.1%} of {BASE}: {verdict(c['final_gap'], goal)}")
            if c["unpaired_seeds"]:
                print(f"{c['config']}: seeds {c['unpaired_seeds']} have no {BASE} run (left out of the gaps)")


def estimate_minutes(runs: int, steps: int, evals: int) -> float:
    """At this machine's pace, 8 ranks fp32 (module docstring): 55 s start-up, 3.2 s a step, 8.5 s a validation."""
    return runs * (55 + 3.2 * steps + 8.5 * evals) / 60


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4, help="emulated nodes")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="CPU processes per emulated node")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument(
        "--evals",
        type=int,
        default=4,
        help="validation points along the run (a divisor of --steps); the last-quarter mean averages those after 3/4"
        " of the steps, so it needs --evals 8 or more to hold more than the final point",
    )
    parser.add_argument("--val-windows", type=int, default=512, help="validation windows of 128 bytes (all ranks)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[DEFAULT_SEED], help="every configuration runs at each (paired)"
    )
    parser.add_argument(
        "--regime",
        choices=list(REGIMES),
        default=None,
        help=", ".join(f"{n}: lr {lr:g}, warm-up {w}" for n, (lr, w) in REGIMES.items())
        + f" (default: {DEFAULT_REGIME}, the demo YAML's)",
    )
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the regime's)")
    parser.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: the regime's)")
    parser.add_argument(
        "--spike-margin",
        type=float,
        default=0.10,
        help=f"a run spikes when its training loss (trailing mean over {SMOOTHING} steps) exceeds {BASE}'s at the same"
        " seed and step by more than this fraction",
    )
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16-mixed", "32-true"],
        help="auto: bf16-mixed (the demo's) where the CPU has fast bf16 matmuls, else 32-true",
    )
    parser.add_argument(
        "--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(RUNS), help="subset, in this order"
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="the study file: rewritten after every run; its runs done are skipped"
    )
    parser.add_argument("--png", type=Path, default=None, help="the figure (default: the --json path, .png)")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="print the tables of the --json's runs of these --configs and --seeds (and zero3's); run nothing",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        if args.json is None or not args.json.exists():
            parser.error("--report-only reads the study file: give an existing --json")
        report_only(args)
        return
    if args.steps < 1 or args.evals < 1 or args.evals > args.steps:
        parser.error("need 1 <= --evals <= --steps")
    if args.steps % args.evals:
        parser.error("--steps must be a multiple of --evals (the last validation is at the last step)")
    if args.spike_margin <= 0:
        parser.error("--spike-margin must be > 0")
    lr, warmup = REGIMES[args.regime or DEFAULT_REGIME]
    args.lr = lr if args.lr is None else args.lr
    args.warmup = warmup if args.warmup is None else args.warmup
    regime = regime_name(args.lr, args.warmup)
    data = load(args.json)
    runs: list[dict] = data["runs"]
    resumed = [r["precision"] for r in runs if "error" not in r]
    if args.precision == "auto" and resumed:  # the timing below is noisy on a busy machine: a resume keeps the file's
        args.precision = resumed[-1]
        print(f"precision: {args.precision}, as the runs in {args.json} (--precision to choose)")
    elif args.precision == "auto":
        args.precision = "bf16-mixed" if cpu_bf16_is_fast() else "32-true"
        if args.precision == "32-true":
            print("precision: 32-true (this CPU has no fast bf16 matmul; --precision bf16-mixed to force it)")
    for name in args.configs:
        problem = unfit(name, args)
        if problem:
            parser.error(f"{name} cannot run on {args.nodes} x {args.ranks_per_node} ranks: {problem}")
    png = args.png or (args.json.with_suffix(".png") if args.json else None)

    setup = setup_of(args)
    plan = [(name, seed, regime, args.steps) for seed in args.seeds for name in args.configs]  # seed by seed
    clash = conflicts(plan, runs, setup)
    if clash:
        parser.error(f"{args.json} holds these runs with other settings; use another --json:\n  " + "\n  ".join(clash))
    todo = pending(plan, runs)
    data["meta"]["commands"].append(
        " ".join(["python", "benchmarks/convergence.py", *(sys.argv[1:] if argv is None else argv)])
    )
    data["meta"].update(spike_margin=args.spike_margin, smoothing_steps=SMOOTHING)
    minutes = estimate_minutes(len(todo), args.steps, args.evals)
    print(
        f"regime {regime} (lr {args.lr:g}, warm-up {args.warmup}), {args.steps} steps: {len(plan)} runs planned,"
        f" {len(plan) - len(todo)} done already, {len(todo)} to run (~{minutes:.0f} min at 8 ranks fp32 on this"
        " machine)",
        file=sys.stderr,
    )

    def save() -> None:
        data["summary"] = summarize(runs, args.spike_margin)
        if args.json:  # written whole, then renamed (record.write): an interrupted write leaves no half file
            record.write(args.json, data, None if argv is None else [__file__, *argv])

    with tempfile.TemporaryDirectory(prefix="zpp-convergence-") as tmp:
        for name, seed, _, _ in todo:
            started = time.perf_counter()
            result: dict[str, Any] = {"config": name, "seed": seed, "regime": regime, "steps": args.steps, **setup}
            try:
                result.update(run(name, seed, args, Path(tmp)))
            except RuntimeError as err:  # keep the other runs' results; a rerun tries this one again
                print(err, file=sys.stderr)
                result.update(error=str(err)[-3000:], seconds=time.perf_counter() - started)
            add_run(runs, result)
            print(f"{name} seed {seed}: {(time.perf_counter() - started) / 60:.1f} min", file=sys.stderr)
            save()
    save()
    report([e for e in data["summary"] if (e["regime"], e["steps"]) == (regime, args.steps)], args.spike_margin)
    if args.json:
        print(f"wrote {args.json}")
    mine = [r for r in runs if (r["regime"], r["steps"]) == (regime, args.steps) and r.get("val_curve")]
    if png and mine and try_plot(convergence_png, {"meta": data["meta"], "runs": mine}, png):
        print(f"wrote {png}")


def report_only(args: argparse.Namespace) -> None:
    """The tables of the study file's runs of ``args.configs`` (and the baseline) at ``args.seeds``, nothing run."""
    lr, warmup = REGIMES[args.regime or DEFAULT_REGIME]
    regime = regime_name(lr if args.lr is None else args.lr, warmup if args.warmup is None else args.warmup)
    names, seeds = {BASE, *args.configs}, set(args.seeds)
    runs = [r for r in load(args.json)["runs"] if r["config"] in names and r["seed"] in seeds]
    missing = sorted(set(pending([(n, s, regime, args.steps) for s in seeds for n in names], runs)))
    if missing:
        print(f"not in {args.json} (left out): " + ", ".join(f"{n} seed {s}" for n, s, _, _ in missing))
    summary = summarize(runs, args.spike_margin)
    report([e for e in summary if (e["regime"], e["steps"]) == (regime, args.steps)], args.spike_margin)


if __name__ == "__main__":
    main()
