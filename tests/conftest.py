"""The suite's two tiers: ``python -m pytest tests -m "not slow" -n 2`` (every module's unit tests, in a few minutes)
and ``python -m pytest tests -n 2`` (everything; ``-n 2``: two pytest-xdist workers, each module's tests on one of
them). A test is ``slow`` when it spawns ranks (``multiprocess``), needs a cluster or SLURM (``cluster``, ``slurm``),
or takes more than about 5 s (marked so by hand). A test outside the slow tier that tries to spawn ranks fails with
the marker it lacks, so the fast tier can never grow a spawn unnoticed."""

import contextlib
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SLOW_BY_NATURE = ("multiprocess", "cluster", "slurm")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n``), a module's tests all run on one worker: its module-scoped fixtures (a capture of
    training steps, a preempted job) spawn their ranks once, not once per worker."""
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(name) for name in _SLOW_BY_NATURE):
            item.add_marker(pytest.mark.slow)


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
