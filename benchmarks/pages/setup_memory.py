"""Setup memory of a model built on the meta device: each rank's peak against its shard (``init_memory.py``)."""

from __future__ import annotations

from pages import Source, mb, table

TITLE = "Setup memory of big models"
QUESTION = """Does setting up a model built on the meta device hold more than each rank's shard of it?

The example GPT widened (`benchmarks/init_memory.py`'s default shape), built under
`trainer.init_module(empty_init=True)` on every rank, then `trainer.fit`: the strategy shards the meta model and
each rank allocates and initializes only its shards. Each rank's peak resident memory (`ru_maxrss`) before the model
exists (the baseline: Python, torch, Lightning, the process group) and when training starts (setup done: sharded,
materialized, optimizer built), against the rank's shard of the fp32 weights."""

SOURCES = ["setup_memory/init_memory.json"]

GOAL = 1.5
"""The goal set when meta-device setup was built: a rank's setup peak at most this many shards above its baseline."""


def _ratio(row: dict, key: str) -> float:
    return (row[key] - row["baseline"]) / row["local_bytes"]


def render(sources: dict[str, Source]) -> str:
    data = sources[SOURCES[0]].data
    rows = data["rows"]
    steps = "first_step" in rows[0]
    header = ["rank", "shard MB", "baseline MB", "setup peak MB", "setup - baseline MB", "x shard"]
    if steps:
        header += ["first step peak MB", "first step - baseline MB", "x shard"]
    out = []
    for r in rows:
        line = [r["rank"], mb(r["local_bytes"], 0), mb(r["baseline"], 0), mb(r["setup"], 0),
                mb(r["setup"] - r["baseline"], 0), f"{_ratio(r, 'setup'):.3f}"]  # fmt: skip
        if steps:
            line += [mb(r["first_step"], 0), mb(r["first_step"] - r["baseline"], 0), f"{_ratio(r, 'first_step'):.2f}"]
        out.append(line)
    worst = max(_ratio(r, "setup") for r in rows)
    whole = data["params"] * 4
    verdict = "met" if worst <= GOAL else "NOT met"
    first = (
        "The first step's peak is in the table."
        if steps
        else (
            f"This run stopped at setup (`--steps {data['steps']}`): the first step, which holds the gradients, each"
            " unit gathered whole while it computes and the quantizers' buffers, was not measured at this size."
        )
    )
    return f"""The model: {data["params"]:,} parameters ({mb(whole, 0)} MB in fp32), on {data["ranks"]} CPU ranks,
configuration `{data["config"]}`. MB: 10^6 bytes.

## Goal

- A rank's setup peak at most {GOAL} shards above its baseline: **{verdict}** (the worst rank {worst:.3f}x its
  shard). A rank that held the whole model at any point would show {data["ranks"]}x: {mb(whole, 0)} MB above its
  baseline.

## Per rank

{table(header, out)}

The margin above one shard is FSDP2's padding and the materialization's NaN check, one tensor at a time. {first}
`tests/test_big_model.py::test_setup_of_a_meta_model_never_holds_the_whole_model` asserts the same property on a
smaller model in the test suite."""  # fmt: skip


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    rows = sources[SOURCES[0]].data["rows"]
    return {"setup_ratio": f"{max(_ratio(r, 'setup') for r in rows):.3f}x"}
