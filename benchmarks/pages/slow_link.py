"""Step time on the emulated two-node cluster, over a shaped link (``cluster.py``), one section per study."""

from __future__ import annotations

import statistics

from pages import Source, mb, table

TITLE = "Step time on a slow link"
QUESTION = """How much faster than ZeRO-3 does a step run over a slow link between nodes, per configuration?

And what does each candidate for the defaults cost in step time on that link? With tensor parallelism, how much
faster than Lightning's ModelParallelStrategy on the same mesh?

Two network namespaces on one machine are the nodes; one veth pair between them, shaped with `tc tbf` on both ends,
is the only inter-node link; loopback inside each namespace is the intra-node fabric (`benchmarks/cluster.py`). Each
node runs the example GPT's `train.py fit` as a multi-node job does (2 nodes x 2 gloo ranks on CPUs, bf16-mixed, one
sequence per rank per step); the training code does not know it is emulated. A run's first steps are warm-up and left
out; its step time is the median of the rest on rank 0. "ledger" is what node 0's ranks send to node 1 by the
strategy's per-peer byte count; "link" is what node 0's veth actually transmitted (its `tx_bytes` counter), per step.
The step times are a CPU testbed's: 4 ranks share one machine's cores, and the quantizers run as their pure-torch
twins, so the compute ZeRO++ adds weighs far more here than on a GPU. The ledger's bytes are what any fabric is
given; what the link carries depends on gloo's algorithms (see why the two differ, below). The tensor-parallel rows run
a Llama on 2 nodes x 4 ranks instead ([With tensor parallelism](#with-tensor-parallelism))."""

SOURCES_1D = [
    "slow_link/cluster.json",
    "slow_link/cluster_qhsdp.json",
    "slow_link/cluster_deltas.json",
    "slow_link/cluster_deltas_20mbit.json",
    "slow_link/cluster_candidates.json",
    "slow_link/cluster_smc.json",
    "slow_link/cluster_smc_default.json",
    "slow_link/cluster_feedback.json",
    "slow_link/cluster_ef_smc.json",
    "slow_link/cluster_ef_smc_rows.json",
    "slow_link/cluster_plan.json",
    "slow_link/cluster_vectors.json",
    "slow_link/cluster_matrices.json",
    "slow_link/cluster_matrices_twin.json",
    "slow_link/cluster_matrices_2.json",
]
"""The example GPT's runs on 2 nodes x 2 ranks, each against ZeRO-3."""
PATH_2D = "slow_link/cluster_2d.json"
"""The tensor-parallel rows: the Llama on 2 nodes x 4 ranks, ZeRO++'s defaults against ModelParallelStrategy."""
PATH_2D_LOADED = "archive/cluster_2d_2026-12-07a.json"
"""The same command's earlier run, on the machine while a study ran beside it: what a loaded machine does to the
goal (the CPU-bound part of each step grows, the link's part does not)."""
PATH_2D_MATRICES = "slow_link/cluster_2d_matrices.json"
"""The same Llama with norm gains and biases carried exactly in qgZ's all-to-alls (``zeropp_matrices``), paired by
round with the defaults and ModelParallelStrategy."""
PATH_2D_VECTORS = "archive/cluster_2d_2026-12-07c.json"
"""The same command's quiet run with norm gains and biases reduced exactly (the default from 2026-12-07 12:08 until
this run and ``cluster_vectors.json`` measured its step)."""
PATH_2D_THIRD = "slow_link/cluster_2d_matrices_2.json"
"""The decisions log's 2-D run of 2026-12-07 18:45: the same three configurations, paired by round; ``zeropp`` there
is every gradient quantized (the defaults of that hour), ``zeropp_matrices`` what "auto" runs with tensor
parallelism."""
SOURCES = [*SOURCES_1D, PATH_2D, PATH_2D_MATRICES, PATH_2D_THIRD, PATH_2D_LOADED, PATH_2D_VECTORS]

FIGURES = "../../benchmarks/data/slow_link"
"""The PNGs beside the data, relative to ``docs/results/``."""

MEANING = {
    "zero3": "exact ZeRO-3 (this strategy, every technique off)",
    "hsdp": "`sharding_strategy=\"HYBRID_SHARD\"`: shard inside the node, all-reduce across nodes",
    "qhsdp": "`strategy=\"qhsdp\"`: HSDP with the cross-node all-reduce quantized (INT4 then INT8)",
    "qhsdp_int4": "qhsdp with `hsdp_gather_bits=4`",
    "qwz": "qwZ alone (INT8 forward all-gather)",
    "hpz": "hpZ alone (a secondary partition inside the node)",
    "qgz": "qgZ alone (2-hop INT4 gradient all-to-all)",
    "zeropp": "ZeRO++'s defaults when the run was made: qwZ + hpZ + qgZ, with the second-moment correction in "
              "`cluster_smc_default.json`, `cluster_ef_smc.json`, `cluster_ef_smc_rows.json` and `cluster_2d.json`, "
              "without it before; every gradient quantized in every run before 2026-12-07 12:08 (since then norm "
              "gains and biases cross nodes exactly, in `cluster_vectors.json` and "
              "`archive/cluster_2d_2026-12-07c.json`)",
    "zeropp_matrices": 'the defaults with `gradient_quantization_scope="matrices"`: norm gains and biases cross'
                       " nodes exactly, carried in qgZ's own all-to-alls (since commit `fbfc772`)",
    "zeropp_nosmc": "the defaults without the second-moment correction",
    "zeropp_smc": "the defaults (of that day) with `second_moment_correction=True`",
    "zeropp_deltas": "the defaults with `weight_deltas=True` (INT4 deltas)",
    "zeropp_ef": "the defaults with `gradient_error_feedback=True` (INT8 residual)",
    "zeropp_qgz8": "the defaults with `gradient_bits=8` (INT8 inter-node gradient hop)",
    "zeropp_rot": "the defaults with the Hadamard rotation before qgZ's quantization",
    "zeropp_sr": "the defaults with stochastic rounding in qgZ",
    "fsdp": "Lightning's stock FSDP2 path (`ModelParallelStrategy`, bf16 all-gather, fp32 reduce-scatter)",
    "model_parallel": "with tensor parallelism t: Lightning's `ModelParallelStrategy(data_parallel_size=8 / t, "
                      "tensor_parallel_size=t)` on the Llama (`benchmarks/llama_tp.py`)",
}  # fmt: skip

RULE = 1.05
"""The step-time rule for a default (docs/decisions.md, 2026-12-02): on the cluster at 200 Mbit/s, a candidate's step
within 5% of the defaults', paired by repeat."""

CANDIDATES = [
    ("slow_link/cluster_candidates.json", "zeropp_qgz8", "zeropp"),
    ("slow_link/cluster_candidates.json", "zeropp_ef", "zeropp"),
    ("slow_link/cluster_candidates.json", "zeropp_rot", "zeropp"),
    ("slow_link/cluster_candidates.json", "zeropp_sr", "zeropp"),
    ("slow_link/cluster_smc.json", "zeropp_smc", "zeropp"),
    ("slow_link/cluster_smc_default.json", "zeropp", "zeropp_nosmc"),
    ("slow_link/cluster_feedback.json", "zeropp_ef", "zeropp"),
    ("slow_link/cluster_ef_smc.json", "zeropp_ef", "zeropp"),
    ("slow_link/cluster_ef_smc_rows.json", "zeropp_ef", "zeropp"),
    ("slow_link/cluster_vectors.json", "zeropp", "zeropp_quantized_vectors"),  # `zeropp` there: vectors exact
    ("slow_link/cluster_matrices.json", "zeropp_matrices", "zeropp"),  # the vectors carried in qgZ's all-to-alls
    ("slow_link/cluster_matrices_twin.json", "zeropp_matrices", "zeropp"),  # ... after the twin's zero-block fix
    ("slow_link/cluster_matrices_2.json", "zeropp_matrices", "zeropp"),  # the decisions log's second trial (16:14)
]
"""The rule's applications: (file, candidate, the defaults it is paired with)."""

GOALS_200 = 2.5
"""The goal set for the defaults when the cluster was built: at least this speedup over ZeRO-3 at 200 Mbit/s."""
GOAL_UNSHAPED = 0.10
"""... and on the unshaped link at most this much slower than ZeRO-3."""
DELTAS_BYTES = 0.12
"""Weight deltas' goals: the link carries at most this share of ZeRO-3's bytes ..."""
DELTAS_SPEEDUP = 1.3
"""... and the step is this much faster than the defaults' at 200 Mbit/s."""

TP_BASELINE = "model_parallel"
GOAL_2D = 2.0
"""Issue 60's goal with tensor parallelism: at 200 Mbit/s, ZeRO++'s defaults at least this many times faster than
ModelParallelStrategy on the same mesh (the median of the paired ratios), the two step intervals apart."""
GOAL_2D_RATE = 200.0
MIN_REPEATS = 3
"""Fewer repeats give no interval to tell two configurations apart with."""

LINK_FACTOR = {
    "weight_all_gather": 0.75,
    "weight_all_gather_backward": 0.75,
    "gradient_reduce_scatter": 1.5,
    "gradient_reduce_scatter_vectors": 1.0,
    "gradient_all_to_all_inter": 1.0,
}
"""What the wire carries per ledger byte, by collective (gloo, 4 ranks as 2 x 2): a ring all-gather crosses the node
boundary on two edges with 3 shards each against the ledger's 2 ranks x 2 other-node peers (3/4); gloo's
``reduce_scatter_tensor`` moves twice a ring's bytes (6/4); an all-to-all sends what the ledger counts, the norm
gains' and biases' bytes it carries included."""


# --- reading the rows ------------------------------------------------------------------------------------------------


def _rows(sources: dict[str, Source], path: str) -> list[dict]:
    return sources[path].data["rows"]


def _meta(sources: dict[str, Source], path: str) -> dict:
    return sources[path].data["meta"]


def _row(sources: dict[str, Source], path: str, config: str, rate: float | None = 200.0) -> dict:
    return next(r for r in _rows(sources, path) if r["config"] == config and r["rate"] == rate)


def _link(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g} Mbit/s"


def _rate_key(rate: float | None) -> tuple[bool, float]:
    return rate is None, rate or 0.0


def _repeats(row: dict, meta: dict) -> list[float]:
    """Each repeat's step time: as recorded, or (runs before ``step_s_repeats``) the median of each repeat's steady
    steps, which ``step_s_all`` holds repeat after repeat."""
    if row.get("step_s_repeats"):
        return row["step_s_repeats"]
    steady = meta["steps"] - meta["warmup"]
    steps = row["step_s_all"]
    return [statistics.median(steps[i : i + steady]) for i in range(0, len(steps) - steady + 1, steady)]


def _pooled(sources: dict[str, Source], path: str) -> bool:
    """Whether the file's step time is the median of every steady step pooled (runs before per-repeat medians)."""
    return not _rows(sources, path)[0].get("step_s_repeats")


def _paired(base: list[float], other: list[float]) -> tuple[float, float, float]:
    """``base[r] / other[r]`` over the repeats: median, min, max."""
    ratios = [b / o for b, o in zip(base, other, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _x(value: float, lo: float | None = None, hi: float | None = None, digits: int = 2) -> str:
    text = f"{value:.{digits}f}x"
    return text if lo is None else f"{text} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _step(row: dict, meta: dict) -> str:
    reps = _repeats(row, meta)
    if len(reps) > 1:
        return f"{row['step_s']:.3f} [{min(reps):.3f}, {max(reps):.3f}]"
    return f"{row['step_s']:.3f} [{min(row['step_s_all']):.3f}, {max(row['step_s_all']):.3f}]"


def _step_header(sources: dict[str, Source], path: str) -> str:
    meta, row = _meta(sources, path), _rows(sources, path)[0]
    n = len(_repeats(row, meta))
    if n > 1:
        what = "median of all steps" if _pooled(sources, path) else "median"
        return f"step s ({what} [min, max] of {n} repeats' medians)"
    return f"step s (median [min, max] of {len(row['step_s_all'])} steps, one run)"


def _speedup(row: dict, base: dict, meta: dict) -> str:
    """Against ``base`` (ZeRO-3 at the same rate): where the run had repeats, the median and range of the paired
    ratios (for a run that pooled its steps, from the repeats' own medians), else the ratio of the two steps."""
    reps, base_reps = _repeats(row, meta), _repeats(base, meta)
    if len(reps) < 2 or row is base:
        return _x(row["speedup_vs_zero3"])
    return _x(*_paired(base_reps, reps))


def _zero3(sources: dict[str, Source], path: str, rate: float | None) -> dict:
    return _row(sources, path, "zero3", rate)


def _ratio(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _mb(value: float | None) -> str:
    return "n/a" if value is None else mb(value)


def _date(source: Source) -> str:
    return source.runs[-1].get("date", "")[:10] if source.runs else ""


def _run_line(sources: dict[str, Source], path: str) -> str:
    """What one file's run was: rates, repeats, steps, date."""
    meta, rows = _meta(sources, path), _rows(sources, path)
    rates = ", ".join(_link(r) for r in sorted({r["rate"] for r in rows}, key=_rate_key))
    n = len(_repeats(rows[0], meta))
    pooled = (
        " The step time is the median of every steady step pooled over the repeats (the run predates per-repeat"
        " medians); its range is the repeats' own medians, and a speedup is paired on those."
        if n > 1 and _pooled(sources, path)
        else ""
    )
    runs = f"{n} repeats interleaved" if n > 1 else "one run"
    return (
        f"`{path.split('/')[-1]}` ({_date(sources[path])}): {rates}; {runs},"
        f" {meta['steps']} steps a run, the first {meta['warmup']} left out.{pooled}"
    )


def _figure(name: str, alt: str) -> str:
    return f"![{alt}]({FIGURES}/{name})"


def _legend(configs: list[str]) -> str:
    return "\n".join(f"- `{c}`: {MEANING.get(c, c)}" for c in dict.fromkeys(configs))


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


# --- the studies -----------------------------------------------------------------------------------------------------


def _main_table(sources: dict[str, Source], path: str) -> str:
    meta = _meta(sources, path)
    rows = sorted(_rows(sources, path), key=lambda r: _rate_key(r["rate"]))
    out = []
    for r in rows:
        base = _zero3(sources, path, r["rate"])
        out.append([_link(r["rate"]), f"`{r['config']}`", _step(r, meta), f"{r['tokens_per_s']:.0f}",
                    _speedup(r, base, meta), _mb(r["ledger_inter_bytes_per_step"]), mb(r["link_tx_bytes_per_step"]),
                    _ratio(r["ledger_ratio_vs_zero3"]), _ratio(r["link_ratio_vs_zero3"]),
                    _ratio(r["link_over_ledger"])])  # fmt: skip
    header = ["link", "config", _step_header(sources, path), "tokens/s", "speedup vs zero3", "ledger inter MB/step",
              "link MB/step", "ledger ratio", "link ratio", "link / ledger"]  # fmt: skip
    return table(header, out)


def _defaults_every_run(sources: dict[str, Source]) -> str:
    rows = []
    for path in SOURCES_1D:
        meta = _meta(sources, path)
        for r in _rows(sources, path):
            if r["config"] != "zeropp":
                continue
            base = _zero3(sources, path, r["rate"])
            rows.append((_rate_key(r["rate"]), _date(sources[path]), [
                _link(r["rate"]), f"`{path.split('/')[-1]}`", _date(sources[path]), len(_repeats(r, meta)),
                f"{base['step_s']:.3f}", f"{r['step_s']:.3f}", _speedup(r, base, meta),
                f"{r['link_ratio_vs_zero3']:.3f}"]))  # fmt: skip
    rows.sort(key=lambda t: (t[0], t[1]))
    return table(["link", "data", "date", "repeats", "zero3 step s", "zeropp step s", "speedup", "link ratio"],
                 [r[2] for r in rows])  # fmt: skip


def _rule_rows(sources: dict[str, Source]) -> list[tuple[str, str, str, float, float, float, list[float], dict, dict]]:
    out = []
    for path, config, base_name in CANDIDATES:
        meta = _meta(sources, path)
        row, base = _row(sources, path, config), _row(sources, path, base_name)
        reps, base_reps = _repeats(row, meta), _repeats(base, meta)
        med, lo, hi = _paired(reps, base_reps)
        ratios = [a / b for a, b in zip(reps, base_reps, strict=True)]
        out.append((path, config, base_name, med, lo, hi, ratios, row, base))
    return out


def _rule_table(sources: dict[str, Source]) -> str:
    rows = []
    for path, config, base_name, med, lo, hi, ratios, row, base in _rule_rows(sources):
        beyond = sum(r > RULE for r in ratios)
        link = f"{mb(row['link_tx_bytes_per_step'])} / {mb(base['link_tx_bytes_per_step'])}"
        rows.append([f"`{path.split('/')[-1]}`", _date(sources[path]), f"`{config}`", f"`{base_name}`", len(ratios),
                     f"{row['step_s']:.3f} / {base['step_s']:.3f}", f"{row['step_s'] / base['step_s']:.3f}",
                     f"{med:.3f} [{lo:.3f}, {hi:.3f}]", f"{beyond} of {len(ratios)}", f"**{_met(med <= RULE)}**",
                     link])  # fmt: skip
    header = ["data", "date", "candidate", "against", "repeats", "step s", "ratio of the medians",
              "paired ratio (median [min, max])", "repeats beyond 5%", "within 5%", "link MB/step"]  # fmt: skip
    return table(header, rows)


def _qhsdp_table(sources: dict[str, Source]) -> str:
    path = "slow_link/cluster_qhsdp.json"
    meta = _meta(sources, path)
    hsdp = _row(sources, path, "hsdp")
    out = []
    for r in _rows(sources, path):
        base = _zero3(sources, path, r["rate"])
        vs_hsdp = "-"
        if r["config"].startswith("qhsdp"):
            med, lo, hi = _paired(_repeats(hsdp, meta), _repeats(r, meta))
            vs_hsdp = f"{_x(hsdp['step_s'] / r['step_s'])}; paired {_x(med, lo, hi)}"
        out.append([f"`{r['config']}`", _step(r, meta), f"{r['tokens_per_s']:.0f}", _speedup(r, base, meta), vs_hsdp,
                    mb(r["ledger_inter_bytes_per_step"]), mb(r["link_tx_bytes_per_step"]),
                    f"{r['link_tx_bytes_per_step'] / hsdp['link_tx_bytes_per_step']:.3f}"])  # fmt: skip
    header = ["config", _step_header(sources, path), "tokens/s", "speedup vs zero3 (paired)",
              "speedup vs hsdp (ratio of medians; paired)", "ledger inter MB/step", "link MB/step",
              "link bytes / hsdp's"]  # fmt: skip
    return table(header, out)


def _apart(a: dict, b: dict, meta: dict) -> bool:
    """Whether two rows' step intervals (min to max over repeats) do not overlap (``cluster.py``'s test)."""
    ra, rb = _repeats(a, meta), _repeats(b, meta)
    return max(ra) < min(rb) or max(rb) < min(ra)


def _qhsdp_text(sources: dict[str, Source]) -> str:
    path = "slow_link/cluster_qhsdp.json"
    meta = _meta(sources, path)
    r = {c: _row(sources, path, c) for c in ("hsdp", "qhsdp", "qhsdp_int4", "zeropp")}

    def told(a: str, b: str) -> str:
        return "told apart (the intervals do not overlap)" if _apart(r[a], r[b], meta) else "not told apart"

    return (
        f"- `qhsdp` against `hsdp`: {told('qhsdp', 'hsdp')}; against the ZeRO++ defaults: {told('qhsdp', 'zeropp')}.\n"
        f"- `qhsdp_int4` against `qhsdp`: {told('qhsdp_int4', 'qhsdp')}."
    )


def _deltas(sources: dict[str, Source]) -> tuple[str, list[str]]:
    paths = ["slow_link/cluster_deltas.json", "slow_link/cluster_deltas_20mbit.json"]
    out, checks, goals = [], [], []
    share = []
    for path in paths:
        meta = _meta(sources, path)
        for rate in sorted({r["rate"] for r in _rows(sources, path)}, key=lambda x: -(x or 0)):
            base, pp = _zero3(sources, path, rate), _row(sources, path, "zeropp", rate)
            for r in [x for x in _rows(sources, path) if x["rate"] == rate]:
                vs_pp = _x(pp["step_s"] / r["step_s"]) if r["config"] != "zero3" else ""
                out.append([_link(rate), f"`{path.split('/')[-1]}`", f"`{r['config']}`", _step(r, meta),
                            f"{r['tokens_per_s']:.0f}", _speedup(r, base, meta), vs_pp,
                            mb(r["ledger_inter_bytes_per_step"]), mb(r["link_tx_bytes_per_step"]),
                            f"{r['link_ratio_vs_zero3']:.3f}", f"{r['ledger_ratio_vs_zero3']:.3f}"])  # fmt: skip
            d = _row(sources, path, "zeropp_deltas", rate)
            share.append((rate, d["link_ratio_vs_zero3"]))
            saved = pp["link_tx_bytes_per_step"] - d["link_tx_bytes_per_step"]
            at_rate = saved * 8 / (rate * 1e6)
            checks.append([_link(rate), mb(saved), f"{at_rate:.3f}", f"{pp['step_s'] - d['step_s']:.3f}"])
    header = ["link", "data", "config", "step s (median [min, max] of repeats, or of steps in one run)", "tokens/s",
              "speedup vs zero3", "vs zeropp", "ledger inter MB/step", "link MB/step", "link ratio",
              "ledger ratio"]  # fmt: skip
    table_text = table(header, out)
    worst = max(s for _, s in share)
    rates = ", ".join(_link(r) for r, _ in share)
    goals.append(f"- `zeropp_deltas`: the link carries at most {DELTAS_BYTES} of ZeRO-3's bytes:"
                 f" **{_met(worst <= DELTAS_BYTES)}** (at most {worst:.3f}, over {rates})")  # fmt: skip
    d200 = _row(sources, paths[0], "zeropp_deltas")
    pp200 = _row(sources, paths[0], "zeropp")
    x200 = pp200["step_s"] / d200["step_s"]
    goals.append(f"- `zeropp_deltas`: a step {DELTAS_SPEEDUP}x faster than the defaults' at 200 Mbit/s:"
                 f" **{_met(x200 >= DELTAS_SPEEDUP)}** ({x200:.2f}x)")  # fmt: skip
    checks_text = table(["link", "link MB saved per step (zeropp - zeropp_deltas)",
                         "its time at the nominal rate, s", "step s saved, measured"], checks)  # fmt: skip
    words = "The bytes weight deltas save, as time at the link's nominal rate, against the step time they saved:"
    return f"{table_text}\n\n{words}\n\n{checks_text}", goals


def _goals_main(sources: dict[str, Source]) -> list[str]:
    path = "slow_link/cluster.json"
    pp200, pp_un = _row(sources, path, "zeropp"), _row(sources, path, "zeropp", None)
    z_un = _zero3(sources, path, None)
    slower = pp_un["step_s"] / z_un["step_s"] - 1
    others = ", ".join(f"{_x(r['speedup_vs_zero3'])} at {_link(r['rate'])}" for r in _rows(sources, path)
                       if r["config"] == "zeropp" and r["rate"] not in (200.0, None))  # fmt: skip
    return [
        f"- `zeropp` at least {GOALS_200}x faster than `zero3` at 200 Mbit/s (`cluster.json`):"
        f" **{_met(pp200['speedup_vs_zero3'] >= GOALS_200)}** ({_x(pp200['speedup_vs_zero3'])}; {others})",
        f"- `zeropp` on the unshaped link at most {GOAL_UNSHAPED:.0%} slower than `zero3` (`cluster.json`):"
        f" **{_met(slower <= GOAL_UNSHAPED)}** ({slower:+.0%}: {pp_un['step_s']:.3f} s against {z_un['step_s']:.3f} s,"
        f" {_x(pp_un['speedup_vs_zero3'])})",
    ]


def _ceiling_text(sources: dict[str, Source]) -> str:
    path = "slow_link/cluster.json"
    parts = []
    for r in _rows(sources, path):
        if r["config"] == "zeropp":
            parts.append(f"{_link(r['rate'])}: {_x(r['speedup_vs_zero3'])} of {_x(1 / r['link_ratio_vs_zero3'])}")
    return "; ".join(parts)


def _link_model(sources: dict[str, Source]) -> str:
    path = "slow_link/cluster.json"
    out = []
    for r in _rows(sources, path):
        if r["rate"] is not None or not r["ledger_inter_bytes_per_step_by_kind"]:
            continue
        kinds = {k: v for k, v in r["ledger_inter_bytes_per_step_by_kind"].items() if v}
        predicted = sum(LINK_FACTOR[k] * v for k, v in kinds.items())
        terms = " + ".join(f"{LINK_FACTOR[k]:g} x {mb(v)} ({k})" for k, v in kinds.items())
        out.append([f"`{r['config']}`", terms, mb(predicted), mb(r["link_tx_bytes_per_step"]),
                    f"{r['link_tx_bytes_per_step'] / predicted - 1:+.2%}"])  # fmt: skip
    return table(["config", "ledger MB/step by kind (node 0), times the wire's factor", "predicted link MB",
                  "measured link MB (unshaped)", "difference"], out)  # fmt: skip


def _ratio_text(sources: dict[str, Source]) -> str:
    r = _row(sources, "slow_link/cluster.json", "zeropp", None)
    below = r["link_ratio_vs_zero3"] < r["ledger_ratio_vs_zero3"]
    return (
        "ZeRO-3 pays gloo's reduce-scatter factor, and qgZ replaces that reduce-scatter with all-to-alls at 1.0: so the"
        f" defaults' link ratio ({r['link_ratio_vs_zero3']:.3f}) is {'below' if below else 'not below'} their ledger"
        f" ratio ({r['ledger_ratio_vs_zero3']:.3f}) here. With NCCL's ring reduce-scatter (3/4, like its all-gather)"
        " the two would sit closer."
    )


def _zero3_drift(sources: dict[str, Source]) -> str:
    """ZeRO-3's step at 200 Mbit/s in the deltas run against the other runs': how loaded the machine was."""
    path = "slow_link/cluster_deltas.json"
    this = _zero3(sources, path, 200.0)["step_s"]
    others = [r["step_s"] for p in SOURCES_1D if p != path for r in _rows(sources, p)
              if r["config"] == "zero3" and r["rate"] == 200.0]  # fmt: skip
    lo, hi = min(others), max(others)
    verdict = f"{this / hi:.1f}x the slowest of the others: the machine ran slower that day." if this > 1.2 * hi else ""
    return (f"ZeRO-3's step at 200 Mbit/s was {this:.3f} s in `cluster_deltas.json`, {lo:.3f} to {hi:.3f} s in the"
            f" other runs{';' if verdict else '.'} {verdict}").rstrip()  # fmt: skip


def _probe_table(sources: dict[str, Source]) -> str:
    probe = _meta(sources, "slow_link/cluster_plan.json").get("link_probe") or {}
    kinds = ["all_gather", "reduce_scatter", "all_to_all", "all_reduce"]
    rows = []
    for rate, by_kind in probe.items():
        cells = []
        for k in kinds:
            pts = sorted(by_kind.get(k, []))
            cells.append(" / ".join(f"{t * 1e3:.1f}" for _, t in pts) or "-")
        rows.append(["unshaped" if rate == "unshaped" else f"{rate} Mbit/s", *cells])
    sizes = sorted({int(p[0]) for by_kind in probe.values() for pts in by_kind.values() for p in pts})
    label = " / ".join(f"{s // 1000} KB" for s in sizes)
    return table(["link", *(f"{k.replace('_', '-')} ms ({label})" for k in kinds)], rows)


# --- with tensor parallelism ----------------------------------------------------------------------------------------


def _tp_base(rows: list[dict], row: dict) -> dict:
    """The row ``row`` is paired with: its topology's ``model_parallel`` at the same rate."""
    return next(r for r in rows if r["config"] == row["baseline"] and r["rate"] == row["rate"]
                and r["topology"] == row["topology"])  # fmt: skip


def _link_seconds(row: dict) -> float | None:
    """The seconds node 0's link bytes of a step take at the link's nominal rate (``None``: unshaped)."""
    return None if row["rate"] is None else row["link_tx_bytes_per_step"] * 8 / (row["rate"] * 1e6)


def _tp_setup(sources: dict[str, Source], path: str = PATH_2D) -> str:
    meta = _meta(sources, path)
    m = meta["llama"]
    return (
        f"The Llama of `benchmarks/llama_tp.py` (vocabulary {m['vocab_size']}, {m['n_layer']} blocks of dimension"
        f" {m['dim']}, {m['n_head']} query and {m['n_kv_head']} key/value heads, SwiGLU hidden {m['ffn_hidden']}:"
        f" {meta['llama_parameters']:,} parameters), sequences of {m['max_seq_len']} bytes, {meta['batch_size']} per"
        " data-parallel rank and step, bf16-mixed, on 2 nodes x 4 gloo ranks; t ranks of each node split every layer"
        " (torch's usual plan with sequence parallelism), FSDP shards over the data-parallel dimension (8 / t ranks)."
        f" One `configure_model` under both strategies: FSDP gathers {m['param_dtype']} weights and reduces"
        f" {m['reduce_dtype']} gradients, the policy Lightning's tensor-parallel example passes (the Llama of"
        " [Bytes per step](bytes_per_step.md#with-tensor-parallelism) gathers fp32 weights: its ratios measure"
        " another baseline and are not comparable with these). `zeropp` is"
        " `ZeroPPStrategy(tensor_parallel_size=t)` with its defaults of the run's day (the ranks per node from the"
        " launch; every gradient quantized in the runs on this page, the defaults until 2026-12-07 19:10: since then"
        " the defaults with tensor parallelism carry norm gains and biases exactly, as `zeropp_matrices` does). Every"
        " configuration of both topologies runs once per round, so each speedup is paired with `model_parallel`'s"
        " repeat of the same round."
    )


def _tp_table(sources: dict[str, Source], path: str = PATH_2D) -> str:
    meta, rows = _meta(sources, path), _rows(sources, path)
    out = []
    order = sorted(rows, key=lambda r: (r["tensor_parallel_size"], _rate_key(r["rate"]), r["config"] != TP_BASELINE))
    for r in order:
        base = _tp_base(rows, r)
        speedup = "1" if r is base else _x(*_paired(_repeats(base, meta), _repeats(r, meta)))
        seconds = _link_seconds(r)
        at_rate = "-" if seconds is None else f"{seconds:.3f}"
        share = "-" if seconds is None else f"{seconds / r['step_s']:.0%}"
        out.append([f"`{r['topology']}`", r["tensor_parallel_size"], _link(r["rate"]), f"`{r['config']}`",
                    _step(r, meta), f"{r['tokens_per_s']:.0f}", speedup, _mb(r["ledger_inter_bytes_per_step"]),
                    mb(r["link_tx_bytes_per_step"]), _ratio(r[f"link_ratio_vs_{TP_BASELINE}"]),
                    _x(1 / r[f"link_ratio_vs_{TP_BASELINE}"]), at_rate, share])  # fmt: skip
    header = ["topology", "t", "link", "config", _step_header(sources, path), "tokens/s",
              f"speedup vs `{TP_BASELINE}` (paired)", "ledger inter MB/step", "link MB/step", "link ratio",
              "1 / link ratio", "link s/step at the nominal rate", "of the step"]  # fmt: skip
    return table(header, out)


def _goals_2d(sources: dict[str, Source], path: str = PATH_2D, config: str = "zeropp") -> list[str]:
    """The goal's verdict for ``config`` at each tensor-parallel size in the file."""
    meta, rows = _meta(sources, path), _rows(sources, path)
    out = []
    for t in sorted({r["tensor_parallel_size"] for r in rows}):
        at = [r for r in rows if r["tensor_parallel_size"] == t and r["rate"] == GOAL_2D_RATE]
        pp = next((r for r in at if r["config"] == config), None)
        base = next((r for r in at if r["config"] == TP_BASELINE), None)
        head = (f"- t = {t}: `{config}` at least {GOAL_2D:g}x faster than `{TP_BASELINE}` at {_link(GOAL_2D_RATE)},"
                " the step intervals apart")  # fmt: skip
        if pp is None or base is None:
            out.append(f"{head}: **not measured** (`{path.split('/')[-1]}` has no such pair)")
            continue
        reps, base_reps = _repeats(pp, meta), _repeats(base, meta)
        med, lo, hi = _paired(base_reps, reps)
        apart = _apart(pp, base, meta)
        if len(reps) < MIN_REPEATS:
            verdict = f"undecided: {len(reps)} repeat(s), an interval needs {MIN_REPEATS}"
        else:
            verdict = _met(med >= GOAL_2D and apart)
        told = "apart" if apart else "overlapping"
        out.append(f"{head} (`{pp['topology']}`): **{verdict}** (paired {_x(med, lo, hi)}; step {_step(pp, meta)} s"
                   f" against {_step(base, meta)} s, {told})")  # fmt: skip
    return out


def _tp_dominates(sources: dict[str, Source], path: str = PATH_2D) -> str:
    """Per shaped row: the share of its step its link bytes need at the nominal rate, and what that leaves."""
    rows = [r for r in _rows(sources, path) if r["rate"] is not None]
    lines = []
    for r in sorted(rows, key=lambda r: (r["tensor_parallel_size"], _rate_key(r["rate"]), r["config"])):
        seconds = _link_seconds(r)
        share = seconds / r["step_s"]
        what = "mostly the link" if share >= 0.5 else "mostly not the link"
        lines.append(f"- `{r['topology']}` `{r['config']}` at {_link(r['rate'])}: {mb(r['link_tx_bytes_per_step'])}"
                     f" MB/step on the link need {seconds:.3f} s of its {r['step_s']:.3f} s step ({share:.0%},"
                     f" {what}); {r['step_s'] - seconds:.3f} s left to the rest.")  # fmt: skip
    return "\n".join(lines)


def _tensor_parallel(sources: dict[str, Source], path: str = PATH_2D) -> str:
    """The section of the tensor-parallel rows."""
    return f"""{_run_line(sources, path)}

{_tp_setup(sources, path)}

{_tp_table(sources, path)}

"1 / link ratio" is what the bytes alone allow: `zeropp` cannot beat `{TP_BASELINE}` by more where the link is all
that counts. "link s/step at the nominal rate" is node 0's link bytes of a step over the link's rate: the time the link
needs at the least; "of the step" its share of the step time. The rest of a step is everything else: the 8 ranks'
compute on the machine's shared cores (with the tensor-parallel collectives inside each node, and ZeRO++'s quantizers
as their pure-torch twins), and whatever the link loses below its nominal rate. What fills each step:

{_tp_dominates(sources, path)}

### Goal

{chr(10).join(_goals_2d(sources, path))}

{_tp_matrices(sources)}

{_tp_auto(sources)}

{_tp_vectors(sources, path)}

{_tp_loaded(sources, path)}"""


def _tp_auto(sources: dict[str, Source], path: str = PATH_2D_THIRD) -> str:
    """The decisions log's rule of 18:45 (its step half) and the third measurement of the 2-D goal."""
    if path not in sources:
        return ""
    ratios = [_over_defaults(sources, t, path) for t in (2, 4)]
    held = all(r is not None and r[0] <= RULE for r in ratios)
    title = "The decisions log's run of 18:45: norm gains and biases exact where tensor parallelism runs"
    return (
        _tp_matrices(sources, path, title)
        + "\n\nThe [decisions log](../decisions.md) (2026-12-07 18:45) fixed before this run that"
        ' `gradient_quantization_scope="auto"` (`"matrices"` with tensor parallelism, `"all"` without) becomes the'
        " default if, among other things, `zeropp_matrices`' step here is within 5% of `zeropp`'s at t = 2 and at"
        f" t = 4 (by the median of the ratios paired by round): the step half **{_met(held)}**. Its accuracy half"
        " is on [Loss with tensor parallelism](tensor_parallel_accuracy.md)."
    )


def _over_defaults(sources: dict[str, Source], t: int, path: str) -> tuple[float, float, float] | None:
    """``zeropp_matrices``' step over ``zeropp``'s at tensor-parallel size ``t``, paired by round: (median, min,
    max)."""
    meta, rows = _meta(sources, path), _rows(sources, path)
    at = {r["config"]: r for r in rows if r["tensor_parallel_size"] == t and r["rate"] == GOAL_2D_RATE}
    if "zeropp" not in at or "zeropp_matrices" not in at:
        return None
    return _paired(_repeats(at["zeropp_matrices"], meta), _repeats(at["zeropp"], meta))


def _tp_matrices(sources: dict[str, Source], path: str = PATH_2D_MATRICES,
                 title: str = "With norm gains and biases carried exactly") -> str:  # fmt: skip
    """The run with norm gains and biases carried exactly: its table, ``zeropp_matrices``' step over the defaults'
    (paired by round), and the goal for both."""
    if path not in sources:
        return ""
    meta, rows = _meta(sources, path), _rows(sources, path)
    lines = []
    for t in sorted({r["tensor_parallel_size"] for r in rows}):
        at = {r["config"]: r for r in rows if r["tensor_parallel_size"] == t and r["rate"] == GOAL_2D_RATE}
        if "zeropp" in at and "zeropp_matrices" in at:
            med, lo, hi = _paired(_repeats(at["zeropp_matrices"], meta), _repeats(at["zeropp"], meta))
            lines.append(f"- t = {t}: `zeropp_matrices`' step over `zeropp`'s, paired by round: {med:.3f} [{lo:.3f},"
                         f" {hi:.3f}]; within 5% (the rule for a default, by the median):"
                         f" **{_met(med <= RULE)}**")  # fmt: skip
    return (
        f"### {title}\n\n"
        f"{_run_line(sources, path)}\n\n"
        f'`zeropp_matrices` is the defaults with `gradient_quantization_scope="matrices"`: the gradients of norm gains'
        " and biases cross nodes exactly, as raw bytes carried in qgZ's own all-to-alls (no collective of their own)."
        " Every configuration runs once per round, so each is paired with the others' repeat of the same round.\n\n"
        f"{_tp_table(sources, path)}\n\n"
        + "\n".join(lines)
        + "\n\nThe goal, as this run judges it:\n\n"
        + "\n".join(_goals_2d(sources, path, "zeropp_matrices") + _goals_2d(sources, path))
    )


def _tp_vectors(sources: dict[str, Source], path: str = PATH_2D, other: str = PATH_2D_VECTORS) -> str:
    """The same command's quiet run with norm gains and biases reduced exactly: each configuration's step there and
    here, and the goal as that run judged it."""
    if other not in sources or path == other:
        return ""
    here = _rows(sources, path)
    lines = []
    for r in sorted(_rows(sources, other), key=lambda r: (r["tensor_parallel_size"], r["config"])):
        key = (r["topology"], r["config"], r["rate"])
        q = next((x for x in here if (x["topology"], x["config"], x["rate"]) == key), None)
        if q is None or r["rate"] is None:
            continue
        lines.append(f"- `{r['topology']}` `{r['config']}`: {r['step_s']:.3f} s a step there, {q['step_s']:.3f} s in"
                     f" the run above ({r['step_s'] / q['step_s'] - 1:+.1%})")  # fmt: skip
    return (
        "### With norm gains and biases reduced exactly\n\n"
        f"The same command on the quiet machine ({_date(sources[other])}, `benchmarks/data/{other}`), with"
        ' `gradient_quantization_scope="matrices"`, the default from 2026-12-07 12:08 until this run and the paired'
        " 1-D run (`cluster_vectors.json`, in the rule's table) measured its step. Not paired with the run above"
        " (hours apart):\n\n"
        + "\n".join(lines)
        + "\n\nThat run judged the goal so:\n\n"
        + "\n".join(_goals_2d(sources, other))
        + "\n\nThe vectors' exact reduction adds under 1% of cross-node bytes but two small collectives per unit"
        " (one where t fills the node); on these 8 ranks sharing 2 cores each collective waits for its ranks to be"
        " scheduled."
    )


def _tp_loaded(sources: dict[str, Source], path: str = PATH_2D, loaded: str = PATH_2D_LOADED) -> str:
    """The goal as the same command's run on a loaded machine judged it, and the rest of each step in both runs:
    the goal at t = 4 holds on a quiet machine only."""
    if loaded not in sources:
        return ""
    quiet_rows, loaded_rows = _rows(sources, path), _rows(sources, loaded)
    lines = []
    for r in sorted(loaded_rows, key=lambda r: (r["tensor_parallel_size"], r["config"])):
        q = next((x for x in quiet_rows if (x["topology"], x["config"], x["rate"]) == (r["topology"], r["config"],
                                                                                        r["rate"])), None)  # fmt: skip
        if q is None or r["rate"] is None:
            continue
        rest, quiet_rest = r["step_s"] - _link_seconds(r), q["step_s"] - _link_seconds(q)
        lines.append(f"- `{r['topology']}` `{r['config']}`: {rest:.3f} s of each step besides the link, against"
                     f" {quiet_rest:.3f} s in the run above")  # fmt: skip
    goals = _goals_2d(sources, loaded)
    return (
        f"The same command ran earlier on this machine while a study ran beside it ({_date(sources[loaded])},"
        f" `benchmarks/data/{loaded}`). The link's seconds were the same; the rest of each step, the 8 ranks' compute"
        " on 2 shared cores, was not:\n\n"
        + "\n".join(lines)
        + "\n\nThat run judged the goal so:\n\n"
        + "\n".join(goals)
        + "\n\nOn a machine whose compute is slow against its link the speedup shrinks toward"
        " the ratio of the two strategies' compute: the goal is a statement about link-bound steps."
    )


def render(sources: dict[str, Source]) -> str:
    main = "slow_link/cluster.json"
    deltas_table, deltas_goals = _deltas(sources)
    qh = "slow_link/cluster_qhsdp.json"
    qh_hsdp, qh_q = _row(sources, qh, "hsdp"), _row(sources, qh, "qhsdp")
    configs = [r["config"] for p in SOURCES for r in _rows(sources, p)]
    return f"""Speedups are against ZeRO-3 at the same link rate in the same run. Where a run had repeats, a step time
is the median over repeats with the range [min, max] of the repeats, and a speedup is paired: repeat r against ZeRO-3's
repeat r of the same round, its median and range over the rounds (`cluster.py`); two configurations differ when their
ranges do not overlap. "link ratio" is a configuration's link bytes over ZeRO-3's, "link / ledger" what the wire
carries per byte the ledger counts.

## Summary

ZeRO++'s defaults against ZeRO-3, in every run that has both (machine load differs between runs and days, which is
why each study compares configurations inside one run only):

{_defaults_every_run(sources)}

Quantized HSDP at 200 Mbit/s (`cluster_qhsdp.json`): {_x(qh_hsdp['step_s'] / qh_q['step_s'])} faster than exact HSDP
by the ratio of their median steps, on {qh_q['link_tx_bytes_per_step'] / qh_hsdp['link_tx_bytes_per_step']:.3f} of
its link bytes ([details](#quantized-hsdp-against-hsdp)).

The step-time rule for a default ([decisions log](../decisions.md)): on this cluster at 200 Mbit/s, a candidate's step
within 5% of the defaults' it is paired with, by the median of the paired ratios (candidate over defaults, repeat by
repeat):

{_rule_table(sources)}

### Goals

{chr(10).join(_goals_main(sources) + deltas_goals + _goals_2d(sources))}

## ZeRO++ and each technique against ZeRO-3, by link rate

{_figure("cluster.png", "step time and speedup per configuration and link rate")}

{_run_line(sources, main)}

{_main_table(sources, main)}

{_legend([r["config"] for r in _rows(sources, main)])}

What the bytes alone allow: a configuration cannot beat ZeRO-3 by more than ZeRO-3's link bytes over its own (1 /
link ratio) where the link is all that counts. `zeropp`'s speedup against that ceiling: {_ceiling_text(sources)}.
The gap below the ceiling is time the bytes do not explain: on this machine, mostly the CPU time the quantizers add,
which is all that is left on the unshaped link.

### Why the link and the ledger differ

The ledger counts bytes per peer; a wire carries what the collective's algorithm routes. With gloo on 4 ranks as
2 x 2, a ring all-gather carries 3/4 of its ledger bytes across the node boundary, gloo's reduce-scatter 6/4 (twice a
ring's), an all-to-all what the ledger counts. Node 0's ledger bytes by kind times these factors, against its veth
counter on the unshaped link (the rest is TCP/IP headers and the rendezvous store's traffic; a shaped link adds TCP
retransmissions after tbf drops):

{_link_model(sources)}

{_ratio_text(sources)}

## Quantized HSDP against HSDP

{_run_line(sources, qh)}

{_qhsdp_table(sources)}

{_qhsdp_text(sources)}

## Weight deltas

{_figure("cluster_deltas.png", "weight deltas' step time against zero3 and zeropp")}

{_run_line(sources, "slow_link/cluster_deltas.json")}

{_run_line(sources, "slow_link/cluster_deltas_20mbit.json")}

{_zero3_drift(sources)} The configurations inside one run saw the same machine.

{deltas_table}

## The candidates for the defaults, in detail

The summary's rule table pairs each candidate with the defaults of its run.

{_detail(sources, "slow_link/cluster_candidates.json", "zeropp")}

### The second-moment correction

{_detail(sources, "slow_link/cluster_smc.json", "zeropp")}

{_detail(sources, "slow_link/cluster_smc_default.json", "zeropp_nosmc")}

### Error feedback

{_figure("cluster_feedback.png", "error feedback's step time against the defaults")}

{_detail(sources, "slow_link/cluster_feedback.json", "zeropp")}

{_detail(sources, "slow_link/cluster_ef_smc.json", "zeropp")}

{_detail(sources, "slow_link/cluster_ef_smc_rows.json", "zeropp")}

`cluster_ef_smc_rows.json` is the same command as `cluster_ef_smc.json` after the torch twin's re-quantization took
a unit's rows at once with a residual (bit for bit the same results).

### Norm gains and biases exact

`gradient_quantization_scope="matrices"`. In `cluster_vectors.json` (`zeropp` there, the default of that day) the
vectors took two collectives of their own per unit beside qgZ; in `cluster_matrices.json` (`zeropp_matrices`) they ride
qgZ's own all-to-alls; `cluster_matrices_twin.json` is the same command after the torch twin stopped masking every
element of a row that holds an all-zero block (the carried spans leave such blocks), and so is
`cluster_matrices_2.json`.

{_detail(sources, "slow_link/cluster_vectors.json", "zeropp_quantized_vectors")}

{_detail(sources, "slow_link/cluster_matrices.json", "zeropp")}

{_detail(sources, "slow_link/cluster_matrices_twin.json", "zeropp")}

{_detail(sources, "slow_link/cluster_matrices_2.json", "zeropp")}

`cluster_matrices_2.json` is the 1-D half of the decisions log's second trial (16:14), the same command again.

## The planner's run: four configurations at four rates

The data [How right the planner is](planner.md) predicts: every configuration on the unshaped link (its compute) and
at three shaped rates, with the link probe (`benchmarks/link_probe.py`: each collective alone, 4 ranks in the
training's layout, timed at two sizes per rank).

{_figure("cluster_plan.png", "step time per configuration at four link rates")}

{_run_line(sources, "slow_link/cluster_plan.json")}

{_main_table(sources, "slow_link/cluster_plan.json")}

The link probe, milliseconds per call at the two sizes per rank:

{_probe_table(sources)}

## With tensor parallelism

{_tensor_parallel(sources)}

## Configurations

{_legend(configs)}
"""  # fmt: skip


def _detail(sources: dict[str, Source], path: str, defaults: str) -> str:
    meta = _meta(sources, path)
    base_row = _row(sources, path, defaults)
    out = []
    for r in _rows(sources, path):
        z = _zero3(sources, path, r["rate"])
        against = ""
        if r["config"] not in ("zero3", defaults):
            med, lo, hi = _paired(_repeats(r, meta), _repeats(base_row, meta))
            against = f"{med:.3f} [{lo:.3f}, {hi:.3f}]"
        elif r["config"] == defaults:
            against = "1"
        out.append([f"`{r['config']}`", _step(r, meta), f"{r['tokens_per_s']:.0f}", _speedup(r, z, meta), against,
                    mb(r["link_tx_bytes_per_step"]), _ratio(r["link_over_ledger"])])  # fmt: skip
    header = ["config", _step_header(sources, path), "tokens/s", "speedup vs zero3",
              f"step over `{defaults}`'s (paired)", "link MB/step", "link / ledger"]  # fmt: skip
    return f"{_run_line(sources, path)}\n\n{table(header, out)}"


def _tp_speedup(sources: dict[str, Source], t: int, path: str = PATH_2D, config: str = "zeropp") -> str:
    """``config``'s paired speedup over ``model_parallel`` at tensor-parallel size ``t`` and the goal's rate."""
    meta, rows = _meta(sources, path), _rows(sources, path)
    at = {r["config"]: r for r in rows if r["tensor_parallel_size"] == t and r["rate"] == GOAL_2D_RATE}
    if config not in at or TP_BASELINE not in at:
        return "-"
    return _x(*_paired(_repeats(at[TP_BASELINE], meta), _repeats(at[config], meta)))


def _tp_over_defaults(sources: dict[str, Source], t: int, path: str = PATH_2D_MATRICES) -> str:
    """``zeropp_matrices``' step over the defaults' at tensor-parallel size ``t``, paired by round (median [min,
    max])."""
    paired = _over_defaults(sources, t, path)
    return "-" if paired is None else "{:.3f} [{:.3f}, {:.3f}]".format(*paired)


HEADLINES = {PATH_2D: [("t = 2, speedup vs ModelParallelStrategy", "tp_speedup_t2"),
                       ("t = 4", "tp_speedup_t4")],
             PATH_2D_MATRICES: [("defaults vs ModelParallelStrategy, t = 2", "tp_speedup_t2_later"),
                                ("t = 4", "tp_speedup_t4_later"),
                                ("norm gains and biases carried, step over the defaults', t = 2", "matrices_tp_t2"),
                                ("t = 4", "matrices_tp_t4")],
             PATH_2D_THIRD: [("every gradient quantized vs ModelParallelStrategy, t = 2", "tp_speedup_t2_third"),
                             ("t = 4", "tp_speedup_t4_third"),
                             ("norm gains and biases exact vs ModelParallelStrategy, t = 2",
                              "tp_matrices_speedup_t2_third"),
                             ("t = 4", "tp_matrices_speedup_t4_third"),
                             ("norm gains and biases exact, step over every gradient quantized, t = 2",
                              "matrices_tp_t2_third"),
                             ("t = 4", "matrices_tp_t4_third")],
             "slow_link/cluster_vectors.json": [("norm gains and biases exact, step vs the defaults (paired)",
                                                 "vectors_step_ratio")],
             "slow_link/cluster_matrices.json": [("norm gains and biases carried exactly, step vs the defaults"
                                                  " (paired)", "matrices_step_ratio")],
             "slow_link/cluster_matrices_twin.json": [("the same after the twin's zero-block fix",
                                                       "matrices_twin_step_ratio")],
             "slow_link/cluster_matrices_2.json": [("the second trial's 1-D half",
                                                    "matrices_2_step_ratio")]}  # fmt: skip
"""Per data file, the figures ``benchmarks/RESULTS.md`` shows beside its newest run (snippet names)."""


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    main, qh, cand = "slow_link/cluster.json", "slow_link/cluster_qhsdp.json", "slow_link/cluster_candidates.json"
    rule = {(path, config): med for path, config, _, med, *_ in _rule_rows(sources)}
    return {
        "tp_speedup_t2": _tp_speedup(sources, 2),
        "tp_speedup_t4": _tp_speedup(sources, 4),
        "tp_speedup_t2_later": _tp_speedup(sources, 2, PATH_2D_MATRICES),
        "tp_speedup_t4_later": _tp_speedup(sources, 4, PATH_2D_MATRICES),
        "matrices_tp_t2": _tp_over_defaults(sources, 2),
        "matrices_tp_t4": _tp_over_defaults(sources, 4),
        "tp_speedup_t2_third": _tp_speedup(sources, 2, PATH_2D_THIRD),
        "tp_speedup_t4_third": _tp_speedup(sources, 4, PATH_2D_THIRD),
        "tp_matrices_speedup_t2_third": _tp_speedup(sources, 2, PATH_2D_THIRD, "zeropp_matrices"),
        "tp_matrices_speedup_t4_third": _tp_speedup(sources, 4, PATH_2D_THIRD, "zeropp_matrices"),
        "matrices_tp_t2_third": _tp_over_defaults(sources, 2, PATH_2D_THIRD),
        "matrices_tp_t4_third": _tp_over_defaults(sources, 4, PATH_2D_THIRD),
        "zeropp_speedup_50": _x(_row(sources, main, "zeropp", 50.0)["speedup_vs_zero3"]),
        "zeropp_speedup_200": _x(_row(sources, main, "zeropp", 200.0)["speedup_vs_zero3"]),
        "zeropp_speedup_unshaped": _x(_row(sources, main, "zeropp", None)["speedup_vs_zero3"]),
        "qhsdp_speedup_200": _x(_row(sources, qh, "hsdp")["step_s"] / _row(sources, qh, "qhsdp")["step_s"]),
        # a candidate's step against the defaults it was paired with: the paired median of the rule's table
        "smc_step_ratio": _x(rule[("slow_link/cluster_smc_default.json", "zeropp")], digits=3),
        "feedback_step_ratio": _x(rule[("slow_link/cluster_ef_smc_rows.json", "zeropp_ef")]),
        "vectors_step_ratio": _x(rule[("slow_link/cluster_vectors.json", "zeropp")], digits=2),
        "matrices_step_ratio": _x(rule[("slow_link/cluster_matrices.json", "zeropp_matrices")], digits=2),
        "matrices_twin_step_ratio": _x(rule[("slow_link/cluster_matrices_twin.json", "zeropp_matrices")], digits=2),
        "matrices_2_step_ratio": _x(rule[("slow_link/cluster_matrices_2.json", "zeropp_matrices")], digits=3),
        "qgz8_step_ratio": _x(rule[("slow_link/cluster_candidates.json", "zeropp_qgz8")]),
        "qgz8_bytes_ratio": _x(
            _row(sources, cand, "zeropp_qgz8")["ledger_inter_bytes_per_step"]
            / _row(sources, cand, "zeropp")["ledger_inter_bytes_per_step"],
            digits=3,
        ),
    }
