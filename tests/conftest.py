"""The suite's two tiers: ``python -m pytest tests -m "not slow" -n 3`` (every module's unit tests, in a few minutes)
and ``python -m pytest tests -n 3`` (everything; ``-n 3``: three pytest-xdist workers, each module's tests on one of
them). A test is ``slow`` when it spawns ranks (``multiprocess``), needs a cluster or SLURM (``cluster``, ``slurm``),
or takes more than about 5 s (marked so by hand). A test outside the slow tier that tries to spawn ranks fails with
the marker it lacks, so the fast tier can never grow a spawn unnoticed."""

import contextlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from lightning_zeropp.kernels.covering import covering

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SLOW_BY_NATURE = ("multiprocess", "cluster", "slurm")


TEST_BY_TEST = ("tests/test_kernels.py", "tests/test_kernels_rotation.py")
"""Modules whose tests share nothing costly (no module-scoped fixture): given out one test at a time, last, so that
they fill the gaps at the end of the run. Every other module's tests run on one worker."""

SUITE_TIME = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "suite" / "suite_time.json"


def module_seconds(path: Path = SUITE_TIME) -> dict[str, float]:
    """Each test module's seconds in the latest full run ``benchmarks/suite_time.py`` recorded ({} without one)."""
    try:
        runs = json.loads(path.read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    full = [r for r in runs if r.get("tier") == "full" and r.get("module_seconds")]
    return full[-1]["module_seconds"] if full else {}


def work_order(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """The order in which the tests are given out: modules the longest first by ``seconds`` (a module it does not
    know first of all: it may be long), each module's tests in their order; the modules of :data:`TEST_BY_TEST` last.
    The longest module given out last would otherwise keep one worker busy while the other waits (xdist's own order
    is by number of tests: a module of two tests spawning clusters came near the end)."""

    def key(i: int) -> tuple:
        module = nodeids[i].split("::", 1)[0]
        return module in TEST_BY_TEST, -seconds.get(module, math.inf)

    return sorted(range(len(nodeids)), key=key)  # stable: a module's tests keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n``), a module's tests all run on one worker: its module-scoped fixtures (a capture of
    training steps, a preempted job) spawn their ranks once, not once per worker. Work is given out in the workers'
    collection order (:func:`work_order`), not by xdist's count of tests per module."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesLongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if module in TEST_BY_TEST else module

    config.option.loadscopereorder = False
    return ModulesLongestFirst(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(name) for name in _SLOW_BY_NATURE):
            item.add_marker(pytest.mark.slow)
    _cover_matrices(config, items)
    if hasattr(config, "workerinput"):  # an xdist worker: its collection order is the order of work
        order = work_order([item.nodeid for item in items], module_seconds())
        items[:] = [items[i] for i in order]


def _skipped_at_collection(item) -> bool:
    return any(m.args and m.args[0] is True for m in item.iter_markers("skipif")) or item.get_closest_marker("skip")


def _cover_matrices(config, items) -> None:
    """In a module marked ``matrix``, each parametrized test's cases are a product of parameter values. The fast tier
    runs a :func:`covering` of strength 1 (every value at least once); the full suite adds the cases that make it a
    covering of strength 2 (every pair of values meets), marked ``slow``; ``--exhaustive`` runs every case. The
    interpreter's cases are cut so; on a GPU, where a case takes milliseconds, the full suite runs every case. Cases
    skipped at collection (no GPU) and cases marked ``slow`` by hand take no part."""
    groups: dict[tuple, list] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not item.get_closest_marker("matrix") or item.get_closest_marker("slow"):
            continue
        if _skipped_at_collection(item):
            continue
        groups.setdefault((item.module.__name__, item.originalname), []).append(item)
    beyond = []
    for members in groups.values():
        cases = [{name: repr(value) for name, value in m.callspec.params.items()} for m in members]
        fast = covering(cases, 1)
        pairs = covering(cases, 2, tuple(fast))
        for i, m in enumerate(members):
            if i in fast:
                continue
            m.add_marker(pytest.mark.slow)
            if i not in pairs and m.get_closest_marker("triton_interpret"):
                beyond.append(m)
    if beyond and not config.getoption("exhaustive"):
        kept = set(map(id, beyond))
        items[:] = [item for item in items if id(item) not in kept]
        config.hook.pytest_deselected(items=beyond)


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="run every case of the kernel matrices in Triton's interpreter (by default the full suite runs the cases "
        "in which every pair of parameter values meets; run this after changing a kernel)",
    )


@contextlib.contextmanager
def environment_restored():
    """Leaves ``os.environ`` as it found it: variables set inside are removed, changed ones restored."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _isolated_environment():
    """Each test leaves ``os.environ`` as it found it. Ranks take the caller's environment, and Lightning seeds every
    rank from ``PL_GLOBAL_SEED`` when set: a ``seed_everything`` in one test's process would otherwise choose the
    initial weights of whatever another test spawns later on the same worker, so a result would depend on which
    modules pytest-xdist gave that worker before."""
    with environment_restored():
        yield


@pytest.fixture(autouse=True)
def _own_master_port(request, _isolated_environment):
    """A test that starts ranks gets a ``MASTER_PORT`` of its own, drawn below the kernel's ephemeral range
    (``spawn.free_port``): Lightning's and Fabric's launchers otherwise take a port the kernel handed out and released,
    which the other xdist worker's gloo connections can take first (our own spawn draws its own port the same way)."""
    if request.node.get_closest_marker("multiprocess"):
        from lightning_zeropp.spawn import free_port

        os.environ["MASTER_PORT"] = str(free_port())


@pytest.fixture(autouse=True)
def _fast_tests_spawn_nothing(request, monkeypatch):
    if request.node.get_closest_marker("slow"):
        return
    import lightning_zeropp.spawn

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} spawns ranks but is not marked `multiprocess` (hence `slow`): mark it, so that"
            ' `pytest -m "not slow"` stays fast.'
        )

    monkeypatch.setattr(lightning_zeropp.spawn, "run_local_ranks", refuse)
    monkeypatch.setattr("lightning_zeropp.testing.distributed.run_local_ranks", refuse)
