"""The suite's own setup: CI runs the README's test command, and under pytest-xdist a module's tests share a worker
(a module-scoped fixture that spawns ranks or captures training steps runs once, not once per worker)."""

from __future__ import annotations

import inspect
import itertools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_commands() -> list[str]:
    """The README's test command (quick start, step 2): its lines, the install and the test run."""
    quick_start = ROOT.joinpath("README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    step = quick_start.split("# 2.", 1)[1].split("```", 1)[0]
    return [line for line in step.splitlines()[1:] if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    install, run = _readme_test_commands()
    assert re.fullmatch(r"pip install .*\[test\].*", install), install
    assert run.startswith("python -m pytest ") and "-n 3" in run.split("pytest", 1)[1], run
    ci = [line for line in ROOT.joinpath(".ci", "run").read_text().splitlines() if not line.startswith("#")]
    # one line each: under `set -e` an install chained with `&&` to the test run would fail without failing CI
    assert install in ci, f".ci/run does not run the README's install {install!r}"
    assert run in ci[ci.index(install) + 1 :], f".ci/run does not run {run!r} after {install!r}"


def test_the_test_extra_brings_xdist():
    import tomllib

    pyproject = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())
    test_extra = pyproject["project"]["optional-dependencies"]["test"]
    assert any(requirement.startswith("pytest-xdist") for requirement in test_extra), test_extra


def test_a_modules_tests_share_a_worker(pytestconfig, monkeypatch):
    xdist_scheduler = pytest.importorskip("xdist.scheduler")
    import conftest

    monkeypatch.setattr(pytestconfig.option, "tx", ["popen"] * 3, raising=False)  # what `-n 3` sets
    monkeypatch.setattr(pytestconfig.option, "loadscopereorder", True, raising=False)
    scheduler = conftest.pytest_xdist_make_scheduler(pytestconfig, None)
    assert isinstance(scheduler, xdist_scheduler.LoadScopeScheduling)
    assert pytestconfig.option.loadscopereorder is False  # the collection order (work_order) is the order of work
    assert scheduler._split_scope("tests/test_fabric.py::test_x[2x2]") == "tests/test_fabric.py"
    one = "tests/test_kernels.py::test_quantize_dequantize[8]"
    assert scheduler._split_scope(one) == one


def test_modules_given_out_test_by_test_share_no_fixture_across_tests():
    """A module-scoped fixture (a spawn, a capture) in one of them would run on both workers."""
    import conftest

    for module in conftest.TEST_BY_TEST:
        text = (ROOT / module).read_text()
        assert not re.search(r"scope\s*=", text), f"{module} has a shared fixture: take it out of TEST_BY_TEST"


def test_the_longest_modules_are_given_out_first_and_the_test_by_test_ones_last():
    import conftest

    ids = ["tests/test_a.py::t1", "tests/test_kernels.py::k1", "tests/test_b.py::t1", "tests/test_a.py::t2",
           "tests/test_new.py::t1", "tests/test_b.py::t2", "tests/test_kernels.py::k2"]  # fmt: skip
    order = conftest.work_order(ids, {"tests/test_a.py": 3.0, "tests/test_b.py": 40.0, "tests/test_kernels.py": 90.0})
    assert [ids[i] for i in order] == [
        "tests/test_new.py::t1",  # unknown: it may be long
        "tests/test_b.py::t1",
        "tests/test_b.py::t2",
        "tests/test_a.py::t1",
        "tests/test_a.py::t2",
        "tests/test_kernels.py::k1",
        "tests/test_kernels.py::k2",
    ]
    assert conftest.work_order(ids, {}) == [0, 2, 3, 4, 5, 1, 6]  # no data: collection order, test by test last


def test_the_order_reads_the_latest_full_runs_module_seconds(tmp_path):
    import conftest

    path = tmp_path / "suite_time.json"
    runs = [{"tier": "full", "module_seconds": {"tests/test_a.py": 1.0}}, {"tier": "fast", "module_seconds": {"x": 2}},
            {"tier": "full", "module_seconds": {"tests/test_b.py": 5.0}}, {"tier": "full"}]  # fmt: skip
    path.write_text(json.dumps({"runs": runs}))
    assert conftest.module_seconds(path) == {"tests/test_b.py": 5.0}
    path.write_text("{not json")
    assert conftest.module_seconds(path) == {}
    assert conftest.module_seconds(tmp_path / "missing.json") == {}


def test_a_test_leaves_the_environment_as_it_found_it(monkeypatch):
    """A ``seed_everything`` in one test sets ``PL_GLOBAL_SEED``, and every rank a later test spawns would take it (CI
    once saw a loss rise that way): conftest's autouse fixture restores ``os.environ`` after each test."""
    import os

    import conftest

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setenv("ZEROPP_SUITE_KEPT", "before")
    with conftest.environment_restored():
        os.environ["PL_GLOBAL_SEED"] = "7"  # what seed_everything(7) leaves behind
        os.environ["ZEROPP_SUITE_KEPT"] = "changed"
    assert "PL_GLOBAL_SEED" not in os.environ
    assert os.environ["ZEROPP_SUITE_KEPT"] == "before"
    assert "environment_restored" in inspect.getsource(conftest._isolated_environment)  # the autouse fixture uses it


def test_free_ports_come_from_below_the_ephemeral_range_whatever_the_seed():
    """A job's ``MASTER_PORT`` is drawn below the range the kernel assigns to sockets bound to port 0 (gloo's
    connections take those by the hundred while the other xdist worker's jobs run: CI once saw ``EADDRINUSE``), and
    from the operating system's randomness: two processes that both ran ``seed_everything(0)`` must not draw the
    same ports in the same order."""
    import random

    from lightning_zeropp.spawn import ephemeral_port_range, free_port

    low, high = ephemeral_port_range()
    assert 0 < low <= high
    draws = []
    for _ in range(2):
        random.seed(0)  # what seed_everything(0) does to the module the draw must not use
        draws.append([free_port() for _ in range(8)])
    for port in draws[0] + draws[1]:
        assert 10000 <= port < low or low - 10000 < 1000, (port, low)
    assert draws[0] != draws[1]


def test_the_repository_tracks_no_wheel_and_no_saved_cli_config():
    """A downloaded tool's wheel and a LightningCLI run's saved config.yaml were once committed at the root."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert [f for f in tracked if f.endswith(".whl") or f == "config.yaml"] == []


def _product(**values) -> list[dict[str, str]]:
    names = sorted(values)
    return [dict(zip(names, combo)) for combo in itertools.product(*(values[n] for n in names))]


def _uncovered(cases: list[dict[str, str]], chosen: list[int], strength: int) -> set:
    def combos(case):
        return set(itertools.combinations(sorted(case.items()), strength))

    return set().union(*map(combos, cases)) - set().union(*(combos(cases[i]) for i in chosen))


def test_a_covering_holds_every_value_or_every_pair_of_values_and_extends_what_it_is_given():
    from lightning_zeropp.kernels.covering import covering

    cases = _product(layout=list("abcdef"), bits=["8", "4"], width=["0", "32", "16", "8"], rows=["1", "3"])  # 96
    ones = covering(cases, 1)
    assert not _uncovered(cases, ones, 1) and len(ones) == 6  # the most values one parameter has
    pairs = covering(cases, 2, tuple(ones))
    assert pairs[: len(ones)] == ones and not _uncovered(cases, pairs, 2)
    assert 24 <= len(pairs) < len(cases) // 2  # layout x width alone needs 24
    assert _uncovered(cases, pairs[:-1], 2), "the last case chosen brought nothing"
    assert covering(cases[:1], 2) == [0] and not _uncovered(cases, covering(cases, 3), 3)


class _Item:
    """What ``_cover_matrices`` reads of a collected test."""

    def __init__(self, name: str, params: dict, *marks: str) -> None:
        self.module, self.originalname, self.marks = type("M", (), {"__name__": "test_m"}), name, set(marks)
        self.callspec = type("C", (), {"params": params})
        self.nodeid = f"test_m.py::{name}{sorted(params.items())}"

    def get_closest_marker(self, name):
        return pytest.mark.__getattr__(name) if name in self.marks else None

    def iter_markers(self, name):
        return iter(())

    def add_marker(self, mark):
        self.marks.add(mark.name)


def test_the_full_suite_runs_a_pairwise_covering_of_the_interpreters_matrices_and_every_case_when_asked():
    import conftest

    deselected = []
    hook = type("H", (), {"pytest_deselected": staticmethod(lambda items: deselected.extend(items))})

    def covered(exhaustive: bool, *marks: str) -> tuple[list[_Item], list[_Item]]:
        config = type("Cfg", (), {"hook": hook, "getoption": staticmethod(lambda name: exhaustive)})
        items = [_Item("t", case, "matrix", *marks) for case in _product(a=list("xyz"), b=list("pqr"), c=["1", "2"])]
        deselected.clear()
        conftest._cover_matrices(config, items)
        return items, list(deselected)

    items, gone = covered(False, "triton_interpret")
    cases = [dict(item.callspec.params) for item in items + gone]  # the whole product, 18 cases
    fast = [i for i, item in enumerate(items) if "slow" not in item.marks]
    assert not _uncovered(cases, fast, 1) and len(fast) == 3
    assert not _uncovered(cases, list(range(len(items))), 2) and len(cases) == 18 and gone
    assert all("slow" in item.marks for item in gone)
    items, gone = covered(True, "triton_interpret")
    assert len(items) == 18 and not gone  # --exhaustive
    items, gone = covered(False, "gpu")
    assert len(items) == 18 and not gone  # a GPU's cases are not cut
