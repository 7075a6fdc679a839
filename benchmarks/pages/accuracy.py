"""Loss against exact ZeRO-3 over the length of a run, by configuration, seeds paired (``convergence.py``)."""

from __future__ import annotations

import math
from typing import Any

from convergence import halves, last_quarter

from pages import Source, interval, mean_se, pct, table

TITLE = "Loss against ZeRO-3"
QUESTION = """How far is the loss of each configuration from exact ZeRO-3's, and does the gap grow with training?

The example GPT on 4 emulated nodes x 2 CPU ranks, AdamW, trained from the same seed by every configuration;
`convergence.py` records each run's training and validation curves, and this page pairs them by seed."""

STUDY = "accuracy/convergence_calm_fp32.json"
LONG = "accuracy/convergence_calm_fp32_1000.json"
BF16 = "accuracy/convergence_calm_bf16.json"
QHSDP = "accuracy/convergence_calm_fp32_100.json"
BF16_100 = "accuracy/convergence_calm.json"
AGGRESSIVE = "accuracy/convergence_aggressive.json"
LR_CUT = "accuracy/convergence_lr_cut.json"
LR_BOOST = "accuracy/convergence_lr_boost.json"
SOURCES = [STUDY, LONG, BF16, QHSDP, BF16_100, AGGRESSIVE, LR_CUT, LR_BOOST]

BASE = "zero3"
DEFAULTS = "zeropp+smc"
"""The defaults today: the stored runs predate the correction's "auto" default, so ``zeropp`` is ZeRO++ without the
correction and ``zeropp+smc`` is what a user gets (``convergence.py``'s RUNS)."""

MEANING = {
    "zeropp+smc-matrices": "**the defaults** since 2026-12-07 09:55 (qwZ INT8, hpZ, qgZ INT8 then INT4, the"
    ' second-moment correction on matrices: `second_moment_scope="matrices"`)',
    "zeropp+smc-vectors": "the defaults with norm gains and biases reduced exactly"
    ' (`gradient_quantization_scope="matrices"`; the default from 2026-12-07 12:08 until the cluster measured its'
    " step)",
    "zeropp+smc": "the defaults until 2026-12-07: the second-moment correction on every parameter"
    ' (`second_moment_scope="all"`)',
    "zeropp": "the defaults without the second-moment correction",
    "zeropp+ef1+smc": "the defaults + `gradient_error_feedback=True`",
    "zeropp+ef1": "without the correction, + error feedback (decay 1.0)",
    "zeropp+ef": "without the correction, + error feedback (decay 0.8, the old default decay)",
    "zeropp-qgz8": "without the correction, `gradient_bits=8`",
    "zeropp-qgz-half": "without the correction, `quantize_gradients_steps` = half the run",
    "zeropp-qwz-only": "qwZ and hpZ only (`quantize_gradients=False`)",
    "zeropp-qgz-only": "qgZ only (`quantize_weights=False`, no hpZ)",
    "zeropp+rot": 'without the correction, `gradient_rotation="hadamard"`',
    "zeropp+sr": 'without the correction, `gradient_rounding="stochastic"`',
    "zeropp-deltas+ef": "without the correction, `weight_deltas=True` + error feedback (decay 0.8)",
    "qhsdp": '`strategy="qhsdp"` (INT4 reduce-scatter, INT8 all-gather across nodes)',
    "qhsdp-int4": "qhsdp with `hsdp_gather_bits=4`",
    "qhsdp-int4+ef": "qhsdp with `hsdp_gather_bits=4` and error feedback",
}

LINE = 0.001
"""The accuracy line of the rule for a default (docs/decisions.md): a mean paired gap within 0.1% at the study's
resolution."""

FEEDBACK_MIN_SEEDS = 8
"""The feedback rule's minimum seeds (docs/decisions.md, 2026-12-06)."""

Runs = dict[str, dict[int, dict[str, Any]]]


# ------------------------------------------------------------------------------------------------ measures


def _runs(source: Source, steps: int, precision: str | None = None, regime: str | None = None) -> Runs:
    """The finished runs at ``steps`` (and precision, regime), by config and seed."""
    out: Runs = {}
    for r in source.data["runs"]:
        if "error" in r or not r.get("val_curve") or r["steps"] != steps:
            continue
        if (precision and r["precision"] != precision) or (regime and r["regime"] != regime):
            continue
        out.setdefault(r["config"], {})[r["seed"]] = r
    return out


def _measure(run: dict[str, Any], what: str) -> float:
    steps = run["steps"]
    if what == "first_half":
        return halves(run["train_curve"], steps)[0]
    if what == "second_half":
        return halves(run["train_curve"], steps)[1]
    if what == "last_quarter":
        return last_quarter(run["val_curve"], steps)[0]
    if what == "final":
        return run["val_curve"][-1][1]
    raise ValueError(what)


def gaps(runs: dict[int, dict], base: dict[int, dict], what: str) -> list[tuple[int, float]]:
    """(seed, relative gap) at every seed both have: ``(run - base) / base`` of the measure ``what``."""
    out = []
    for seed in sorted(set(runs) & set(base)):
        b = _measure(base[seed], what)
        out.append((seed, (_measure(runs[seed], what) - b) / b))
    return out


def _values(pairs: list[tuple[int, float]]) -> list[float]:
    return [g for _, g in pairs]


def _cell(pairs: list[tuple[int, float]]) -> str:
    return interval(_values(pairs)) if pairs else "-"


def verdict(pairs: list[tuple[int, float]], line: float = LINE) -> str:
    """The rule's reading of a gap: met when the mean and its resolution (2 SE) lie within the line, NOT met when
    they lie beyond it, undecided otherwise; one seed gives no verdict."""
    values = _values(pairs)
    if len(values) < 2:
        return "no verdict (one seed)"
    m, se = mean_se(values)
    if abs(m) + 2 * se <= line:
        return "met"
    if abs(m) - 2 * se > line:
        return "NOT met"
    return "undecided"


def windows(runs: dict[int, dict], base: dict[int, dict], width: int = 50) -> list[tuple[int, int, list[float]]]:
    """The training-loss gap per window of ``width`` steps: (first step, last step, gap per paired seed)."""
    seeds = sorted(set(runs) & set(base))
    if not seeds:
        return []
    steps = runs[seeds[0]]["steps"]
    out = []
    for start in range(1, steps + 1, width):
        end = min(start + width - 1, steps)
        per_seed = []
        for s in seeds:
            mine = [v for t, v in runs[s]["train_curve"] if start <= t <= end]
            theirs = [v for t, v in base[s]["train_curve"] if start <= t <= end]
            if mine and theirs:
                a, b = sum(mine) / len(mine), sum(theirs) / len(theirs)
                per_seed.append((a - b) / b)
        out.append((start, end, per_seed))
    return out


def _seeds(pairs: list[tuple[int, float]]) -> str:
    return ", ".join(str(s) for s, _ in pairs)


def _per_seed(pairs: list[tuple[int, float]]) -> str:
    return ", ".join(f"{s}: {pct(g)}" for s, g in pairs)


# ------------------------------------------------------------------------------------------------ sections


def _study_table(runs: Runs, order: list[str]) -> str:
    base = runs.get(BASE, {})
    rows = []
    for config in order:
        if config not in runs:
            continue
        second = gaps(runs[config], base, "second_half")
        rows.append([
            f"`{config}`", MEANING.get(config, ""), len(second), _cell(gaps(runs[config], base, "first_half")),
            _cell(second), _cell(gaps(runs[config], base, "final")), _cell(gaps(runs[config], base, "last_quarter")),
            verdict(second),
        ])  # fmt: skip
    header = ["config", "what", "seeds", "first half", "second half", "final validation", "last quarter (validation)",
              "second half, by the 0.1% rule"]  # fmt: skip
    return table(header, rows)


def _order(runs: Runs) -> list[str]:
    known = [c for c in MEANING if c in runs]
    return known + sorted(c for c in runs if c not in MEANING and c != BASE)


def _window_table(by_config: dict[str, tuple[dict, dict]]) -> str:
    columns = {name: windows(runs, base) for name, (runs, base) in by_config.items()}
    first = next(iter(columns.values()))
    rows = []
    for i, (start, end, _) in enumerate(first):
        row: list[Any] = [f"{start}-{end}"]
        for name in by_config:
            values = columns[name][i][2]
            row.append(pct(mean_se(values)[0]) if values else "-")
        rows.append(row)
    return table(["steps", *[f"`{n}` (mean over its seeds)" for n in by_config]], rows)


def _paired_configs(runs: Runs, a: str, b: str, what: str = "second_half") -> list[tuple[int, float]]:
    """(seed, (a - b) / b) of the measure, at the seeds both configurations ran."""
    return gaps(runs.get(a, {}), runs.get(b, {}), what)


def _feedback_rule(pairs: list[tuple[int, float]]) -> str:
    values = _values(pairs)
    if len(values) < FEEDBACK_MIN_SEEDS:
        return f"no verdict: {len(values)} seeds of the {FEEDBACK_MIN_SEEDS} the rule needs"
    m, se = mean_se(values)
    if m + 2 * se < 0:
        return "**met**: resolved lower than the defaults; feedback becomes the default"
    return "**not met**: not resolved lower than the defaults; feedback stays opt-in"


SCOPE_CANDIDATE = "zeropp+smc-matrices"
SCOPE_SEEDS = (1, 2, 3)
"""The decisions log's rule of 2026-12-07, its 1-D half: the correction on matrices only, seeds 1-3 at 500 steps."""


def scope_rule_1d(pairs: list[tuple[int, float]]) -> str:
    """``holds`` unless the candidate's second half is resolved worse than the defaults' (paired mean - 2 SE > 0),
    ``fails`` if it is; ``not run`` before the rule's seeds are all in."""
    if len(pairs) < len(SCOPE_SEEDS):
        return f"not run ({len(pairs)} of the {len(SCOPE_SEEDS)} seeds)"
    m, se = mean_se(_values(pairs))
    return "fails: resolved worse than the defaults" if m - 2 * se > 0 else "holds: not resolved worse"


VECTORS_CANDIDATE, VECTORS_AGAINST = "zeropp+smc-vectors", SCOPE_CANDIDATE
"""The decisions log's rule of 2026-12-07 12:08, its 1-D half: norm gains and biases reduced exactly, against the
defaults of that hour (every gradient quantized, the correction on matrices)."""


def _not_worse_section(s500: Runs, base: dict[int, dict], candidate: str, against: str, intro: str) -> str:
    """A rule's 1-D half (:func:`scope_rule_1d`): ``intro``, then the candidate's and ``against``'s second-half gaps
    to ZeRO-3 at the rule's seeds, their paired difference, and the verdict."""
    pairs = [(s, g) for s, g in _paired_configs(s500, candidate, against) if s in SCOPE_SEEDS]
    mine = [(s, g) for s, g in gaps(s500.get(candidate, {}), base, "second_half") if s in SCOPE_SEEDS]
    theirs = [(s, g) for s, g in gaps(s500.get(against, {}), base, "second_half") if s in SCOPE_SEEDS]
    return f"""{intro}

{table(["measure", "per seed", "over the seeds"], [
    [f"`{candidate}` against ZeRO-3, second half", _per_seed(mine), _cell(mine)],
    [f"`{against}` against ZeRO-3, second half (the same seeds)", _per_seed(theirs), _cell(theirs)],
    [f"`{candidate}` against `{against}`, second half", _per_seed(pairs), _cell(pairs)],
])}

The 1-D half: **{scope_rule_1d(pairs)}**."""  # fmt: skip


BF16_PLANNED, BF16_CLOSE = 3, 5
"""The bf16 study's seeds (decisions log, 2026-12-06): 3 planned; 5 when the answer at 3 is close."""


def bf16_rule(pairs: list[tuple[int, float]], defaults: list[tuple[int, float]]) -> str:
    """The verdict of the rule fixed before the bf16 study's runs, from the paired second-half gaps of the correction
    against none (``pairs``) and of the defaults against ZeRO-3 (``defaults``): resolved worse (mean - 2 SE > 0) at
    any count of seeds from the planned 3 stands the correction down; close (the interval holds 0 with a mean above
    0, or the defaults' interval holds the 0.1% line) asks for seeds 4 and 5 first; otherwise, and when still close
    at 5 seeds, the correction stays the default."""
    values = _values(pairs)
    if len(values) < BF16_PLANNED:
        return f"**no verdict yet**: {len(values)} of the {BF16_PLANNED} paired seeds the rule needs have run"
    m, se = mean_se(values)
    if m - 2 * se > 0:
        return f'**resolved worse** at {len(values)} seeds: "auto" stands down under bf16 precisions'
    dm, dse = mean_se(_values(defaults)) if len(defaults) > 1 else (0.0, 0.0)
    close = (m > 0 and m - 2 * se <= 0 <= m + 2 * se) or (dm - 2 * dse <= LINE <= dm + 2 * dse)
    if close and len(values) < BF16_CLOSE:
        return f"**close** at {len(values)} seeds: seeds up to {BF16_CLOSE} run before any verdict"
    how = f", close at {len(values)} seeds too" if close else ""
    return f"**not worse** at {len(values)} seeds{how}: the correction stays the default in bf16-mixed"


def _cross(source: Source, base: Source, config: str, steps: int) -> list[list[Any]]:
    """Rows of one configuration's runs in their own regime against calm ZeRO-3 at the same seed."""
    runs = {s: r for s, r in _runs(source, steps).get(config, {}).items()}
    zero3 = _runs(base, steps, regime="calm").get(BASE, {})
    rows = []
    for what, label in (("first_half", "first half"), ("second_half", "second half"), ("final", "final validation")):
        pairs = gaps(runs, zero3, what)
        rows.append([label, _per_seed(pairs), _cell(pairs) if len(pairs) > 1 else "-"])
    return rows


def render(sources: dict[str, Source]) -> str:
    study, long, bf16 = sources[STUDY], sources[LONG], sources[BF16]
    s500 = _runs(study, 500, "32-true", "calm")
    s1000 = _runs(long, 1000, "32-true", "calm")
    base500, base1000 = s500.get(BASE, {}), s1000.get(BASE, {})
    spread = [_measure(r, "final") for r in base500.values()]
    m, _ = mean_se(spread)
    zero3_spread = (max(spread) - min(spread)) / m if spread else math.nan

    parts = [
        """## How to read it

- **gap**: `(config - zero3) / zero3` at the same seed, of: the mean training loss over the first or the second
  half of the steps, the final validation loss, the mean validation loss over the last quarter. The second half's
  training loss, paired step by step, is the steadiest measure and the one where a cost that grows with training
  shows.
- **mean ± 2 SE (n seeds)**: over the paired seeds; 2 SE is the study's resolution (a mean inside it is not told
  apart from zero). One seed is an anecdote: it gets no verdict.
- **the 0.1% rule**: a setting may be a default when its mean paired gap lies within 0.1% at the study's resolution
  ([decisions log](../decisions.md)); *met*: the interval lies inside 0.1%; *NOT met*: it lies beyond; *undecided*:
  it straddles the line.""",
        f"""## 500 steps, fp32: every configuration against ZeRO-3

ZeRO-3's own final validation losses over its {len(spread)} seeds spread by {pct(zero3_spread, 2, sign=False)} of
their mean: seed-to-seed noise that pairing by seed takes out.

{_study_table(s500, _order(s500))}

![training-loss gap against ZeRO-3, 500 steps](../../benchmarks/data/accuracy/convergence_calm_fp32_500.png)""",
        f"""## Does the gap grow with training?

The training-loss gap against ZeRO-3 per window of 50 steps, the mean over each configuration's paired seeds.

500 steps:

{_window_table({c: (s500[c], base500) for c in ("zeropp", DEFAULTS, "zeropp+ef1+smc") if c in s500})}

1000 steps:

{_window_table({c: (s1000[c], base1000) for c in ("zeropp", DEFAULTS, "zeropp+ef1+smc") if c in s1000})}

By length, second half against ZeRO-3:

{
            table(
                ["config", "500 steps (per seed)", "500 steps", "1000 steps (per seed)", "1000 steps"],
                [
                    [
                        f"`{c}`",
                        _per_seed(gaps(s500.get(c, {}), base500, "second_half")),
                        _cell(gaps(s500.get(c, {}), base500, "second_half")),
                        _per_seed(gaps(s1000.get(c, {}), base1000, "second_half")),
                        _cell(gaps(s1000.get(c, {}), base1000, "second_half")),
                    ]
                    for c in ("zeropp", DEFAULTS, "zeropp+ef1+smc")
                ],
            )
        }""",  # fmt: skip
    ]

    correction = _paired_configs(s500, DEFAULTS, "zeropp")
    correction_long = _paired_configs(s1000, DEFAULTS, "zeropp")
    feedback = _paired_configs(s500, "zeropp+ef1+smc", DEFAULTS)
    parts.append(f"""## The decisions, evaluated from the runs

The rules were fixed before their runs ([decisions log](../decisions.md)); each line is computed here from the data.

**The second-moment correction** (the default since 2026-12-05), second half, with it against without it at the
same seed: 500 steps {_cell(correction)}; 1000 steps {_cell(correction_long)} ({_per_seed(correction_long)}).
The defaults against ZeRO-3 by the 0.1% rule, second half at 500 steps: **{verdict(gaps(s500.get(DEFAULTS, {}),
base500, "second_half"))}** ({_cell(gaps(s500.get(DEFAULTS, {}), base500, "second_half"))}).

**Error feedback as a default** (rule fixed 2026-12-06: lower than the defaults over the second half at 500 steps,
the paired interval below 0, at least {FEEDBACK_MIN_SEEDS} seeds): the defaults + feedback against the defaults
{_cell(feedback)}, lower at {sum(g < 0 for _, g in feedback)} of {len(feedback)} seeds: {_feedback_rule(feedback)}.
""")  # fmt: skip

    b = _runs(bf16, 500, "bf16-mixed", "calm")
    bbase = b.get(BASE, {})
    smc_vs_none = _paired_configs(b, DEFAULTS, "zeropp")
    defaults_bf16 = gaps(b.get(DEFAULTS, {}), bbase, "second_half")
    done = sorted(f"`{c}` seed {s}" for c, rs in b.items() for s in rs)
    parts.append(f"""## bf16-mixed, 500 steps: the correction under bf16

Rule fixed 2026-12-06 before the first run ([decisions log](../decisions.md)): the correction stays the default in
bf16-mixed unless, paired by seed, its second half is resolved worse than the defaults without it (mean - 2 SE > 0);
close (its interval holds 0 with a mean above 0, or the defaults' interval against ZeRO-3 holds 0.1%): seeds 4 and 5
first; at 5 seeds the verdict is final. Planned: seeds 1-3 of `zero3`, `zeropp+smc`, `zeropp`.

Runs done: {", ".join(done) or "none"}.

{table(["measure", "per seed", "over the seeds"], [
    ["the defaults against ZeRO-3, second half", _per_seed(defaults_bf16), _cell(defaults_bf16)],
    ["the defaults against ZeRO-3, final validation", _per_seed(gaps(b.get(DEFAULTS, {}), bbase, "final")), "-"],
    ["with the correction against without, second half", _per_seed(smc_vs_none), _cell(smc_vs_none)],
])}

Verdict: {bf16_rule(smc_vs_none, defaults_bf16)}.""")  # fmt: skip

    parts.append(
        _not_worse_section(
            s500,
            base500,
            VECTORS_CANDIDATE,
            VECTORS_AGAINST,
            f"""## Norm gains and biases \
reduced exactly: the decisions log's rule, its 1-D half

Rule fixed 2026-12-07 12:08 before its runs ([decisions log](../decisions.md)):
`gradient_quantization_scope="matrices"` (the gradients of parameters of fewer than two dimensions reduce-scattered
exactly beside qgZ) replaces `"all"` if its 2-D half holds ([Loss with tensor
parallelism](tensor_parallel_accuracy.md)), its bytes stay within the rule's bounds, and here, at 500 steps, seeds
{", ".join(map(str, SCOPE_SEEDS))}, its second half is not resolved worse than the defaults' of that hour
(`{VECTORS_CANDIDATE}` against `{VECTORS_AGAINST}`, paired: mean - 2 SE <= 0).""",
        )
    )
    parts.append(
        _not_worse_section(
            s500,
            base500,
            SCOPE_CANDIDATE,
            DEFAULTS,
            f"""## The correction on matrices \
only: the decisions log's rule, its 1-D half

Rule fixed 2026-12-07 before its runs ([decisions log](../decisions.md)): `second_moment_scope="matrices"` (the
correction on parameters of two or more dimensions; norm gains and biases keep their second moment) replaces `"all"`
if its 2-D half holds ([Loss with tensor parallelism](tensor_parallel_accuracy.md)) and here, at 500 steps, seeds
{", ".join(map(str, SCOPE_SEEDS))}, its second half is not resolved worse than the defaults' (`{SCOPE_CANDIDATE}`
against `{DEFAULTS}`, paired: mean - 2 SE <= 0).""",
        )
    )

    q = _runs(sources[QHSDP], 100, "32-true")
    parts.append(f"""## Quantized HSDP, 100 steps, fp32

{_study_table(q, _order(q))}""")

    old = _runs(sources[BF16_100], 100, "bf16-mixed")
    parts.append(f"""## bf16-mixed, 100 steps, before the correction existed

{_study_table(old, _order(old))}""")

    agg = _runs(sources[AGGRESSIVE], 40)
    spikes = [s for s in sources[AGGRESSIVE].data.get("summary", []) for c in s["configs"]]
    spiking = sum(c["spikes"]["runs"] for s in sources[AGGRESSIVE].data.get("summary", []) for c in s["configs"]
                  if "spikes" in c)  # fmt: skip
    parts.append(f"""## The aggressive regime, 40 steps (a learning rate that spikes)

{_study_table(agg, _order(agg))}

Runs whose smoothed training loss left ZeRO-3's by the study's spike margin: {spiking if spikes else "-"}.""")

    parts.append(f"""## The mechanism: a learning-rate check both ways

ZeRO-3 with its learning rate cut by 1% (`{LR_CUT}`), and ZeRO++ without the correction with its learning rate raised
by its measured step shortening (`{LR_BOOST}`), each against calm ZeRO-3 at the same seed. If INT4's noise shortens
Adam's step, a shorter step alone should reproduce the gap, and a longer one remove it.

ZeRO-3, lr x 0.99:

{table(["measure", "per seed", "over the seeds"], _cross(sources[LR_CUT], study, BASE, 500))}

ZeRO++ without the correction, lr x 1.0045:

{table(["measure", "per seed", "over the seeds"], _cross(sources[LR_BOOST], study, "zeropp", 500))}""")
    return "\n\n".join(parts)


def _lower(pairs: list[tuple[int, float]]) -> str:
    """A paired difference with how many of its seeds it is below zero at: ``-0.071% ± 0.065% (10 seeds), lower at
    8 of 10 seeds``."""
    return f"{_cell(pairs)}, lower at {sum(g < 0 for _, g in pairs)} of {len(pairs)} seeds"


CANDIDATES = {
    "zeropp+rot": '`gradient_rotation="hadamard"`',
    "zeropp+sr": '`gradient_rounding="stochastic"`',
    "zeropp+ef1": "`gradient_error_feedback=True` (decay 1.0)",
    "zeropp-qgz-half": "`quantize_gradients_steps` = half the run",
}
"""The remedies tried on ZeRO++ without the correction, in the docs' table of them (``snippets()``'s ``candidates``)."""


def _candidates(s500: Runs, base: dict[int, dict]) -> str:
    """Each remedy against ZeRO-3, and against ZeRO++ without the correction at the same seeds, over both halves."""
    rows = []
    for config, setting in CANDIDATES.items():
        if config not in s500:
            continue
        second = _paired_configs(s500, config, "zeropp")
        first = _paired_configs(s500, config, "zeropp", "first_half")
        higher = sum(g > 0 for _, g in second)
        rows.append([setting, _cell(gaps(s500[config], base, "second_half")), _cell(second), _cell(first),
                     f"{higher} of {len(second)}"])  # fmt: skip
    return table(["added to ZeRO++ without the correction", "second half, against ZeRO-3",
                  "second half, against without it", "first half, against without it",
                  "seeds where the second half is higher"], rows)  # fmt: skip


HEADLINES = {
    STUDY: [("the defaults against ZeRO-3, second half", "matrices_second_half"),
            ("norm gains and biases exact against quantized", "vectors_vs_matrices")],
}  # fmt: skip
"""Per data file, the figures ``benchmarks/RESULTS.md`` shows beside its newest run (snippet names)."""


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    s500 = _runs(sources[STUDY], 500, "32-true", "calm")
    s1000 = _runs(sources[LONG], 1000, "32-true", "calm")
    base500, base1000 = s500.get(BASE, {}), s1000.get(BASE, {})
    feedback = gaps(s500.get("zeropp+ef1+smc", {}), base500, "second_half")
    at_feedback_seeds = {s: r for s, r in s500.get(DEFAULTS, {}).items() if s in dict(feedback)}
    long = gaps(s1000.get(DEFAULTS, {}), base1000, "second_half")
    long_without = gaps(s1000.get("zeropp", {}), base1000, "second_half")
    without = windows(s500.get("zeropp", {}), base500)
    qgz_only = gaps(s500.get("zeropp-qgz-only", {}), base500, "second_half")
    at_qgz_only_seeds = {s: r for s, r in s500.get("zeropp", {}).items() if s in dict(qgz_only)}
    feedback_vs_defaults = _paired_configs(s500, "zeropp+ef1+smc", DEFAULTS)
    q = _runs(sources[QHSDP], 100, "32-true")
    old = _runs(sources[BF16_100], 100, "bf16-mixed")
    scope = [(s, g) for s, g in _paired_configs(s500, SCOPE_CANDIDATE, DEFAULTS) if s in SCOPE_SEEDS]
    vectors = [(s, g) for s, g in _paired_configs(s500, VECTORS_CANDIDATE, VECTORS_AGAINST) if s in SCOPE_SEEDS]
    return {
        "vectors_second_half": _cell(gaps(s500.get(VECTORS_CANDIDATE, {}), base500, "second_half")),
        "vectors_final": _cell(gaps(s500.get(VECTORS_CANDIDATE, {}), base500, "final")),
        "vectors_vs_matrices": _cell(vectors),
        "vectors_1d": scope_rule_1d(vectors),
        "matrices_second_half": _cell(gaps(s500.get(SCOPE_CANDIDATE, {}), base500, "second_half")),
        "matrices_final": _cell(gaps(s500.get(SCOPE_CANDIDATE, {}), base500, "final")),
        "matrices_vs_all": _cell(scope),
        "scope_1d": scope_rule_1d(scope),
        "defaults_second_half": _cell(gaps(s500.get(DEFAULTS, {}), base500, "second_half")),
        "defaults_verdict": verdict(gaps(s500.get(DEFAULTS, {}), base500, "second_half")),
        "defaults_final": _cell(gaps(s500.get(DEFAULTS, {}), base500, "final")),
        "defaults_first_half": _cell(gaps(s500.get(DEFAULTS, {}), base500, "first_half")),
        "no_correction_second_half": _cell(gaps(s500.get("zeropp", {}), base500, "second_half")),
        "no_correction_first_half": _cell(gaps(s500.get("zeropp", {}), base500, "first_half")),
        "no_correction_final": _cell(gaps(s500.get("zeropp", {}), base500, "final")),
        "no_correction_verdict": verdict(gaps(s500.get("zeropp", {}), base500, "second_half")),
        "no_correction_first_50": pct(mean_se(without[0][2])[0], 2),
        "no_correction_last_50": pct(mean_se(without[-1][2])[0], 2),
        "no_correction_1000": ", ".join(pct(g) for _, g in long_without) + f" ({len(long_without)} seeds)",
        "defaults_1000": ", ".join(pct(g) for _, g in long) + f" ({len(long)} seeds)",
        "correction_second_half": _lower(_paired_configs(s500, DEFAULTS, "zeropp")),
        "correction_first_half": _cell(_paired_configs(s500, DEFAULTS, "zeropp", "first_half")),
        "correction_1000": _cell(_paired_configs(s1000, DEFAULTS, "zeropp")),
        "feedback_second_half": _cell(feedback),
        "defaults_at_feedback_seeds": _cell(gaps(at_feedback_seeds, base500, "second_half")),
        "feedback_vs_defaults": _lower(feedback_vs_defaults),
        "feedback_vs_defaults_1000": _cell(_paired_configs(s1000, "zeropp+ef1+smc", DEFAULTS)),
        "feedback_verdict": _feedback_rule(feedback_vs_defaults),
        "qgz8_second_half": _cell(gaps(s500.get("zeropp-qgz8", {}), base500, "second_half")),
        "qgz8_vs_no_correction": _lower(_paired_configs(s500, "zeropp-qgz8", "zeropp")),
        "qgz_half_second_half": _cell(gaps(s500.get("zeropp-qgz-half", {}), base500, "second_half")),
        "qgz_half_vs_no_correction": _lower(_paired_configs(s500, "zeropp-qgz-half", "zeropp")),
        "qwz_only_second_half": _cell(gaps(s500.get("zeropp-qwz-only", {}), base500, "second_half")),
        "qgz_only_second_half": _cell(qgz_only),
        "no_correction_at_qgz_only_seeds": _cell(gaps(at_qgz_only_seeds, base500, "second_half")),
        "candidates": _candidates(s500, base500),
        "defaults_100_final": _cell(gaps(old.get("zeropp", {}), old.get(BASE, {}), "final")),
        "defaults_100_final_verdict": verdict(gaps(old.get("zeropp", {}), old.get(BASE, {}), "final")),
        "deltas_ef_100_final": _cell(gaps(old.get("zeropp-deltas+ef", {}), old.get(BASE, {}), "final")),
        "qhsdp_100_final": _cell(gaps(q.get("qhsdp", {}), q.get(BASE, {}), "final")),
    }
