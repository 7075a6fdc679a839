"""Bytes per training step, inside and across nodes, by configuration and node count (``comm_volume.py``)."""

from __future__ import annotations

from pages import Source, mb, table

TITLE = "Bytes per step"
QUESTION = """How many bytes does one training step send across nodes and inside them, for each configuration?

Two optimizer steps of the example GPT in bf16-mixed on gloo ranks emulating `nodes x ranks_per_node`; the figures
are the second step's (the steady state), by the ledger: logical payload bytes per peer, of the busiest rank. The
ledger is exact and repeatable; what a real link carries is on [Step time on a slow link](slow_link.md)."""

SOURCES = [
    "bytes_per_step/comm_volume.json",
    "bytes_per_step/comm_volume_2d.json",
    "archive/comm_volume_2026-12-07_vectors.json",
    "archive/comm_volume_2d_2026-12-07_vectors.json",
]
VECTORS_SOURCES = SOURCES[2:]
"""The runs made while norm gains and biases exact were the default (2026-12-07 12:08 until the rule was withdrawn):
their ``zeropp`` rows are that configuration, the rule's bytes half reads them."""

ORDER = ["zero3", "hsdp", "qhsdp", "qhsdp_bf16", "qhsdp_int4", "qhsdp_ef", "qwz", "hpz", "qgz", "zeropp",
         "zeropp_quantized_vectors", "zeropp_matrices", "zeropp_ef", "zeropp_deltas", "zeropp_deltas8"]  # fmt: skip

MEANING = {
    "zero3": "exact ZeRO-3 (FSDP2 `FULL_SHARD`), every technique off",
    "hsdp": '`sharding_strategy="HYBRID_SHARD"`: shard inside the node, all-reduce across nodes',
    "qhsdp": '`strategy="qhsdp"`: HSDP with the cross-node all-reduce in INT4 then INT8',
    "qhsdp_bf16": "qhsdp with `hsdp_gather_bits=16`",
    "qhsdp_int4": "qhsdp with `hsdp_gather_bits=4`",
    "qhsdp_ef": "qhsdp with `gradient_error_feedback=True`",
    "qwz": "qwZ alone (INT8 forward all-gather)",
    "hpz": "hpZ alone (a secondary partition inside the node)",
    "qgz": "qgZ alone (2-hop INT4 gradient all-to-all)",
    "zeropp": "the defaults: qwZ + hpZ + qgZ",
    "zeropp_quantized_vectors": '`gradient_quantization_scope="all"` set outright: the defaults (every gradient'
    " quantized), measured beside them as the rule of 2026-12-07 12:08 needed",
    "zeropp_matrices": 'the defaults with `gradient_quantization_scope="matrices"`: norm gains and biases cross'
    " nodes exactly, carried in qgZ's all-to-alls",
    "zeropp_ef": "the defaults with `gradient_error_feedback=True`",
    "zeropp_deltas": "the defaults with `weight_deltas=True` (INT4 deltas)",
    "zeropp_deltas8": "the defaults with `weight_deltas=True, weight_delta_bits=8`",
}

GOALS = [("zeropp", 0.26), ("zeropp_deltas", 0.12)]
"""The goals set when the techniques were built: a configuration's cross-node bytes at most this share of ZeRO-3's."""


TWO_D_ORDER = ["exact_2d", "qwz", "hpz", "qgz", "zeropp", "zeropp_quantized_vectors", "zeropp_matrices"]
TWO_D_MEANING = {
    "exact_2d": "every technique off: the collectives ModelParallelStrategy runs on the same mesh (bit-identical"
    " training, tests/test_tensor_parallel_llama.py)",
    "qwz": "qwZ alone",
    "hpz": "hpZ alone (over the node's data-parallel ranks; none where t fills the node)",
    "qgz": "qgZ alone",
    "zeropp": "the defaults (since 2026-12-07 19:10 with t > 1: norm gains and biases exact, carried in qgZ's"
    " all-to-alls; every gradient quantized in runs before)",
    "zeropp_quantized_vectors": 'every gradient quantized (`gradient_quantization_scope="all"`): the 2-D defaults'
    " until 2026-12-07 19:10",
    "zeropp_matrices": '`gradient_quantization_scope="matrices"` set outright (norm gains and biases exact): with t > 1'
    " what the defaults run since 2026-12-07 19:10",
}
VECTORS_BOUND = 1.02
"""The decisions log's rule of 2026-12-07 12:08, its bytes half: with norm gains and biases reduced exactly, the
defaults' cross-node bytes at most this many times those with every gradient quantized, at every node count."""
TWO_D_GOAL = ("zeropp", 2, 0.3)
"""Issue 60's goal: with t = 2, the defaults' cross-node bytes at most this share of ModelParallelStrategy's."""


def _two_d(data: list[dict]) -> str:
    rows = sorted(data, key=lambda r: (r["nodes"], r["ranks_per_node"], r["tensor_parallel_size"],
                                       TWO_D_ORDER.index(r["config"])))  # fmt: skip
    cells = [
        [f"{r['nodes']}x{r['ranks_per_node']}", str(r["tensor_parallel_size"]), f"`{r['config']}`",
         mb(r["inter_node_bytes_per_step"]), mb(r["intra_node_bytes_per_step"]), f"{r['ratio_vs_zero3']:.4f}",
         mb(r["backward_all_gather_inter_node_bytes"])]
        for r in rows
    ]  # fmt: skip
    config, t, goal = TWO_D_GOAL
    at = _two_d_ratios(data)
    verdict = "met" if at and max(at) <= goal else "NOT met"
    legend = "\n".join(f"- `{c}`: {TWO_D_MEANING[c]}" for c in TWO_D_ORDER if any(r["config"] == c for r in data))
    params = ", ".join(f"{p:,}" for p in sorted({r["params"] for r in data}))
    return f"""## With tensor parallelism

A Llama under torch's usual tensor-parallel plan ({params} parameters; `testing.models.LlamaModule`, written for
ModelParallelStrategy), t ranks of each node splitting every layer, ZeRO++ over the data-parallel dimension; the
same two steps. The ledger counts the data-parallel collectives; the plan's activation all-reduces stay inside the
node and are not in these figures. The ratio is against `exact_2d`. The module's `fully_shard` calls pass no
`mp_policy`, as such a `configure_model` usually does, so FSDP gathers fp32 weights and reduces fp32 gradients under
either strategy: against bf16 collectives the quantized rows' ratios would be about twice these. So these ratios
and [the slow link's](slow_link.md#with-tensor-parallelism), whose Llama gathers bf16 weights, measure different
baselines and are not to be compared.

{table(["nodes x ranks", "t", "config", "inter MB", "intra MB", "ratio", "backward AG inter MB"], cells)}

{legend}

- `{config}` at t = {t}: cross-node bytes at most {goal} of ModelParallelStrategy's: **{verdict}**
  ({_span(at) if at else "no run"})
"""


def _rows(data: list[dict]) -> list[dict]:
    known = [r for r in data if r["config"] in ORDER]
    return sorted(known, key=lambda r: (r["nodes"], r["ranks_per_node"], ORDER.index(r["config"])))


def _ratios(data: list[dict], config: str) -> list[float]:
    return [r["ratio_vs_zero3"] for r in data if r["config"] == config]


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.4f}" if f"{lo:.4f}" == f"{hi:.4f}" else f"{lo:.4f} to {hi:.4f}"


def _topologies(data: list[dict]) -> str:
    return ", ".join(sorted({f"{r['nodes']}x{r['ranks_per_node']}" for r in data}))


def render(sources: dict[str, Source]) -> str:
    data = sources[SOURCES[0]].data
    params = {r["params"] for r in data}
    rows = [
        [f"{r['nodes']}x{r['ranks_per_node']}", f"`{r['config']}`", mb(r["inter_node_bytes_per_step"]),
         mb(r["intra_node_bytes_per_step"]), f"{r['ratio_vs_zero3']:.4f}",
         mb(r["backward_all_gather_inter_node_bytes"]), mb(r["first_step_inter_node_bytes"])]
        for r in _rows(data)
    ]  # fmt: skip
    goals = [
        f"- `{c}`: cross-node bytes at most {g} of ZeRO-3's: **{'met' if max(_ratios(data, c)) <= g else 'NOT met'}**"
        f" ({_span(_ratios(data, c))} at {_topologies(data)})"
        for c, g in GOALS
    ]
    hpz = [r["backward_all_gather_inter_node_bytes"] for r in data if r["config"] == "hpz"]
    goals.append(
        f"- `hpz`: no backward all-gather byte crosses nodes: **{'met' if hpz and max(hpz) == 0 else 'NOT met'}**"
    )
    hsdp = {(r["nodes"], r["ranks_per_node"]): r["inter_node_bytes_per_step"] for r in data if r["config"] == "hsdp"}
    qhsdp = [
        [f"{r['nodes']}x{r['ranks_per_node']}", f"`{r['config']}`",
         f"{r['inter_node_bytes_per_step'] / hsdp[(r['nodes'], r['ranks_per_node'])]:.4f}"]
        for r in _rows(data)
        if r["config"].startswith("qhsdp") and (r["nodes"], r["ranks_per_node"]) in hsdp
    ]  # fmt: skip
    legend = "\n".join(f"- `{c}`: {MEANING[c]}" for c in ORDER if any(r["config"] == c for r in data))
    return f"""The model: the example GPT, {", ".join(f"{p:,}" for p in sorted(params))} parameters.

| | |
|---|---|
| inter / intra MB | megabytes (10^6) per step crossing nodes / staying inside the node |
| ratio | cross-node bytes as a share of ZeRO-3's at the same node count |
| backward AG inter MB | the backward all-gather's cross-node bytes (hpZ's target: none) |
| first step inter MB | the first step's cross-node bytes (weight deltas fill the node copies exactly on it) |

{table(["nodes x ranks", "config", "inter MB", "intra MB", "ratio", "backward AG inter MB", "first step inter MB"],
       rows)}

{legend}

## Goals

{chr(10).join(goals)}

## Quantized HSDP against HSDP

Cross-node bytes as a share of exact HSDP's at the same node count (HSDP's only cross-node traffic is its gradient
all-reduce, which qhsdp quantizes).

{table(["nodes x ranks", "config", "share of hsdp's"], qhsdp)}

{_two_d(sources[SOURCES[1]].data)}

{_vectors_section(sources)}"""  # fmt: skip


def _vectors_section(sources: dict[str, Source]) -> str:
    result, lines = vectors_rule(sources)
    return f"""## Norm gains and biases reduced exactly: the decisions log's rule, its bytes half

The [decisions log](../decisions.md) (2026-12-07 12:08): with `gradient_quantization_scope="matrices"` the defaults'
cross-node bytes per step at most {VECTORS_BOUND:g}x those with every gradient quantized, and with t = 2 at most
{TWO_D_GOAL[2]} of the exact 2-D run's; read from the runs made while it was the default
(`benchmarks/data/archive/comm_volume*_2026-12-07_vectors.json`, where `zeropp` is that configuration). The rule was
withdrawn for its step time ([decisions log](../decisions.md)); the tables above are today's defaults:

{chr(10).join(lines) or "- no layout measured with both configurations"}

The bytes half **{result}**. The accuracy halves are on [Loss with tensor parallelism](tensor_parallel_accuracy.md)
and [Loss against ZeRO-3](accuracy.md)."""


def _of_hsdp(data: list[dict], config: str) -> list[float]:
    hsdp = {(r["nodes"], r["ranks_per_node"]): r["inter_node_bytes_per_step"] for r in data if r["config"] == "hsdp"}
    return [r["inter_node_bytes_per_step"] / hsdp[(r["nodes"], r["ranks_per_node"])]
            for r in data if r["config"] == config and (r["nodes"], r["ranks_per_node"]) in hsdp]  # fmt: skip


def vectors_rule(sources: dict[str, Source]) -> tuple[str, list[str]]:
    """The bytes half of the decisions log's rule for ``gradient_quantization_scope``: per measured layout, the
    defaults' (``zeropp``, norm gains and biases exact) cross-node bytes over ``zeropp_quantized_vectors``' at most
    :data:`VECTORS_BOUND`, and with t = 2 the defaults at most the 2-D goal's share of the exact 2-D run's."""
    lines, held = [], []
    for path in VECTORS_SOURCES:
        rows = sources[path].data
        layouts = sorted({(r["nodes"], r["ranks_per_node"], r.get("tensor_parallel_size", 1)) for r in rows})
        for nodes, per_node, t in layouts:
            at = {r["config"]: r for r in rows if (r["nodes"], r["ranks_per_node"], r.get("tensor_parallel_size", 1))
                  == (nodes, per_node, t)}  # fmt: skip
            if "zeropp" not in at or "zeropp_quantized_vectors" not in at:
                continue
            ratio = (
                at["zeropp"]["inter_node_bytes_per_step"] / at["zeropp_quantized_vectors"]["inter_node_bytes_per_step"]
            )
            ok = ratio <= VECTORS_BOUND
            where = f"{nodes}x{per_node}" + (f", t = {t}" if t > 1 else "")
            text = f"- {where}: {ratio:.4f} of the cross-node bytes with every gradient quantized"
            if t == TWO_D_GOAL[1]:
                share = at["zeropp"]["ratio_vs_zero3"]
                ok = ok and share <= TWO_D_GOAL[2]
                text += f", {share:.4f} of the exact 2-D run's (at most {TWO_D_GOAL[2]})"
            held.append(ok)
            lines.append(f"{text} ({'holds' if ok else 'fails'})")
    if not held:
        return "not measured", lines
    return ("holds" if all(held) else "fails"), lines


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    data = sources[SOURCES[0]].data
    of_hsdp = _of_hsdp(data, "qhsdp")
    return {
        "qhsdp_of_hsdp": f"{min(of_hsdp):.2f}"
        if f"{min(of_hsdp):.2f}" == f"{max(of_hsdp):.2f}"
        else f"{min(of_hsdp):.2f}-{max(of_hsdp):.2f}",
        "zeropp_ratio": _span(_ratios(data, "zeropp")),
        "deltas_ratio": _span(_ratios(data, "zeropp_deltas")),
        "topologies": _topologies(data),
        "two_d_ratio": _span(_two_d_ratios(sources[SOURCES[1]].data)),
        "zeropp_share": _span(_ratios(data, "zeropp")),
        "matrices_share": _span(_ratios(data, "zeropp_matrices")),
        "two_d_shares": _two_d_shares(sources[SOURCES[1]].data, "zeropp"),
        "two_d_matrices_shares": _two_d_shares(sources[SOURCES[1]].data, "zeropp_matrices"),
        "two_d_quantized_shares": _two_d_shares(sources[SOURCES[1]].data, "zeropp_quantized_vectors"),
    }


def _two_d_shares(data: list[dict], config: str) -> str:
    """``config``'s cross-node bytes over the exact 2-D run's, per tensor-parallel size."""
    rows = sorted((r["tensor_parallel_size"], r["ratio_vs_zero3"]) for r in data if r["config"] == config)
    return ", ".join(f"t = {t} {ratio:.4f}" for t, ratio in rows)


HEADLINES = {
    SOURCES[0]: [("share of ZeRO-3's cross-node bytes, defaults", "zeropp_share"),
                 ("with norm gains and biases carried exactly", "matrices_share")],
    SOURCES[1]: [("share of the exact 2-D run's, defaults", "two_d_shares"),
                 ("with every gradient quantized", "two_d_quantized_shares")],
}  # fmt: skip
"""Per data file, the figures ``benchmarks/RESULTS.md`` shows beside its newest run (snippet names)."""


def _two_d_ratios(data: list[dict]) -> list[float]:
    config, t, _ = TWO_D_GOAL
    return [r["ratio_vs_zero3"] for r in data if r["config"] == config and r["tensor_parallel_size"] == t]
