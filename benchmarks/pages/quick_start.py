"""The README's main job on a CPU: how long a user waits, and what it trains to (``quick_start.py``)."""

from __future__ import annotations

import statistics

from pages import Source, table

TITLE = "The quick start's main job"
QUESTION = """How long does the README's main job take on a CPU, and what does it train to?

`python examples/gpt/train.py fit --config examples/gpt/configs/cpu_demo.yaml`, run as a user runs it (a fresh
process, 4 ranks acting as 2 nodes x 2, fp32), timed from start to exit by `benchmarks/quick_start.py`, which reads
the last logged losses and bytes from the run's CSV."""

SOURCES = ["quick_start/cpu_demo.json"]


def _minutes(data: dict) -> float:
    return statistics.median(r["seconds"] for r in data["runs"]) / 60


def render(sources: dict[str, Source]) -> str:
    data = sources[SOURCES[0]].data
    rows = [
        [i + 1, f"{r['seconds']:.0f}", r["steps"], f"{r['train_loss']:.3f}", f"{r['val_loss']:.3f}",
         f"{r['inter_node_MB']:.3f}", f"{r['intra_node_MB']:.3f}"]
        for i, r in enumerate(data["runs"])
    ]  # fmt: skip
    header = ["run", "wall s", "steps", "last train loss", "last val loss", "inter-node MB / step",
              "intra-node MB / step"]  # fmt: skip
    return f"""The configuration: `{data["config"]}`, on a machine with {data["cpus"]} CPUs.

{table(header, rows)}

Median wall time: {_minutes(data):.1f} min, from the command's start to its exit (process start, imports, the
ranks' rendezvous, training, validation)."""


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    data = sources[SOURCES[0]].data
    return {"minutes": f"about {_minutes(data):.1f} min on {data['cpus']} cores"}
