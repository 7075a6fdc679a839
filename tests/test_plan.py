"""``python -m lightning_zeropp.plan``: its arguments, its table, JSON and plot, the time model's behaviour, and the
paper's end-to-end table predicted from two fitted speedups."""

import json
import sys
from pathlib import Path

import pytest

from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.costs import gpt_units
from lightning_zeropp.plan import CONFIGS, Cluster, Workload, collective_seconds, main, plan

ROOT = Path(__file__).resolve().parents[1]
SEVEN_B = gpt_units(32000, 4096, 32, 4096)


def test_cli_prints_every_configuration_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rows = main(["--params", "1.3e9", "--n-layer", "24", "--nodes", "2", "--vocab", "50304", "--json", str(out)])
    text = capsys.readouterr().out
    for name in CONFIGS:
        assert f"| {name} |" in text
    assert "recommended:" in text
    saved = json.loads(out.read_text())
    assert [r["config"] for r in saved["rows"]] == list(CONFIGS) == [r.config for r in rows]
    assert saved["cluster"]["nodes"] == 2 and saved["workload"]["tokens_per_gpu"] == 4096


def test_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the `benchmarks` extra)")
    png = tmp_path / "plan.png"
    main(["--params", "7e9", "--n-layer", "32", "--nodes", "8", "--plot", str(png)])
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [(dict(nodes=0), "nodes=0"), (dict(inter_gbps=0.0), "inter_gbps=0.0"), (dict(gpus_per_node=2.5), "gpus_per_node")],
)
def test_bad_cluster_is_refused_by_name(kwargs, named):
    base = dict(nodes=2, gpus_per_node=8, inter_gbps=100.0, intra_gbps=2400.0)
    with pytest.raises(ValueError, match=named):
        Cluster(**{**base, **kwargs})


def test_time_model_behaves():
    """Faster links never slow a step; ZeRO++ sends fewer cross-node bytes than ZeRO-3 and saves time when the link
    is slow; HSDP keeps N times ZeRO-3's sharded state; a compute-bound job gains little from any of them."""
    workload = Workload(4096)
    steps = {}
    for gbps in (25.0, 100.0, 400.0, 3200.0):
        rows = {r.config: r for r in plan(SEVEN_B, Cluster(8, 8, gbps, 2400.0), workload)}
        steps[gbps] = rows
        assert rows["zeropp"].inter_node_gb < 0.3 * rows["zero3"].inter_node_gb
        assert rows["hsdp"].memory_gib["optimizer"] == pytest.approx(
            8 * rows["zero3"].memory_gib["optimizer"], rel=0.01
        )
        assert rows["zeropp+ef"].memory_gib["error_feedback"] > 0 == rows["zeropp"].memory_gib["error_feedback"]
    for name in CONFIGS:
        times = [steps[g][name].step_s for g in sorted(steps)]
        assert times == sorted(times, reverse=True), f"{name}: {times}"
    assert steps[25.0]["zeropp"].speedup > 2.0
    assert steps[3200.0]["zeropp"].speedup < steps[25.0]["zeropp"].speedup


def test_ring_and_all_to_all_costs():
    """A ring all-gather's time follows its shard x (W - 1) on the slower link; an all-to-all's, the node's share."""
    cluster = Cluster(2, 4, 80.0, 800.0, inter_latency_us=0.0, intra_latency_us=0.0)
    config = ZeroPPConfig()
    shard = 1_000_000
    ring = collective_seconds("weight_all_gather", 3 * shard, 4 * shard, 1, cluster, config)
    assert ring == pytest.approx(shard * 7 / 10e9)  # 80 Gbit/s = 10 GB/s into each node
    a2a = collective_seconds("gradient_all_to_all_inter", 0, shard, 1, cluster, config)
    assert a2a == pytest.approx(4 * shard / 10e9)


@pytest.mark.slow
def test_paper_speedups_from_two_fitted(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    rows = plan_check.paper_rows()
    e, o = plan_check.fit(rows, plan_check.FIT)
    errors = {}
    for r in rows:
        key = (r["model"], r["tokens"], r["ib"])
        errors[key] = plan_check.predict(r, e, o)[2] / r["paper_speedup"] - 1
    # the fit's own rows: +1.1% and -3.2% (overlap at its bound, 0)
    assert all(abs(errors[k]) < 0.05 for k in plan_check.FIT), errors
    others = [v for k, v in errors.items() if k not in plan_check.FIT]
    assert len(others) == 14
    assert all(abs(v) <= 0.20 for v in others), errors  # measured: 14 of 14, the largest +18.7%


@pytest.mark.parametrize("probe", ["all_gather", "reduce_scatter", "all_to_all", "all_reduce"])
def test_link_probe_fit_recovers_the_rate_and_latency_it_was_made_with(probe):
    """``plan_check.fit_link`` inverts the planner's model of each probed collective: two points made by the model at
    a known rate and latency give them back; a latency the points cannot carry is held at 0, not made negative."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    cluster = Cluster(2, 2, 0.05, 0.05, 300.0, 300.0, backend="gloo")
    kind = plan_check.PROBE_CLASS[probe]

    def seconds(size: int) -> float:
        return collective_seconds(kind, *plan_check._probe_bytes(probe, size), 1, cluster, ZeroPPConfig())

    points = [[50_000, seconds(50_000)], [400_000, seconds(400_000)]]
    gbps, latency_us = plan_check.fit_link(points, probe)
    assert gbps == pytest.approx(0.05, rel=1e-6) and latency_us == pytest.approx(300.0, rel=1e-6)
    points[0][1] *= 0.5  # the small call faster than any latency allows
    gbps, latency_us = plan_check.fit_link(points, probe)
    assert latency_us == 0.0 and gbps > 0.05
