"""``benchmarks/suite_time.py`` reads pytest's closing line and its ``--durations`` list (the suite itself is timed by
the script, not here)."""

from pathlib import Path

import pytest

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
suite_time = load_script(ROOT / "benchmarks" / "suite_time.py", "suite_time_benchmark")

OUTPUT = """...s..
============================= slowest 15 durations =============================
12.50s call     tests/test_a.py::test_x[2x2]
3.25s setup    tests/test_b.py::test_y
0.50s call     tests/test_c.py::test_z
=============== 1418 passed, 260 skipped, 45 warnings in 303.39s (0:05:03) ===============
"""


def test_the_closing_line_and_the_slowest_tests():
    assert suite_time.summary(OUTPUT) == {"passed": 1418, "skipped": 260, "pytest_seconds": 303.39}
    assert suite_time.slowest(OUTPUT, 2) == [[12.5, "call", "tests/test_a.py::test_x[2x2]"],
                                             [3.25, "setup", "tests/test_b.py::test_y"]]  # fmt: skip
    failed = "= 2 failed, 10 passed in 4.00s ="
    assert suite_time.summary(failed) == {"failed": 2, "passed": 10, "pytest_seconds": 4.0}
    quiet = "...\n1 failed, 1688 passed, 274 skipped, 46 warnings in 1587.56s (0:26:27)\n"  # what -q prints
    assert suite_time.summary(quiet) == {"failed": 1, "passed": 1688, "skipped": 274, "pytest_seconds": 1587.56}


def test_an_output_without_a_summary_is_refused():
    with pytest.raises(SystemExit, match="no pytest summary line"):
        suite_time.summary("ImportError while loading conftest")


def test_each_modules_seconds_add_up_its_phases_longest_first():
    output = OUTPUT + "2.00s teardown tests/test_b.py::test_y\n1.00s call     tests/test_b.py::test_w[a-b]\n"
    assert suite_time.module_seconds(output) == {"tests/test_a.py": 12.5, "tests/test_b.py": 6.25,
                                                 "tests/test_c.py": 0.5}  # fmt: skip
    assert list(suite_time.module_seconds(output)) == ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"]


def test_a_cold_run_gets_an_empty_triton_cache_and_a_warm_one_this_machines(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/warm")
    assert suite_time.environment("cold", str(tmp_path))["TRITON_CACHE_DIR"] == str(tmp_path)
    assert suite_time.environment("warm", str(tmp_path))["TRITON_CACHE_DIR"] == "/somewhere/warm"
    with pytest.raises(ValueError, match="triton_cache='hot'"):
        suite_time.environment("hot", str(tmp_path))
