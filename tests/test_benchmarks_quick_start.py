"""``benchmarks/quick_start.py``, which times the README's main job: it reads a CSVLogger's last values and refuses a
run that failed (the job itself is timed by the script, not here: it takes minutes)."""

from pathlib import Path

import pytest

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
quick_start = load_script(ROOT / "benchmarks" / "quick_start.py", "quick_start_benchmark")


def test_the_last_logged_value_of_each_column(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,train/loss,val/loss\n4,3.5,\n9,3.1,\n9,,3.0\n19,2.9,\n")
    assert quick_start.last_values(metrics) == {"step": 19.0, "train/loss": 2.9, "val/loss": 3.0}


@pytest.mark.slow  # starts the example's CLI in a subprocess: about 5 s
def test_a_failed_main_job_is_reported_with_its_error(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  no_such_argument: 1\n")
    with pytest.raises(SystemExit, match="the main job failed"):
        quick_start.run_once(broken)


def test_no_repeats_is_refused_naming_the_argument(capsys):
    with pytest.raises(SystemExit):
        quick_start.main(["--repeats", "0"])
    assert "--repeats 0: give 1 or more" in capsys.readouterr().err
