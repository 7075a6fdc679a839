"""benchmarks/moments_cost.py at a small size: every parameter of the laid-out shard is corrected at every repeat, in
both block layouts, and the row says how long each part took."""

from pathlib import Path

import pytest

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
bench = load_script(ROOT / "benchmarks" / "moments_cost.py", "moments_cost_benchmark")


@pytest.mark.parametrize("alignment", ["parameter", "flat"])
@pytest.mark.parametrize("per_parameter, way", [(None, "per parameter"), (True, "per parameter"), (False, "per unit")])
def test_every_parameter_is_corrected_at_every_repeat(alignment, per_parameter, way):
    row = bench.measure(32, 2, 4, 16, 3, alignment, per_parameter=per_parameter)  # None: the CPU's own way
    assert row["lowering"] == way and row["device"] == "cpu"
    assert row["parameters"] == 2 * 12 + 4  # 12 per block; the embeddings and the final norm
    assert row["corrected"] == 3 * row["parameters"]
    assert row["shard_elements"] > 0 and row["norms_ms"] > 0 and row["lowering_ms"] > 0 and row["adamw_ms"] > 0


def test_a_unit_at_a_time_launches_per_unit_not_per_parameter():
    """The GPUs' lowering dispatches a fixed number of operators per unit, whatever its parameters; the CPU's about
    five per parameter. Counted on a model with twice the layers (twice the parameters and units): the per-unit
    count grows by the units' share alone."""
    rows = {
        (n_layer, per_parameter): bench.count_ops(32, n_layer, 4, 16, "parameter", per_parameter)["ops"]
        for n_layer in (2, 4)
        for per_parameter in (True, False)
    }
    extra_units, extra_parameters = 2, 2 * 12  # two more blocks: two more units of 12 parameters each
    per_unit = (rows[4, False] - rows[2, False]) / extra_units
    per_parameter = (rows[4, True] - rows[2, True]) / extra_parameters
    assert per_unit <= 16, rows  # a unit's passes (norms are one multi-tensor pass per step for all parameters)
    assert per_parameter >= 5, rows
    assert rows[4, False] * 3 < rows[4, True], rows
