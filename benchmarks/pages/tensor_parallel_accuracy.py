"""Loss of ZeRO++ with tensor parallelism against Lightning's exact 2-D run, seeds paired
(``tensor_parallel_accuracy.py``)."""

from __future__ import annotations

import math
from typing import Any

from convergence import REGIMES, SMOOTHING, regime_name, smoothed

from pages import Source, interval, mean_se, pct, table
from pages.accuracy import LINE, gaps, verdict

TITLE = "Loss with tensor parallelism"
QUESTION = """How far is ZeRO++'s loss with tensor parallelism from Lightning's exact 2-D run (ModelParallelStrategy)?

A small Llama at byte level under torch's tensor-parallel plan (t = 2) and `fully_shard`, one `configure_model` run
by both strategies from the same seed on the same data; `tensor_parallel_accuracy.py` records each run's training and
validation curves, and this page pairs them by seed."""

STUDY = "accuracy/tensor_parallel.json"
EIGHT_RANKS = "accuracy/tensor_parallel_2x4.json"  # 2 nodes x 4 (r/t = 2: qgZ's two hops, hpZ)
SOURCES = [STUDY, EIGHT_RANKS]
DEFAULT_LAYOUT = "2x2"
"""The script's default layout (2 nodes x 2 ranks, r/t = 1); another one's runs are in a file of their own."""

BASE = "model_parallel"
DEFAULT = "zeropp-vectors"
"""ZeRO++'s defaults (the correction on matrices, norm gains and biases exact: ``gradient_quantization_scope="auto"``
with tensor parallelism); ``zeropp`` were the defaults before 2026-12-07 09:55, ``zeropp-matrices`` until 19:10."""
MEANING = {
    "zeropp-vectors": "**ZeRO++'s defaults**, `ZeroPPStrategy(tensor_parallel_size=2, ranks_per_node=...)`: norm gains"
    ' and biases reduced exactly (`gradient_quantization_scope="auto"`, "matrices" with tensor parallelism), the'
    ' second-moment correction on matrices (`second_moment_scope="matrices"`); the defaults since 2026-12-07 19:10,'
    " and from 12:08 until the cluster measured its 1-D step",
    "zeropp-matrices": "every gradient quantized, the correction on matrices: the defaults from 2026-12-07 09:55 until"
    " 19:10",
    "zeropp": "the defaults until 2026-12-07 09:55: every gradient quantized, the correction on every parameter"
    ' (`second_moment_scope="all"`)',
    "zeropp-exact": "ZeRO++ with quantization off (`quantize_weights=False, quantize_gradients=False`): a control",
    "zeropp-no-smc": "every gradient quantized, without AdamW's second-moment correction"
    " (`second_moment_correction=False`)",
}
MEASURES = (("final", "final validation"), ("second_half", "second half (training)"))
PART = 0.01
"""Two runs of a pair part where their training losses, each a trailing mean over ``SMOOTHING`` steps, first differ by
more than this fraction of the baseline's: ten times the goal, where the quantization's small steady gap is left
behind and the runs follow different trajectories (a spike in one of them, a plateau left earlier)."""

Runs = dict[str, dict[int, dict[str, Any]]]


Group = tuple[str, float, int]  # (layout "NODESxRANKS", learning rate, steps)


def _groups(sources: dict[str, Source]) -> dict[Group, Runs]:
    """The finished runs of every source by (layout, learning rate, steps), then by configuration and seed; in the
    order of the pages' sections (the default layout first, then by steps and learning rate)."""
    out: dict[Group, Runs] = {}
    for source in sources.values():
        for r in source.data["runs"]:
            if "error" not in r and r.get("val_curve"):
                key = (_layout(r), r["lr"], r["steps"])
                out.setdefault(key, {}).setdefault(r["config"], {})[r["seed"]] = r
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0] != DEFAULT_LAYOUT, kv[0][0], kv[0][2], kv[0][1])))


def _layout(run: dict[str, Any]) -> str:
    return f"{run['world'] // run['ranks_per_node']}x{run['ranks_per_node']}"


def _per_seed(pairs: list[tuple[int, float]]) -> str:
    return ", ".join(f"{s}: {pct(g)}" for s, g in pairs) or "-"


def parted(run: dict[str, Any], base: dict[str, Any]) -> tuple[int, str] | None:
    """The first step at which ``run`` and ``base`` part (:data:`PART`), and whether ``run`` is lower or higher there;
    None if they never do."""
    mine, theirs = smoothed(run["train_curve"]), smoothed(base["train_curve"])
    for step in sorted(set(mine) & set(theirs)):
        if abs(mine[step] - theirs[step]) > PART * theirs[step]:
            return step, "lower" if mine[step] < theirs[step] else "higher"
    return None


def _parting(runs: dict[int, dict], base: dict[int, dict]) -> str:
    cells = []
    for seed in sorted(set(runs) & set(base)):
        part = parted(runs[seed], base[seed])
        cells.append(f"{seed}: never" if part is None else f"{seed}: step {part[0]}, {part[1]}")
    return ", ".join(cells) or "-"


def _identical(runs: dict[int, dict], base: dict[int, dict]) -> str:
    """At how many paired seeds the run's curves equal the baseline's, every value."""
    seeds = sorted(set(runs) & set(base))
    same = sum(all(runs[s][c] == base[s][c] for c in ("train_curve", "val_curve")) for s in seeds)
    return f"{same} of {len(seeds)}"


def _setup(run: dict[str, Any]) -> str:
    m = run["model"]
    nodes = run["world"] // run["ranks_per_node"]
    return (
        f"{run['world']} CPU ranks as {nodes} nodes x {run['ranks_per_node']} (t = 2, so {run['world'] // 2}"
        f" data-parallel ranks); TinyLlama of {m['n_layer']} blocks, dimension {m['dim']}, {m['n_head']} query and"
        f" {m['n_kv_head']} key/value heads, SwiGLU hidden {m['ffn_hidden']}, vocabulary {m['vocab_size']} (bytes),"
        f" sequences of {m['max_seq_len']}; batch {run['batch']} per data-parallel rank; AdamW, lr {run['lr']:g}"
        f" after {run['warmup']} warm-up steps, cosine to a tenth; fp32; validation on {run['val_windows']} held-out"
        f" windows, {run['evals']} times a run."
    )


def _minutes(rs: dict[int, dict]) -> str:
    return f"{mean_se([r['seconds'] / 60 for r in rs.values()])[0]:.1f}" if rs else "-"


def _seeds_needed(pairs: list[tuple[int, float]]) -> str:
    """The paired seeds the 0.1% rule needs to decide at the mean and spread ``pairs`` show: its interval (2 SE) must
    shrink to the distance between the mean and the line, ``(2 sd / |line - |mean||)^2``; the seeds run where it has
    decided already, ``-`` below two seeds, "never" at a mean on the line."""
    if len(pairs) < 2:
        return "-"
    if verdict(pairs) != "undecided":
        return str(len(pairs))
    m, se = mean_se([g for _, g in pairs])
    distance = abs(LINE - abs(m))
    if distance == 0:
        return "never"
    sd = se * math.sqrt(len(pairs))
    return str(max(len(pairs) + 1, math.ceil((2 * sd / distance) ** 2 - 1e-9)))


def _lower_at(mine: list[tuple[int, float]], theirs: list[tuple[int, float]]) -> str:
    """At how many of the seeds both have ``mine`` is below ``theirs``: ``"3 of 3"``."""
    other = dict(theirs)
    shared = [(g, other[s]) for s, g in mine if s in other]
    return f"{sum(a < b for a, b in shared)} of {len(shared)}"


def _regime(runs: Runs) -> tuple[str, float, int]:
    """The regime's name (``convergence.py``'s where it is one of its regimes), learning rate and warm-up steps."""
    run = next(iter(next(iter(runs.values())).values()))
    return regime_name(run["lr"], run["warmup"]), run["lr"], run["warmup"]


def _spread(finals: list[float]) -> str:
    if len(finals) < 2:
        return "The exact run's spread over seeds: not measured (fewer than two seeds)."
    spread = (max(finals) - min(finals)) / mean_se(finals)[0]
    return (
        f"The exact run's own final validation losses over its {len(finals)} seeds spread by"
        f" {pct(spread, 2, sign=False)} of their mean (min to max): the seed-to-seed noise that pairing by seed"
        " takes out."
    )


def _section(steps: int, runs: Runs) -> str:
    base = runs.get(BASE, {})
    any_run = next(iter(next(iter(runs.values())).values()))
    rows = []
    for config in [c for c in MEANING if c in runs] + sorted(c for c in runs if c not in MEANING and c != BASE):
        final = gaps(runs[config], base, "final")
        cells: list[Any] = [f"`{config}`", MEANING.get(config, ""), len(final)]
        for what, _ in MEASURES:
            pairs = gaps(runs[config], base, what)
            cells += [_per_seed(pairs), interval([g for _, g in pairs]) if pairs else "-"]
        first = gaps(runs[config], base, "first_half")
        second = gaps(runs[config], base, "second_half")
        rows.append([*cells, interval([g for _, g in first]) if first else "-", _parting(runs[config], base),
                     _identical(runs[config], base), verdict(final), verdict(second),
                     _seeds_needed(final)])  # fmt: skip
    header = ["config", "what", "seeds"]
    for _, label in MEASURES:
        header += [f"{label}, per seed", f"{label}, mean ± 2 SE"]
    header += ["first half (training), mean ± 2 SE", "the runs part (seed: step, this run)",
               "curves identical to the exact run's", f"final validation, within {pct(LINE, 1, sign=False)}",
               "second half, by the same rule",
               "seeds the rule needs to decide, at this mean and spread (final validation)"]  # fmt: skip
    finals = [r["val_curve"][-1][1] for r in base.values()]
    curve_rows = []
    for i, (step, _) in enumerate(any_run["val_curve"]):
        row: list[Any] = [step, f"{mean_se([r['val_curve'][i][1] for r in base.values()])[0]:.4f}" if base else "-"]
        for config in [c for c in runs if c != BASE]:
            pairs = [(r["val_curve"][i][1] - base[s]["val_curve"][i][1]) / base[s]["val_curve"][i][1]
                     for s, r in sorted(runs[config].items()) if s in base]  # fmt: skip
            row.append(interval(pairs) if pairs else "-")
        curve_rows.append(row)
    described = sorted({r["describe"] for rs in runs.values() for r in rs.values() if r.get("describe")})
    times = [[f"`{c}`", len(rs), _minutes(rs)] for c, rs in runs.items()]
    name, lr, warmup = _regime(runs)
    nodes, per_node = _layout(any_run).split("x")
    return f"""## {nodes} nodes x {per_node}, {steps} steps, {name}: lr {lr:g}, {warmup} warm-up steps

{_setup(any_run)}

{_spread(finals)}

{table(header, rows)}

The validation loss along the run: the exact run's mean over its seeds, and each configuration's paired gap to it.

{table(["steps done", f"`{BASE}`", *[f"`{c}` gap" for c in runs if c != BASE]], curve_rows)}

What ZeRO++'s collectives were in these runs (the strategy's own description):

{chr(10).join(f"    {line}" for d in described for line in d.splitlines()) or "    not recorded"}

Minutes per run (wall time on the machine of the runs below, shared with other jobs):

{table(["config", "runs", "minutes per run"], times)}"""


ONE_D_HALF = "accuracy.md#the-correction-on-matrices-only-the-decisions-logs-rule-its-1-d-half"
SCOPE_CANDIDATE = "zeropp-matrices"
"""The candidate of the decisions log's rule of 2026-12-07: the correction on matrices only."""
SCOPE_SEEDS = (1, 2, 3)
SCOPE_RATIO = 0.5
"""The rule's 2-D half: the candidate's spread of the final validation gap over the seeds at most this fraction of the
defaults' (``zeropp``, the correction on every parameter), on every calm layout."""


def _calm_rule(sources: dict[str, Source], judge) -> tuple[str, list[str]]:
    """A rule's 2-D half over the calm layouts: ``judge(runs, base)`` gives ``(holds, text)`` for a layout, or None
    where the two configurations have not both run at seeds 1-3; the half is "not run" until every layout has."""
    lines, held, ready = [], [], True
    for (layout, _, steps), runs in _groups(sources).items():
        if _regime(runs)[0] != "calm":
            continue
        judged = judge(runs, runs.get(BASE, {}))
        if judged is None:
            ready = False
            lines.append(f"- {layout}, {steps} steps: not run at seeds {', '.join(map(str, SCOPE_SEEDS))} by both")
            continue
        ok, text = judged
        held.append(ok)
        lines.append(f"- {layout}, {steps} steps: {text}")
    if not ready or not held:
        return "not run", lines
    return ("holds" if all(held) else "fails"), lines


def scope_rule(sources: dict[str, Source]) -> tuple[str, list[str]]:
    """The 2-D half of the decisions log's rule for ``second_moment_scope``: per calm layout, the standard deviation
    over seeds 1-3 of the paired final validation gap, the defaults' (``zeropp``) and the candidate's; the half
    holds when the candidate's is at most :data:`SCOPE_RATIO` of the defaults' on every layout. ``("not run",
    ...)`` until both have the three seeds on a layout."""
    import statistics

    def judge(runs: Runs, base: dict[int, dict]) -> tuple[bool, str] | None:
        spread = {}
        for config in ("zeropp", SCOPE_CANDIDATE):
            pairs = [g for s, g in gaps(runs.get(config, {}), base, "final") if s in SCOPE_SEEDS]
            if len(pairs) != len(SCOPE_SEEDS):
                return None
            spread[config] = statistics.stdev(pairs)
        ratio = spread[SCOPE_CANDIDATE] / spread["zeropp"]
        ok = ratio <= SCOPE_RATIO
        return ok, (
            f"spread (std over seeds) of the final validation gap {pct(spread[SCOPE_CANDIDATE], 3, sign=False)} for"
            f" `{SCOPE_CANDIDATE}` against {pct(spread['zeropp'], 3, sign=False)} for `zeropp`: ratio {ratio:.2f}"
            f" ({'holds' if ok else 'fails'}: at most {SCOPE_RATIO:g})"
        )

    return _calm_rule(sources, judge)


def _scope_section(sources: dict[str, Source]) -> str:
    result, lines = scope_rule(sources)
    return f"""## The correction on matrices only: the decisions log's rule, its 2-D half

The [decisions log](../decisions.md) (2026-12-07) fixed before these runs when `second_moment_scope="matrices"` (the
second-moment correction on parameters of two or more dimensions; norm gains and biases keep their second moment)
replaces `"all"`. Its 2-D half, read from the calm runs above at seeds {", ".join(map(str, SCOPE_SEEDS))}:

{chr(10).join(lines)}

The 2-D half **{result}**. The 1-D half is on [Loss against ZeRO-3]({ONE_D_HALF})."""


VECTORS_CANDIDATE, VECTORS_AGAINST = "zeropp-vectors", "zeropp-matrices"
"""The decisions log's rule of 2026-12-07 12:08: norm gains and biases reduced exactly, against the defaults of that
hour (every gradient quantized, the correction on matrices)."""
ONE_D_VECTORS = "accuracy.md#norm-gains-and-biases-reduced-exactly-the-decisions-logs-rule-its-1-d-half"


def vectors_rule(sources: dict[str, Source]) -> tuple[str, list[str]]:
    """The 2-D half of the decisions log's rule for ``gradient_quantization_scope``: per calm layout, at seeds 1-3,
    the candidate's mean final validation gap below the defaults', and the paired difference (candidate - defaults)
    not resolved above zero (mean - 2 SE <= 0); ``("not run", ...)`` until both have the three seeds on a layout."""

    def judge(runs: Runs, base: dict[int, dict]) -> tuple[bool, str] | None:
        mine = dict(gaps(runs.get(VECTORS_CANDIDATE, {}), base, "final"))
        theirs = dict(gaps(runs.get(VECTORS_AGAINST, {}), base, "final"))
        if not all(s in mine and s in theirs for s in SCOPE_SEEDS):
            return None
        differences = [mine[s] - theirs[s] for s in SCOPE_SEEDS]
        m, se = mean_se(differences)
        lower = mean_se([mine[s] for s in SCOPE_SEEDS])[0] < mean_se([theirs[s] for s in SCOPE_SEEDS])[0]
        ok = lower and m - 2 * se <= 0
        return ok, (
            f"final validation gap {interval([mine[s] for s in SCOPE_SEEDS])} for `{VECTORS_CANDIDATE}` against"
            f" {interval([theirs[s] for s in SCOPE_SEEDS])} for `{VECTORS_AGAINST}`; paired difference"
            f" {interval(differences)}, lower at {sum(d < 0 for d in differences)} of {len(differences)} seeds"
            f" ({'holds' if ok else 'fails'})"
        )

    return _calm_rule(sources, judge)


def _vectors_section(sources: dict[str, Source]) -> str:
    result, lines = vectors_rule(sources)
    return f"""## Norm gains and biases reduced exactly: the decisions log's rule, its 2-D half

The [decisions log](../decisions.md) (2026-12-07 12:08) fixed before these runs when
`gradient_quantization_scope="matrices"` (the gradients of parameters of fewer than two dimensions reduce-scattered
exactly beside qgZ) replaces `"all"`. Its 2-D half, read from the calm runs above at seeds
{", ".join(map(str, SCOPE_SEEDS))}: the candidate's mean final validation gap below the defaults' of that hour
(`{VECTORS_AGAINST}`), and not resolved worse (paired mean - 2 SE <= 0), on each layout:

{chr(10).join(lines)}

The 2-D half **{result}**. The 1-D half is on [Loss against ZeRO-3]({ONE_D_VECTORS}); the bytes are on
[Bytes per step](bytes_per_step.md)."""


SHORT = {"zeropp-matrices": "every gradient quantized", "zeropp-vectors": "norm gains and biases exact"}
GOAL_SEEDS = (1, 2, 3, 4, 5, 6)
"""The seeds the decisions log's entry of 2026-12-07 18:12 fixed for issue 60's accuracy goal (no more are added)."""


def _goal_section(sources: dict[str, Source]) -> str:
    rows = []
    for (layout, _, steps), runs in _groups(sources).items():
        if _regime(runs)[0] != "calm":
            continue
        base = runs.get(BASE, {})
        for config in (DEFAULT, *(c for c in SHORT if c != DEFAULT)):
            what = "the defaults" if config == DEFAULT else SHORT[config]
            chosen = {seed: r for seed, r in runs.get(config, {}).items() if seed in GOAL_SEEDS}
            final = gaps(chosen, base, "final")
            if final:
                rows.append([f"{layout}", str(steps), f"`{config}` ({what})", str(len(final)),
                             interval([g for _, g in final]), f"**{verdict(final)}**"])  # fmt: skip
    return f"""## Issue 60's accuracy goal over six seeds: the decisions log's rule

The goal read *undecided* at 3 seeds in both layouts. The [decisions log](../decisions.md) (2026-12-07 18:12) fixed,
before they ran, three more seeds ({", ".join(map(str, GOAL_SEEDS[3:]))}) in both layouts, and that the verdict over
all six is the goal's, whatever it reads; no further seed is added for it. From the calm runs above:

{table(["layout", "steps", "config", "seeds", "final validation gap, mean ± 2 SE", "within 0.1%"], rows)}"""


def auto_rule(sources: dict[str, Source]) -> tuple[str, list[str]]:
    """The accuracy half of the decisions log's rule of 2026-12-07 18:45: per calm layout, over ``GOAL_SEEDS``, the
    exact vectors' final validation gap within 0.1% by the page's rule, and its mean below every gradient quantized's;
    the verdict (met only where every layout holds) and one line per layout."""
    lines, held = [], []
    for (layout, _, _), runs in _groups(sources).items():
        if _regime(runs)[0] != "calm":
            continue
        base = runs.get(BASE, {})

        def final(config: str, runs: Runs = runs, base: dict = base) -> list[float]:
            chosen = {seed: r for seed, r in runs.get(config, {}).items() if seed in GOAL_SEEDS}
            return [g for _, g in gaps(chosen, base, "final")]

        mine, theirs = final(VECTORS_CANDIDATE), final(VECTORS_AGAINST)
        if len(mine) < 2 or not theirs:
            continue
        within = verdict([(0, g) for g in mine])
        below = mean_se(mine)[0] < mean_se(theirs)[0]
        held.append(within == "met" and below)
        lines.append(f"- `{layout}`: `{VECTORS_CANDIDATE}` {interval(mine)} (within 0.1%: **{within}**) against"
                     f" `{VECTORS_AGAINST}` {interval(theirs)}; the mean below: **{_yes(below)}**")  # fmt: skip
    return ("met" if held and all(held) else "NOT met"), lines


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _auto_section(sources: dict[str, Source]) -> str:
    result, lines = auto_rule(sources)
    return f"""## Norm gains and biases exact where tensor parallelism runs: the decisions log's rule, its accuracy half

The [decisions log](../decisions.md) (2026-12-07 18:45) made `gradient_quantization_scope="auto"` (`"matrices"`
with tensor parallelism, `"all"` without) the default if, with its step half, over the six seeds above the exact
vectors' final validation gap lies within 0.1% by this page's rule in both layouts, its mean below every gradient
quantized's. This half was read after its runs (the log says so):

{chr(10).join(lines)}

The accuracy half **{result}**. The step half is on [Step time on a slow link](slow_link.md)."""


def render(sources: dict[str, Source]) -> str:
    parts = [
        f"""## How to read it

- **gap**: `(config - model_parallel) / model_parallel` at the same seed (same initial weights, same data order),
  of the final validation loss and of the mean training loss (rank 0's) over each half of the steps.
- **mean ± 2 SE (n seeds)**: over the paired seeds; 2 SE is the study's resolution. One seed gets no verdict.
- **the runs part**: the first step at which the two runs' training losses, each a trailing mean over {SMOOTHING}
  steps, differ by more than {pct(PART, 0, sign=False)} of the exact run's, and whether this run is then lower or
  higher: beyond that step a pair follows two trajectories (a spike in one, a plateau left earlier by the other), and
  its gap measures where each trajectory went more than what the quantization costs per step.
- ZeRO++'s validation runs its own forward, its weights gathered as in training (qwZ).
- **two regimes**, `convergence.py`'s: *aggressive* (the script's default) ran first; *calm* ran after, when a pair of
  the aggressive runs had parted (the Runs table below gives the order). Each is paired within itself.
- **`zeropp-exact`**, the control: ZeRO++ with its quantization off must reproduce the exact run bit for bit (every
  value of both curves); where it does, what the defaults' gaps show is what their quantization changed.
- **the goal** (issue 60): the defaults' (`{DEFAULT}`) final validation loss within 0.1% of the exact 2-D run;
  *met*: the mean gap and its resolution lie inside 0.1%; *NOT met*: beyond it; *undecided*: the interval straddles
  it."""
    ]
    for (_, _, steps), runs in _groups(sources).items():
        parts.append(_section(steps, runs))
    parts.append(_goal_section(sources))
    parts.append(_auto_section(sources))
    parts.append(_vectors_section(sources))
    parts.append(_scope_section(sources))
    return "\n\n".join(parts)


HEADLINES = {
    STUDY: [("the defaults' final validation gap, 2 x 2, calm", "calm_final"),
            ("with every gradient quantized", "calm_every_final")],
    EIGHT_RANKS: [("the defaults' final validation gap, 2 x 4, calm", "calm_2x4_final"),
                  ("with every gradient quantized", "calm_2x4_every_final")],
}  # fmt: skip
"""Per data file, the figures ``benchmarks/RESULTS.md`` shows beside its newest run (snippet names)."""


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    """Per named regime (``convergence.py``'s: ``calm_final``, ``aggressive_final_verdict``, ...; ``calm_2x4_final``
    in another layout) and length (the longest last): ZeRO++'s defaults against the exact run."""
    out: dict[str, str] = {}
    for (layout, _, steps), runs in _groups(sources).items():
        name = _regime(runs)[0]
        if name not in REGIMES:
            continue
        name += "" if layout == DEFAULT_LAYOUT else f"_{layout}"
        base, zeropp = runs.get(BASE, {}), runs.get(DEFAULT, {})
        every = gaps(runs.get("zeropp", {}), base, "final")
        exact = gaps(runs.get(VECTORS_CANDIDATE, {}), base, "final")
        quantized = gaps(runs.get(VECTORS_AGAINST, {}), base, "final")
        final, second = gaps(zeropp, base, "final"), gaps(zeropp, base, "second_half")
        plain = gaps(runs.get("zeropp-no-smc", {}), base, "final")
        out.update({
            f"{name}_steps": str(steps),
            f"{name}_final": interval([g for _, g in final]) if final else "-",
            f"{name}_final_verdict": verdict(final),
            f"{name}_second_half": interval([g for _, g in second]) if second else "-",
            f"{name}_second_half_verdict": verdict(second),
            f"{name}_parting": _parting(zeropp, base),
            f"{name}_seeds_needed": _seeds_needed(final),
            f"{name}_no_correction_final": interval([g for _, g in plain]) if plain else "-",
            f"{name}_no_correction_final_verdict": verdict(plain),
            f"{name}_all_final": interval([g for _, g in every]) if every else "-",
            f"{name}_vectors_final": interval([g for _, g in exact]) if exact else "-",
            f"{name}_vectors_final_verdict": verdict(exact),
            f"{name}_vectors_lower": _lower_at(exact, quantized),
            f"{name}_every_final": interval([g for _, g in quantized]) if quantized else "-",
            f"{name}_every_final_verdict": verdict(quantized),
        })  # fmt: skip
    return out
