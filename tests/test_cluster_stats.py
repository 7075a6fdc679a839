"""``benchmarks/cluster.py``'s statistics, on made-up probe rows (no cluster needed): a configuration's step time is
the median over repeats with the [min, max] interval, and a speedup is paired by repeat."""

from pathlib import Path

import pytest

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
cluster = load_script(ROOT / "benchmarks" / "cluster.py", "cluster_benchmark_stats")


def _run(step_seconds: list[float]) -> list[list[dict]]:
    """One repeat's probes: rank 0 of node 0 and rank 2 of node 1, steps of the given durations."""
    times = [0.0]
    for d in step_seconds:
        times.append(times[-1] + d)
    ranks = []
    for node in (0, 1):
        rows = [{"step": k, "time": t, "node_rank": node, "loss": 1.0, "tx_bytes": 100 * k, "rx_bytes": 50 * k}
                for k, t in enumerate(times)]  # fmt: skip
        ranks.append(rows)
    return [ranks[0], ranks[1]]


def _row(name: str, repeats: list[list[float]]) -> dict:
    row = cluster.summarize(name, [_run(r) for r in repeats], warmup=1, tokens_per_step=1000)
    return dict(row, rate=200.0, delay_ms=0.0)


def test_step_time_is_the_median_of_repeats_with_their_range():
    # per repeat, after the warm-up step: medians 2.0, 3.0, 2.5
    row = _row("zero3", [[9.0, 2.0, 2.0, 2.1], [9.0, 3.0, 3.0, 3.1], [9.0, 2.5, 2.4, 2.6]])
    assert row["step_s_repeats"] == [2.0, 3.0, 2.5]
    assert row["step_s"] == 2.5 and row["step_s_interval"] == [2.0, 3.0]


def test_speedup_is_paired_by_repeat_and_shown_with_its_interval():
    zero3 = _row("zero3", [[9, 2.0, 2.0, 2.0], [9, 4.0, 4.0, 4.0], [9, 3.0, 3.0, 3.0]])
    # the same round's load moves both alike: each paired ratio is exactly 2, though pooled medians would vary
    fast = _row("zeropp", [[9, 1.0, 1.0, 1.0], [9, 2.0, 2.0, 2.0], [9, 1.5, 1.5, 1.5]])
    rows = [zero3, fast]
    cluster.add_ratios(rows)
    assert fast["speedup_vs_zero3"] == 2.0 and fast["speedup_vs_zero3_interval"] == [2.0, 2.0]
    assert zero3["speedup_vs_zero3_interval"] == [1.0, 1.0]
    table = cluster.table(rows)
    assert "median [min, max] of 3" in table and "| 2.00x [2.00, 2.00] |" in table and "[1.000, 2.000]" in table


def test_intervals_overlap():
    assert cluster.intervals_overlap([1.0, 2.0], [1.5, 3.0]) and cluster.intervals_overlap([1.0, 2.0], [2.0, 3.0])
    assert not cluster.intervals_overlap([1.0, 1.9], [2.0, 3.0])


def test_unpaired_repeats_are_refused():
    with pytest.raises(ValueError, match="paired repeats differ in number: 3 and 2"):
        cluster.paired_ratio([1.0, 2.0, 3.0], [1.0, 2.0])
