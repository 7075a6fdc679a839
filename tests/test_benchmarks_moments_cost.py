"""benchmarks/moments_cost.py at a small size: every parameter of the laid-out shard is corrected at every repeat, in
both block layouts, and the row says how long each part took."""

from pathlib import Path

import pytest

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
bench = load_script(ROOT / "benchmarks" / "moments_cost.py", "moments_cost_benchmark")


@pytest.mark.parametrize("alignment", ["parameter", "flat"])
def test_every_parameter_is_corrected_at_every_repeat(alignment):
    row = bench.measure(n_embd=32, n_layer=2, world=4, block=16, repeats=3, alignment=alignment)
    assert row["parameters"] == 2 * 12 + 4  # 12 per block; the embeddings and the final norm
    assert row["corrected"] == 3 * row["parameters"]
    assert row["shard_elements"] > 0 and row["norms_ms"] > 0 and row["lowering_ms"] > 0 and row["adamw_ms"] > 0
