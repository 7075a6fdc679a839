"""What qgZ's INT4 hop does to the gradients and to AdamW's step (``small_coordinates.py``, ``adam_noise.py``), and
the weight error each forward computes with (``weight_error.py``)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from pages import Source, mean_se, pct, table

TITLE = "What INT4 does to gradients and to Adam's step"
QUESTION = """What does INT4 do to the gradients, to AdamW's step and to the weights each forward computes with?

A probe follows qgZ's output against the exact reduce-scatter of the same input at every step of a small run and
feeds both to AdamW (and to SGD with momentum) side by side; a second probe asks whether AdamW's second moment can be
cleared of the rounding noise at zero bytes (the basis of `second_moment_correction`); a third measures the weights
each forward computes with, quantized from scratch or sent as deltas. What the errors cost in training loss is on
[Accuracy](accuracy.md)."""

LONG = "gradient_error/small_coordinates_long.json"
SHORT = "gradient_error/small_coordinates.json"
SHORT_SEED1 = "gradient_error/small_coordinates_seed1.json"
WEIGHTS = "gradient_error/weight_error.json"
NOISE = "gradient_error/adam_noise.json"
NOISE_CONFIGS = "gradient_error/adam_noise_configs.json"
SOURCES = [LONG, SHORT, SHORT_SEED1, WEIGHTS, NOISE, NOISE_CONFIGS]

FP32_RESIDUAL_ONLY = {SHORT_SEED1}
"""Runs made before ``error_feedback_bits`` existed: their residual is fp32, whatever their strategy says."""

ORDER = ["off", "feedback_int8", "feedback_fp32", "sr", "rot", "int8"]
LABEL = {
    "off": "INT4, nearest (the defaults)",
    "feedback_int8": "INT4 + error feedback, INT8 residual",
    "feedback_fp32": "INT4 + error feedback, fp32 residual",
    "sr": "INT4, stochastic rounding",
    "rot": "INT4, Hadamard rotation",
    "int8": "INT8 inter-node hop",
}
BRIEF = {
    "feedback_int8": "error feedback (INT8 residual)",
    "feedback_fp32": "error feedback (fp32 residual)",
    "sr": "stochastic rounding",
    "rot": "Hadamard rotation",
    "int8": "the INT8 hop",
}
NOISE_LABEL = {"qgz": "off", "qgz_sr": "sr", "qgz_feedback": "feedback_int8", "qgz_rot": "rot"}
V_FED = {
    "plain": "`q^2` (what AdamW does)",
    "v_exact": "`e^2` (exact: the best a correction of `v` can do)",
    "every_code": "`q^2 - var`, every code (the runtime's estimate)",
    "codes_nonzero": "`q^2 - var`, codes != 0 only",
}

WEIGHT_GOAL = 1e-3
"""The goal set when weight deltas were built: the forward's relative weight error at most this, with INT4 deltas."""
WEIGHT_CONFIGS = {
    "zeropp": "INT8 weights (the defaults)",
    "zeropp_int4w": "INT4 weights",
    "zeropp_deltas": "INT4 deltas (`weight_deltas=True`)",
    "zeropp_deltas8": "INT8 deltas (`weight_delta_bits=8`)",
}
REGIMES = {"adamw": "AdamW (lr 1e-3, weight decay 0.1)", "sgd": "SGD (lr 0.3, momentum 0.9)"}


def _kind(row: dict, path: str) -> str:
    s = row["strategy"]
    if s.get("gradient_rounding") == "stochastic":
        return "sr"
    if s.get("gradient_rotation", "none") != "none":
        return "rot"
    if s.get("gradient_bits", 4) != 4:
        return "int8"
    if not s.get("gradient_error_feedback"):
        return "off"
    bits = 32 if path in FP32_RESIDUAL_ONLY else s.get("error_feedback_bits", 8)
    return "feedback_fp32" if bits == 32 else "feedback_int8"


def _runs(sources: dict[str, Source]) -> list[tuple[str, int, dict]]:
    """Every probe run as (kind, seed, row), a run in two files counted once (the long file's). Each row gets the
    path of its file under ``"_path"``."""
    runs, seen = [], set()
    for path in (LONG, SHORT, SHORT_SEED1):
        for row in sources[path].data:
            key = (_kind(row, path), row["seed"])
            if key not in seen:
                seen.add(key)
                runs.append((*key, {**row, "_path": path}))
    return runs


def _ms(values: list[float], digits: int = 3) -> str:
    """Mean ± 2 SE, or the one value."""
    m, se = mean_se(values)
    return f"{m:.{digits}f}" if len(values) == 1 else f"{m:.{digits}f} ± {2 * se:.{digits}f}"


def _pct_ms(values: list[float], digits: int = 1) -> str:
    """Mean ± 2 SE of fractions, as percentages."""
    m, se = mean_se(values)
    text = f"{100 * m:.{digits}f}%"
    return text if len(values) == 1 else f"{text} ± {200 * se:.{digits}f}%"


def _seeds(values: list) -> str:
    return ", ".join(str(v) for v in sorted(values))


def _late(runs: list[tuple[str, int, dict]]) -> dict[str, dict[int, dict]]:
    """The long runs' second-half figures, by configuration and seed."""
    by_kind: dict[str, dict[int, dict]] = defaultdict(dict)
    for k, seed, row in runs:
        if "late" in row:
            by_kind[k][seed] = row["late"]
    return by_kind


def _variance(by_kind: dict[str, dict[int, dict]], kind: str) -> list[float]:
    """Per seed, the square of a configuration's error per step over the defaults'."""
    base, late = by_kind.get("off", {}), by_kind.get(kind, {})
    return [(late[s]["rel_err"] / base[s]["rel_err"]) ** 2 for s in sorted(late) if s in base]


def _summary(runs: list[tuple[str, int, dict]], sources: dict[str, Source], weight_goals: str) -> str:
    by_kind = _late(runs)
    off = by_kind.get("off", {})
    lines = []
    if off:
        seeds = sorted(off)

        def col(key: str, kind: str = "off") -> list[float]:
            return [by_kind[kind][s][key] for s in sorted(by_kind[kind])]

        factors = "; ".join(f"{BRIEF[k]} {_ms(_variance(by_kind, k))}x" for k in ORDER[1:] if k in by_kind)
        lines += [
            f"- With the defaults ({len(seeds)} seeds, second half of the long runs), qgZ's output differs from the"
            f" exact reduce-scatter by {_ms(col('rel_err'))} per step (relative L2 error), {_ms(col('rel_err_small'))}"
            f" on the small coordinates. The variance of that error, against the defaults': {factors}.",
            f"- AdamW's steps fed the defaults' gradients are {_ms(col('adam_rest_shadow_norm_ratio'), 4)} (rest) and"
            f" {_ms(col('adam_small_shadow_norm_ratio'), 4)} (small) of the length of AdamW's fed the exact ones: the"
            " rounding noise enters the second moment and shortens every step.",
        ]
    noise = sources[NOISE].data
    if noise:
        cal = [r["summary"]["calibration"]["small"]["every_code"] for r in noise]
        cal_rest = [r["summary"]["calibration"]["rest"]["every_code"] for r in noise]
        along = [r["summary"]["variants"]["every_code"]["small"]["along"] for r in noise]
        lines.append(
            f"- The noise's variance estimated from the block scales alone comes out {_ms(cal, 2)} (small) and"
            f" {_ms(cal_rest, 2)} (rest) of the true squared error ({len(noise)} seeds; 1 is unbiased); fed into the"
            f" second moment it brings the small coordinates' step length along the exact-fed one to {_ms(along, 4)}."
        )
    return "\n".join(lines) + "\n" + weight_goals


def _late_tables(runs: list[tuple[str, int, dict]]) -> tuple[str, str, str]:
    long = [(k, seed, row) for k, seed, row in runs if "late" in row]
    steps = max(row["groups"][-1]["steps"][1] for _, _, row in long)
    by_kind = _late(runs)
    grads, adam = [], []
    for k in ORDER:
        if k not in by_kind:
            continue
        late = by_kind[k]
        seeds = sorted(late)

        def col(key: str, rows: dict[int, dict] = late, seeds: list[int] = seeds) -> list[float]:
            return [rows[s][key] for s in seeds]

        variance = _variance(by_kind, k)
        ratio = "1 (the reference)" if k == "off" else _ms(variance) if variance else "-"
        grads.append([LABEL[k], _seeds(seeds), _ms(col("rel_err")), ratio, _ms(col("rel_err_small")),
                      _ms(col("rel_err_rest")), _ms(col("zeroed")), _ms(col("zeroed_small"))])  # fmt: skip
        adam.append([LABEL[k], _ms(col("adam_rest_shadow_norm_ratio"), 4), _ms(col("adam_small_shadow_norm_ratio"), 4),
                     _ms(col("adam_rest_shadow_rel_err")), _ms(col("adam_small_moved_rel_err")),
                     _ms(col("adam_rest_moved_rel_err")), _pct_ms(col("adam_small_moved_against")),
                     _ms(col("sgd_small_moved_rel_err")), _ms(col("sgd_rest_moved_rel_err"))])  # fmt: skip
    grad_table = table(["qgZ's inter-node hop", "seeds", "error per step", "its variance vs the defaults'",
                        "error, small", "error, rest", "zeroed", "zeroed among small"], grads)  # fmt: skip
    adam_table = table(["qgZ's inter-node hop", "AdamW step length vs exact-fed, rest", "small",
                        "AdamW direction error, rest", "moved vs exact AdamW, small", "rest",
                        "small moved the other way", "SGD + momentum: moved, small", "rest"], adam)  # fmt: skip
    return grad_table, adam_table, f"{steps // 2 + 1}-{steps}"


def _by_group(runs: list[tuple[str, int, dict]], key: str) -> str:
    """``key`` by group of steps (columns: the configurations), mean over the seeds that ran the group."""
    cells: dict[tuple[int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for k, _, row in runs:
        for g in row["groups"]:
            if g.get(key) is not None:
                cells[tuple(g["steps"])][k].append(g[key])
    kinds = [k for k in ORDER if any(k in c for c in cells.values())]
    rows = [[f"{lo}-{hi}", *(_ms(cells[(lo, hi)][k]) if cells[(lo, hi)][k] else "-" for k in kinds)]
            for lo, hi in sorted(cells)]  # fmt: skip
    return table(["steps", *(LABEL[k] for k in kinds)], rows)


def _early(runs: list[tuple[str, int, dict]]) -> str:
    """The first groups of steps (those every run has), every configuration, mean ± 2 SE over its seeds."""
    groups = sorted({tuple(g["steps"]) for _, _, row in runs for g in row["groups"]})
    common = [g for g in groups if all(any(tuple(x["steps"]) == g for x in row["groups"]) for _, _, row in runs)]
    out = []
    for k in ORDER:
        mine = [(seed, row) for kk, seed, row in runs if kk == k]
        if not mine:
            continue
        for lo, hi in common:
            gs = [next(g for g in row["groups"] if tuple(g["steps"]) == (lo, hi)) for _, row in mine]
            out.append([LABEL[k], f"{lo}-{hi}", _seeds([s for s, _ in mine]),
                        *(_ms([g[c] for g in gs]) for c in ("zeroed", "zeroed_small", "small_share", "rel_err_small",
                                                             "rel_err_rest", "summed_rel_err_small",
                                                             "summed_rel_err_rest", "adam_small_rel_err",
                                                             "adam_small_shadow_rel_err"))])  # fmt: skip
    return table(["qgZ's inter-node hop", "steps", "seeds", "zeroed", "zeroed among small", "small share",
                  "error, small", "error, rest", "summed: error, small", "summed: rest",
                  "AdamW small: this step's error", "against exact-fed AdamW"], out)  # fmt: skip


def _residual_widths(runs: list[tuple[str, int, dict]]) -> str:
    """The two residual widths where one invocation ran both (same file, same seed): the largest difference over the
    early table's cells."""
    int8 = {(row["_path"], seed): row for k, seed, row in runs if k == "feedback_int8"}
    fp32 = {(row["_path"], seed): row for k, seed, row in runs if k == "feedback_fp32"}
    pairs = sorted(set(int8) & set(fp32))
    both = [seed for _, seed in pairs]
    if not both:
        return ""
    keys = ("zeroed", "zeroed_small", "rel_err_small", "rel_err_rest", "summed_rel_err_small", "summed_rel_err_rest",
            "adam_small_rel_err", "adam_small_shadow_rel_err", "adam_rest_shadow_rel_err")  # fmt: skip
    diffs = []
    for key in pairs:
        for a in fp32[key]["groups"]:
            b = next((g for g in int8[key]["groups"] if g["steps"] == a["steps"]), None)
            if b is not None:
                diffs += [abs(a[c] - b[c]) for c in keys if a.get(c) is not None and b.get(c) is not None]
    word = "seed" if len(both) == 1 else "seeds"
    caveat = " (one seed: a description, not a conclusion)" if len(both) == 1 else ""
    return (
        f"The two residual widths side by side, in one invocation, at {word} {_seeds(both)}{caveat}: over the groups"
        f" and columns above, the INT8 and the fp32 residual differ by at most {max(diffs):.3f}. The INT8 residual"
        " holds about a byte per element of the residual, the fp32 one four. (The fp32 run at seed 1 predates the"
        " INT8 residual; its INT8 twin is a later run of other code.)"
    )


def _noise(sources: dict[str, Source]) -> tuple[str, str, int]:
    runs = [("off", r) for r in sources[NOISE].data]
    runs += [(NOISE_LABEL.get(r["config"], r["config"]), r) for r in sources[NOISE_CONFIGS].data]
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for k, r in runs:
        by_kind[k].append(r)
    out = []
    for k in ORDER:
        if k not in by_kind:
            continue
        rs = by_kind[k]
        for i, (variant, label) in enumerate(V_FED.items()):
            if variant not in rs[0]["summary"]["variants"]:
                continue

            def v(cls: str, key: str, variant: str = variant, rs: list[dict] = rs) -> list[float]:
                return [r["summary"]["variants"][variant][cls][key] for r in rs]

            calibration = ""
            if variant in rs[0]["summary"]["calibration"]["small"]:
                cal = [[r["summary"]["calibration"][c][variant] for r in rs] for c in ("small", "rest")]
                calibration = f"{_ms(cal[0], 2)} / {_ms(cal[1], 2)}"
            floor = v("small", "floored")
            out.append([f"{LABEL[k]} ({'seed' if len(rs) == 1 else 'seeds'} {_seeds([r['seed'] for r in rs])})"
                        if i == 0 else " ", label, f"{_ms(v('small', 'along'), 4)} / {_ms(v('rest', 'along'), 4)}",
                        f"{_ms(v('small', 'rel_err'))} / {_ms(v('rest', 'rel_err'))}",
                        _pct_ms(floor) if any(floor) else "-", calibration])  # fmt: skip
    steps = {r["steps"] for _, r in runs}
    floors = {r["floor"] for _, r in runs}
    header = ["qgZ", "`v` fed", "along, small / rest", "direction error, small / rest", "floor bound, small",
              "estimate / true squared error, small / rest"]  # fmt: skip
    default = by_kind.get("off", [])
    summary = ""
    if default:

        def along(variant: str, cls: str) -> str:
            return _ms([r["summary"]["variants"][variant][cls]["along"] for r in default], 4)

        cal = {c: _ms([r["summary"]["calibration"][c]["every_code"] for r in default], 2) for c in ("small", "rest")}
        summary = (
            f"- With the defaults ({len(default)} seeds), AdamW's step along the exact-fed one is"
            f" {along('plain', 'small')} on small coordinates and {along('plain', 'rest')} on the rest; fed"
            f" `q^2 - var` (every code) it is {along('every_code', 'small')} / {along('every_code', 'rest')}, and fed"
            f" the exact `e^2` {along('v_exact', 'small')} / {along('v_exact', 'rest')}.\n"
            f"- The runtime's estimate of the noise, from the block scales alone, against the true squared error:"
            f" {cal['small']} on small coordinates, {cal['rest']} on the rest (1 is unbiased). Counting only codes"
            f" != 0 misses the error of coordinates rounded to 0 on one node."
        )
    text = table(header, out)
    floor_text = ", ".join(f"{f:g}" for f in sorted(floors))
    return text, summary, (max(steps), floor_text)


def _weights(rows: list[dict]) -> tuple[str, str, str]:
    out, goals = [], []
    for regime in [r for r in REGIMES if any(x["regime"] == r for x in rows)]:
        rs = {r["config"]: r for r in rows if r["regime"] == regime}
        ref = rs.get("zeropp")
        for config, label in WEIGHT_CONFIGS.items():
            r = rs.get(config)
            if r is None:
                continue
            own = r["strategy_reported_mean"]
            out.append([REGIMES[regime], label, f"{r['mean_error']:.2e}", f"{r['max_error']:.2e}",
                        f"{r['last_error']:.2e}", "-" if own is None else f"{own:.2e}",
                        f"{r['weight_bytes_inter_per_step'] / 1e3:.1f}",
                        f"{r['mean_error'] / ref['mean_error']:.3f}" if ref else "-",
                        f"{r['weight_bytes_inter_per_step'] / ref['weight_bytes_inter_per_step']:.2f}"
                        if ref else "-"])  # fmt: skip
        deltas = rs.get("zeropp_deltas")
        if deltas:
            ok = deltas["mean_error"] <= WEIGHT_GOAL
            c = deltas["curve"]
            skip = next((k for k in range(len(c)) if math.isclose(statistics.fmean(c[k:]), deltas["mean_error"])), 0)
            peak = max(range(skip, len(c)), key=lambda i: c[i]) + 1
            goals.append(
                f"- {REGIMES[regime]}: INT4 deltas' mean forward weight error at most {WEIGHT_GOAL:g}:"
                f" **{'met' if ok else 'NOT met'}** ({deltas['mean_error']:.2e}; its largest,"
                f" {deltas['max_error']:.2e}, at step {peak})"
            )
    steps = {r["steps"] for r in rows}
    c = rows[0]["curve"]
    skip = next((k for k in range(len(c)) if math.isclose(statistics.fmean(c[k:]), rows[0]["mean_error"])), 0)
    window = f"steps {skip + 1} to {max(steps)}"
    header = ["regime", "weights", "forward weight error, mean", "max", "last step", "the strategy's own figure, mean",
              "weight KB / step to the other node", "error vs INT8 weights'", "bytes vs INT8 weights'"]  # fmt: skip
    return table(header, out), "\n".join(goals), window


def _legend_gradients(probe: dict) -> str:
    return table(["", ""], [
        ["error per step", f"`‖q - e‖ / ‖e‖` over all coordinates; *small*: `|e|` below {probe['small_below']:g} of its"
         " block's largest, about where INT4 rounds to 0; *rest*: the others"],
        ["its variance vs the defaults'", "the square of the error per step over the defaults' at the same seed"],
        ["zeroed", "the share of coordinates with `e != 0` that arrive as exactly 0"],
    ])  # fmt: skip


def _legend_adam(probe: dict) -> str:
    return table(["", ""], [
        ["AdamW step length vs exact-fed", "the norm of AdamW's direction from the run's moments over that from"
         " moments fed the exact gradients (the same trajectory): below 1, shorter steps, an effective learning-rate"
         " cut"],
        ["direction error", "the relative distance between those two directions"],
        ["moved vs exact", "the directions summed over each group of steps, relative distance: how far each coordinate"
         " moved against how far exact gradients would have moved it"],
        ["small moved the other way", "the share of small coordinates whose summed move has the opposite sign to the"
         " exact one"],
        ["SGD + momentum", f"the same, for SGD with momentum {probe.get('sgd_shadow_momentum', '-')} fed each way: an"
         " optimizer whose step is linear in the gradient"],
    ])  # fmt: skip


def render(sources: dict[str, Source]) -> str:
    runs = _runs(sources)
    grads, adam, late = _late_tables(runs)
    noise, noise_summary, (noise_steps, floor) = _noise(sources)
    weights, weight_goals, window = _weights(sources[WEIGHTS].data)
    probe = sources[LONG].data[0]
    model = probe["model"]
    opt = probe["optimizer"]
    return f"""## Summary

{_summary(runs, sources, weight_goals)}

## The gradients and AdamW's step, second half of the long runs

The probe (`benchmarks/small_coordinates.py`): {probe["nodes"] * probe["ranks_per_node"]} gloo ranks as
{probe["nodes"]} nodes x {probe["ranks_per_node"]}, the example GPT in a small shape ({model["n_layer"]} layers,
n_embd {model["n_embd"]}, {model["n_head"]} heads, {probe["params"]:,} parameters), fp32, AdamW (betas
{opt["betas"][0]} / {opt["betas"][1]}) at a constant lr {opt["lr"]:g}. Before every qgZ reduction the exact
reduce-scatter of the same input runs on a clone (training never sees it), and qgZ's output `q` is compared with the
exact `e` in the unit's own gradient blocks. Figures of steps {late}, mean ± 2 SE over the seeds.

{grads}

{_legend_gradients(probe)}

Stochastic rounding's error on a coordinate spreads over a whole INT4 step where nearest rounding's stays within half
of one, and error feedback sends each step its own rounding error minus the last one: at the same bytes, both raise
the variance of each step's error, by the factor in the table.

{adam}

{_legend_adam(probe)}

AdamW's second moment absorbs the error's variance, and that shortens every step; under SGD with momentum feedback's
correct sum would carry through. Why that costs loss, and the learning-rate check that separates the shorter step from
the noise, are on [Accuracy](accuracy.md).

### Over the run

AdamW's direction on the small coordinates against AdamW fed the exact gradients from the start, by group of steps
(mean ± 2 SE over the seeds that ran the group): young moments normalise each coordinate to about the sign of its
gradient, so a zeroed coordinate loses its whole update in the first steps.

{_by_group(runs, "adam_small_shadow_rel_err")}

### The first steps, every run

Every probe run, the long ones and the 30-step ones (which also compare the residual's widths), over the groups of
steps they share. *Summed*: the gradients summed over the group's steps, `Σq` against `Σe`: what a slow average of
the gradients sees, and what error feedback corrects. *AdamW small, this step's error*: the run's moments stepped
with `q` against the same moments stepped with `e`; *against exact-fed AdamW*: against a state fed `e` from the
start.

{_early(runs)}

{_residual_widths(runs)}

Per-step and per-unit figures of the 30-step runs are in `benchmarks/data/{SHORT}` and
`benchmarks/data/{SHORT_SEED1}`.

## The noise in AdamW's second moment, and its estimate

AdamW's second moment `v` averages `(g + n)^2`, whose mean is `g^2 + var(n)`: qgZ's rounding noise `n` lengthens the
denominator and shortens every step. The rank that sums a chunk's pieces (qgZ's last step) holds each piece's block
scales, so it can estimate each coordinate's noise variance without a byte more on the wire. The probe
(`benchmarks/adam_noise.py`: the same model and ranks, {noise_steps} steps) follows the run with Adam states fed the
run's `q` in their first moment and `v` fed four ways, each compared with a state fed the exact gradients in both
moments, over the second half. *Along*: the length of the update's component along the exact-fed update (the
effective learning rate; 1 is exact). *Floor bound*: where `v` would have dropped below {floor} of the uncorrected
`v` and was held there. *Estimate / true*: the estimated noise variance summed, over the true squared error summed
(1 is unbiased). This is the basis of `second_moment_correction=True`, which feeds `v` the every-code estimate.

{noise}

{noise_summary}

## The weights each forward computes with

`benchmarks/weight_error.py`: 4 gloo ranks as 2 nodes x 2 train a small model (qgZ on in every row); at every step
rank 0 gathers the exact weights (not through the strategy's collectives) before the forward and compares them with
what each module's forward used: the relative L2 error over the model, mean and max over {window}, and at the last
step. *The strategy's own figure*: what weight deltas report themselves (`WeightDeltas.error()`). *Weight KB / step*:
the weights' cross-node bytes per rank per step from the ledger. One run per row.

{weights}

Goal, the forward's weight error with INT4 deltas:

{weight_goals}

A delta's error is a share of what the step changed (INT4: a block's scale is its largest change over 7), so deltas
win by how little a step moves the weights: AdamW's steps are small, the SGD regime's (the test model's) far larger.
`weight_delta_bits=8` is the choice for training whose weights move fast."""  # fmt: skip


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    off = _late(_runs(sources)).get("off", {})
    ratios = [off[s]["adam_rest_shadow_norm_ratio"] for s in sorted(off)]
    m, _ = mean_se(ratios)
    return {"step_shortening": f"{pct(1 - m, 2, sign=False)} ({len(ratios)} seeds, second half of the probe's runs)"}
