"""The suite's own setup: CI runs the README's test command, and under pytest-xdist a module's tests share a worker
(a module-scoped fixture that spawns ranks or captures training steps runs once, not once per worker)."""

from __future__ import annotations

import inspect
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
    assert run.startswith("python -m pytest ") and "-n 2" in run.split("pytest", 1)[1], run
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

    monkeypatch.setattr(pytestconfig.option, "tx", ["popen", "popen"], raising=False)  # what `-n 2` sets
    scheduler = conftest.pytest_xdist_make_scheduler(pytestconfig, None)
    assert isinstance(scheduler, xdist_scheduler.LoadFileScheduling)  # xdist's "loadfile": a file's tests, one worker


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
