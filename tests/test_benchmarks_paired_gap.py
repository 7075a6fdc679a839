"""benchmarks/paired_gap.py on synthetic study files: the gaps per half and of the final loss, paired by seed across
two files and regimes, their mean and standard error, and the errors that name what to fix."""

import json
import math
from pathlib import Path

import pytest

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
paired_gap = load_script(ROOT / "benchmarks" / "paired_gap.py", "paired_gap_benchmark")


def _run(config, seed, regime, first, second, final, steps=10):
    train = [[s, first if 2 * s <= steps else second] for s in range(1, steps + 1)]
    return dict(config=config, seed=seed, regime=regime, steps=steps, train_curve=train,
                val_curve=[[steps // 2, 9.0], [steps, final]])  # fmt: skip


def _write(path, runs):
    path.write_text(json.dumps({"meta": {"commands": []}, "runs": runs, "summary": []}))
    return path


def test_pairs_by_seed_across_files_and_regimes(tmp_path, capsys):
    base = _write(tmp_path / "base.json", [
        _run("zero3", 1, "calm", 2.0, 1.0, 1.5), _run("zero3", 2, "calm", 4.0, 2.0, 3.0),
        _run("zero3", 3, "calm", 1.0, 1.0, 1.0),  # no partner: left out
        _run("zero3", 1, "aggressive", 9.0, 9.0, 9.0),  # another regime: not the baseline
    ])  # fmt: skip
    runs = _write(tmp_path / "runs.json", [
        _run("zero3", 1, "lr0.000297-warmup30", 2.02, 1.01, 1.5),
        _run("zero3", 2, "lr0.000297-warmup30", 4.0, 2.04, 3.03),
        dict(_run("zero3", 4, "lr0.000297-warmup30", 1.0, 1.0, 1.0), error="failed"),  # failed runs never count
    ])  # fmt: skip
    out = tmp_path / "gap.json"
    result = paired_gap.main(["--json", str(runs), "--regime", "lr0.000297-warmup30", "--baseline", str(base),
                              "--steps", "10", "--out", str(out)])  # fmt: skip
    assert sorted(result["per_seed"]) == [1, 2]
    one, two = result["per_seed"][1], result["per_seed"][2]
    assert one == pytest.approx({"first_half": 0.01, "second_half": 0.01, "final_val": 0.0})
    assert two == pytest.approx({"first_half": 0.0, "second_half": 0.02, "final_val": 0.01})
    second = result["summary"]["second_half"]
    assert second["mean"] == pytest.approx(0.015) and second["se"] == pytest.approx(0.005)  # std 0.00707 / sqrt 2
    printed = capsys.readouterr().out
    assert "| 1 | +1.000% | +1.000% | +0.000% |" in printed
    assert "| mean ± 2 SE | +0.500% ± 1.000% | +1.500% ± 1.000% | +0.500% ± 1.000% |" in printed
    assert json.loads(out.read_text())["summary"]["final_val"]["mean"] == pytest.approx(0.005)


def test_one_seed_has_no_spread():
    runs = {1: _run("zero3", 1, "x", 1.1, 1.1, 1.1)}
    base = {1: _run("zero3", 1, "calm", 1.0, 1.0, 1.0)}
    summary = paired_gap.paired(runs, base, 10)["summary"]
    assert summary["final_val"]["se"] is None and math.isclose(summary["final_val"]["mean"], 0.1)


def test_no_common_seed_names_the_arguments(tmp_path):
    base = _write(tmp_path / "base.json", [_run("zero3", 1, "calm", 1.0, 1.0, 1.0)])
    runs = _write(tmp_path / "runs.json", [_run("zero3", 2, "cut", 1.0, 1.0, 1.0)])
    with pytest.raises(SystemExit, match=r"--regime, --steps"):
        paired_gap.main(["--json", str(runs), "--regime", "cut", "--baseline", str(base), "--steps", "10"])
    with pytest.raises(SystemExit, match="no study file"):
        paired_gap.main(["--json", str(tmp_path / "nope.json"), "--regime", "cut", "--baseline", str(base),
                         "--steps", "10"])  # fmt: skip


def test_windows_show_a_gap_that_grows(tmp_path, capsys):
    """The mean gap per window over the seeds: a run whose loss rises against the baseline step by step shows it
    window by window; the last window may be shorter; a window under one step is refused by name."""
    steps = 10

    def run(config, seed, slope):
        train = [[s, 1.0 + slope * s] for s in range(1, steps + 1)]
        return dict(config=config, seed=seed, regime="calm", steps=steps, train_curve=train,
                    val_curve=[[steps, 1.0]])  # fmt: skip

    path = _write(tmp_path / "study.json", [run("zero3", 1, 0.0), run("zero3", 2, 0.0),
                                            run("zeropp", 1, 0.01), run("zeropp", 2, 0.03)])  # fmt: skip
    argv = ["--json", str(path), "--config", "zeropp", "--regime", "calm", "--baseline", str(path),
            "--baseline-regime", "calm", "--steps", "10"]  # fmt: skip
    result = paired_gap.main([*argv, "--windows", "4"])
    got = result["windows"]
    assert [w["steps"] for w in got] == [[1, 4], [5, 8], [9, 10]]
    for w in got:  # seed gaps: slope x mean step of the window; mean over slopes 0.01 and 0.03
        (a, b) = w["steps"]
        mean_step = (a + b) / 2
        assert w["mean"] == pytest.approx(0.02 * mean_step)
        assert w["se"] == pytest.approx(0.01 * mean_step)  # |0.03 - 0.01| x step / 2
    assert got[0]["mean"] < got[1]["mean"] < got[2]["mean"]
    assert "| 9-10 | +19.000% ± 19.000% |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--windows 0: give a window of 1 step or more"):
        paired_gap.main([*argv, "--windows", "0"])


def test_seeds_filter_and_the_seeds_a_resolution_needs(tmp_path, capsys):
    """``--seeds`` pairs those seeds only and names the ones without a pair; ``--resolution`` gives, per measure, the
    seeds that bring 2 SE to it at the spread measured (std 1% over two seeds: 2 SE = 1% at 4 seeds, 0.5% at 16)."""
    base = _write(tmp_path / "base.json", [_run("zero3", s, "calm", 1.0, 1.0, 1.0) for s in (1, 2, 3)])
    runs = _write(tmp_path / "runs.json", [
        _run("zeropp", 1, "calm", 1.0, 1.0, 1.0),
        _run("zeropp", 2, "calm", 1.0, 1.0 + 0.01 * math.sqrt(2), 1.0),  # second half: std 1% over seeds 1, 2
        _run("zeropp", 3, "calm", 1.5, 1.5, 1.5),  # left out by --seeds
    ])  # fmt: skip
    common = ["--json", str(runs), "--config", "zeropp", "--regime", "calm", "--baseline", str(base), "--steps", "10"]
    result = paired_gap.main([*common, "--seeds", "1", "2", "--resolution", "0.5"])
    assert sorted(result["per_seed"]) == [1, 2]
    assert result["seeds_for_resolution"] == {"first_half": 2, "second_half": 16, "final_val": 2}
    assert "| seeds for ± 0.5% | 2 | 16 | 2 |" in capsys.readouterr().out
    assert paired_gap.seeds_for(0.01 / math.sqrt(2), 2, 0.01) == 4
    assert paired_gap.seeds_for(1e-6, 2, 0.01) == 2  # never below the two a spread needs
    assert paired_gap.seeds_for(None, 1, 0.01) is None  # one seed shows no spread
    with pytest.raises(SystemExit, match=r"seeds \[4\] lack .* drop them"):
        paired_gap.main([*common, "--seeds", "1", "4"])
    with pytest.raises(SystemExit, match="--resolution 0.0: give the 2 SE wanted in percent, above 0"):
        paired_gap.main([*common, "--resolution", "0"])
