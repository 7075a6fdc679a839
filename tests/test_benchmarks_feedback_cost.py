"""benchmarks/feedback_cost.py at a small size: every way re-quantizes every unit's stages, the residuals cover the
M / N elements a rank sends across nodes and carry an error after a pass, and the row reports each way's time."""

from pathlib import Path

import torch

from lightning_zeropp.costs import gpt_units
from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
bench = load_script(ROOT / "benchmarks" / "feedback_cost.py", "feedback_cost_benchmark")


def test_every_way_covers_the_ranks_pieces_and_feedback_carries_an_error():
    nodes, per_node = 2, 2
    calls, elements, feedback = bench._calls(32, 2, nodes, per_node)
    chunks = sum(sum(unit.shards(nodes * per_node)) for unit in gpt_units(256, 128, 2, 32))
    assert elements == nodes * chunks  # K pieces of every chunk: M / N elements
    assert {len(c) for c in calls.values()} == {len(calls["none"])} and len(calls["none"]) >= 3  # units x stages
    for way in bench.WAYS:
        for call in calls[way]:
            call()
    for way, fb in feedback.items():
        assert fb.numel == elements, way
        residuals = fb.state_dict()["residuals"]
        assert all(r.float().abs().sum() > 0 for r in residuals.values()), way  # each unit kept what it lost
    assert fb.bits == 32 and torch.cat([r.flatten() for r in residuals.values()]).abs().max() < 1.0


def test_row_reports_each_way():
    row = bench.measure(32, 2, 2, 2, 2)
    assert row["calls"] >= 3 and row["repeats"] == 2
    for way in bench.WAYS:
        assert row[f"{way}_ms"] > 0, way
    for way in ("int8", "bf16", "fp32"):
        assert row[f"{way}_ratio"] == row[f"{way}_ms"] / row["none_ms"]
