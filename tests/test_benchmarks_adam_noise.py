"""The second-moment probe's Adam states on made-up gradients: the variants agree where there is no noise to take
out, the estimate lowers ``v`` as fed, the floor bounds it, and the pooled figures and the table."""

from pathlib import Path

import pytest
import torch

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
probe = load_script(ROOT / "benchmarks" / "adam_noise.py", "adam_noise_benchmark")


def _state(n=6):
    return probe.Moments(n, (0.9, 0.95), 1e-8)


def test_without_noise_every_variant_is_plain_adam():
    m = _state()
    g = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.1], dtype=torch.float64)
    zero = torch.zeros_like(g)
    for _ in range(3):
        directions, floored, shadow = m.step(g, g, zero, zero)
    for k in probe.VARIANTS:
        assert torch.allclose(directions[k], shadow), k
    assert not any(f.any() for f in floored.values())


def test_the_estimate_is_taken_out_of_v_and_the_floor_bounds_it():
    m = _state(2)
    e = torch.tensor([1.0, 1.0], dtype=torch.float64)
    q = torch.tensor([1.1, 1.0], dtype=torch.float64)
    var = torch.tensor([0.21, 5.0], dtype=torch.float64)  # coordinate 1: far more than its square
    m.step(q, e, var, var)
    b2 = 0.95
    assert m.v["plain"][0] == pytest.approx((1 - b2) * 1.21)
    assert m.v["every_code"][0] == pytest.approx((1 - b2) * (1.21 - 0.21))
    assert m.v["every_code"][1] == pytest.approx(probe.FLOOR * (1 - b2) * 1.0)  # floored
    assert m.v["v_exact"][0] == pytest.approx((1 - b2) * 1.0)


def test_summary_pools_ranks_and_the_table_names_every_variant():
    def rank(scale):
        late = {v: {c: {"u2": 4.0 * scale, "shadow2": 4.0 * scale, "diff2": 0.04 * scale, "dot": 3.96 * scale,
                        "floored": 1.0, "count": 100.0} for c in probe.CLASSES} for v in probe.VARIANTS}  # fmt: skip
        est = {c: {"var_every": 1.0 * scale, "var_nonzero": 0.5 * scale, "err2": 1.0 * scale} for c in probe.CLASSES}
        return {"late": late, "estimates": est}

    out = probe.summarize([rank(1.0), rank(3.0)])
    row = out["variants"]["plain"]["small"]
    assert row["norm_ratio"] == pytest.approx(1.0)
    assert row["rel_err"] == pytest.approx(0.1)
    assert row["along"] == pytest.approx(0.99)
    assert row["floored"] == pytest.approx(0.01)
    assert out["calibration"]["rest"] == {"every_code": pytest.approx(1.0), "codes_nonzero": pytest.approx(0.5)}
    text = probe.table([{"seed": 1, "summary": out}])
    for v in probe.VARIANTS:
        assert f"| qgz | 1 | {v} | 0.9900 |" in text
