"""``python -m lightning_zeropp.planner``: its arguments, its table, JSON and plot, the time model's behaviour, and the
paper's end-to-end table predicted from two fitted speedups."""

import json
import sys
from pathlib import Path

import pytest

from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.costs import gpt_units
from lightning_zeropp.planner import main
from lightning_zeropp.prediction import CONFIGS, Cluster, Workload, collective_seconds, predict

ROOT = Path(__file__).resolve().parents[1]
SEVEN_B = gpt_units(32000, 4096, 32, 4096)


def test_cli_prints_every_configuration_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rows = main(["--params", "1.3e9", "--n-layer", "24", "--nodes", "2", "--vocab", "50304", "--json", str(out)])
    text = capsys.readouterr().out
    for name in CONFIGS:
        assert f"| {name} |" in text
    assert "verdict: " in text
    saved = json.loads(out.read_text())
    assert [r["config"] for r in saved["rows"]] == list(CONFIGS) == [r.config for r in rows]
    assert saved["cluster"]["nodes"] == 2 and saved["workload"]["tokens_per_gpu"] == 4096
    assert saved["recommendation"]["config"] in CONFIGS and saved["recommendation"]["python"] in text


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
        rows = {r.config: r for r in predict(SEVEN_B, Cluster(8, 8, gbps, 2400.0), workload)}
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


def test_the_correction_s_passes_are_in_the_compute_time_where_it_runs():
    """The second-moment correction's bytes (the gradient read three times, 44 bytes of ``exp_avg_sq`` and its
    transients per element of a rank's shard) are in ZeRO++'s compute time across nodes with Adam, and nowhere else:
    not with SGD ("auto" stands down), not on one node, not with it off, not in ZeRO-3."""
    from lightning_zeropp.costs import correction_bytes, kernel_bytes
    from lightning_zeropp.prediction import compute_seconds

    cluster = Cluster(8, 8, 100.0, 2400.0)
    shard = sum(sum(u.shards(cluster.world)) for u in SEVEN_B)
    on = ZeroPPConfig(**CONFIGS["zeropp"])
    assert correction_bytes(SEVEN_B, on, 64, 8, "bf16-mixed") == shard * (3 * 4 + 44)
    for config, world in ((ZeroPPConfig(**CONFIGS["zero3"]), 64), (on, 8),
                          (ZeroPPConfig(second_moment_correction=False), 64)):  # fmt: skip
        assert correction_bytes(SEVEN_B, config, world, 8, "bf16-mixed") == 0
    adam, sgd = Workload(4096), Workload(4096, optimizer_states=1)
    extra = compute_seconds(SEVEN_B, on, cluster, adam) - compute_seconds(SEVEN_B, on, cluster, sgd)
    assert extra == pytest.approx(shard * 56 / (cluster.hbm_gbps * 1e9), rel=1e-9)
    assert 0 < extra < 0.01 * compute_seconds(SEVEN_B, on, cluster, adam)  # about 1 ms at 7B on 64 GPUs
    kernels = kernel_bytes(SEVEN_B, on, 64, 8) / (cluster.hbm_gbps * 1e9)
    assert extra < kernels  # less than qwZ's and qgZ's own kernels move


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


@pytest.mark.parametrize("compute, comm", [(0.3, 1.2), (1.2, 0.3), (0.5, 0.5), (0.0, 0.4)])
@pytest.mark.parametrize("overlap", [0.0, 0.2, 0.6, 1.0])
def test_compute_from_step_inverts_the_step_model(compute, comm, overlap):
    """The cluster check takes a configuration's compute from its unshaped step at the overlap it composes with: the
    inverse of ``step_seconds`` in the compute (where the overlap hides all of it, any compute up to the
    communication gives the same step; the inverse returns one that does)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    from lightning_zeropp.prediction import step_seconds

    step = step_seconds(compute, comm, overlap)
    back = plan_check.compute_from_step(step, comm, overlap)
    assert step_seconds(back, comm, overlap) == pytest.approx(step, abs=1e-12)
    if overlap < 1 or compute > comm:
        assert back == pytest.approx(compute, abs=1e-12)


def _synthetic_cluster_rows(efficiency, overlap):
    """Rows made by the model itself: four configurations at three rates, each with its own compute and bytes."""
    from lightning_zeropp.prediction import step_seconds

    rows = []
    for k, (compute, megabits) in enumerate([(0.27, 130.0), (0.41, 22.0), (0.50, 11.0), (0.29, 44.0)]):
        unshaped_comm = 0.02 + 0.01 * k
        for rate in (20.0, 50.0, 200.0):

            def comm_at(e, megabits=megabits, rate=rate):
                return megabits / (rate * e) + 0.005

            rows.append(dict(config=f"c{k}", rate_mbit=rate, unshaped_comm_s=unshaped_comm,
                             unshaped_s=step_seconds(compute, unshaped_comm, overlap), comm_at=comm_at,
                             measured_s=step_seconds(compute, comm_at(efficiency), overlap)))  # fmt: skip
    return rows


def test_cluster_calibration_from_another_run_predicts_every_row_of_this_one(capsys):
    """``plan_check --cluster A --calibrate-from B [C ...]``: the link's efficiency and the overlap are fitted on every
    row of the other runs and every row of run A is predicted from them (none counted as fitted); with
    ``--calibrate`` as well it is refused by name. The committed runs of the emulated cluster."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    a = ROOT / "benchmarks" / "data" / "slow_link" / "cluster_plan.json"
    b = ROOT / "benchmarks" / "data" / "archive" / "cluster_plan_2026-12-02.json"
    out = plan_check.check_cluster(a, 0.0, calibrate_from=[b])
    efficiency, overlap = plan_check.fit_cluster(plan_check.cluster_measurements(b)[0])
    rows = plan_check.cluster_measurements(a)[0]
    assert len(out) == len(rows) == 12 and not any(r["fitted"] for r in out)
    for r, row in zip(out, rows):
        assert r["predicted_s"] == pytest.approx(plan_check.predict_cluster(row, efficiency, overlap)[2], rel=1e-12)
    assert f"fitted on every row of {b} (12 rows)" in capsys.readouterr().out
    plan_check.check_cluster(a, 0.0, calibrate_from=[a, b])  # several runs: every row of each
    assert f"fitted on every row of {a}, {b} (24 rows)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--calibrate and --calibrate-from"):
        plan_check.check_cluster(a, 0.0, calibrate="rate:200", calibrate_from=[b])


def test_cluster_calibration_recovers_the_link_efficiency_and_overlap_it_was_made_with():
    """``plan_check --cluster F --calibrate rate:200`` fits the link's efficiency and the overlap on the rows it names
    and predicts the rest: on rows the model made at 0.85 and 0.3, the fit on one rate gives them back and every
    held-out row exactly; a calibration that names every row, none, or neither a rate nor a configuration is
    refused by name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    rows = _synthetic_cluster_rows(0.85, 0.3)
    for calibrate in ("rate:200", "config:c0"):
        chosen = plan_check._calibration_rows(rows, calibrate)
        assert 0 < len(chosen) < len(rows)
        efficiency, overlap = plan_check.fit_cluster(chosen)
        assert (efficiency, overlap) == pytest.approx((0.85, 0.3)), calibrate
        for r in rows:
            assert plan_check.predict_cluster(r, efficiency, overlap)[2] == pytest.approx(r["measured_s"], rel=1e-9)
    # a link twice as slow as the rows were measured on is seen as such: the fit is not free to absorb it in overlap
    slower = _synthetic_cluster_rows(0.425, 0.3)
    assert plan_check.fit_cluster(plan_check._calibration_rows(slower, "rate:200")) == pytest.approx((0.425, 0.3))
    with pytest.raises(SystemExit, match="grid's edge"):  # a link far slower than its nominal rate is not fitted
        plan_check.fit_cluster(plan_check._calibration_rows(_synthetic_cluster_rows(0.05, 0.3), "rate:200"))
    for bad, named in (("rate:100", "names 0 of the 12"), ("node:1", "use rate:MBIT"), ("rate:", "use rate")):
        with pytest.raises(SystemExit, match=named):
            plan_check._calibration_rows(rows, bad)
