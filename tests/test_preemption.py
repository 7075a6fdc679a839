"""Preemption under SLURM: the requeue signal (SIGUSR1) saves ``hpc_ckpt_N.ckpt`` at a step boundary on every rank,
``scontrol requeue`` runs after the save, and the requeued job resumes exactly.

4 spawned ranks (2 nodes x 2: qwZ, hpZ, qgZ and weight deltas on) carry the ``SLURM_*`` variables of a one-node
``srun -n4`` job, so Lightning runs its auto-requeue; a fake ``scontrol`` records the requeue. The signal is raised
inside a forward, a backward, an optimizer step, a qgZ all-to-all in flight, a weight-delta exchange, a validation,
a checkpoint save and the last step; even ranks get it there, odd ranks a late copy a step later (qgZ: rank 3
alone). For each: one complete checkpoint at the step boundary, one requeue, and both the signalled run and the run
resumed from the checkpoint end with every parameter bit-identical to an uninterrupted run. Without the strategy's
handling the first case hangs until the strategy's ``timeout`` (measured: gloo "Timed out waiting 60000ms").
"""

from __future__ import annotations

import pytest
import torch

from lightning_zeropp.checkpoint_files import is_checkpoint_folder, temporary_name
from lightning_zeropp.compat.lightning import METADATA_FILENAME
from lightning_zeropp.testing.distributed import spawn
from lightning_zeropp.testing.preemption import (
    BATCH,
    CASES,
    JOB_ID,
    POINTS,
    STEPS,
    fabric_save_in_step_worker,
    fake_scontrol,
    killed_save_worker,
    preemption_worker,
    resume_worker,
)
from lightning_zeropp.testing.workers import save_inputs

pytestmark = [pytest.mark.multiprocess, pytest.mark.version_sensitive]

WORLD = 4
TIMEOUT_S = 60.0  # the strategy's: a hang ends the job after it, and fails the test


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preemption")
    init_path, data_path, *_ = save_inputs(tmp, WORLD * BATCH * STEPS)
    fake_scontrol(tmp / "bin")
    results = spawn(
        preemption_worker, WORLD, str(tmp / "runs"), str(tmp / "bin"), init_path, data_path, list(CASES), TIMEOUT_S,
        timeout=1200,
    )  # fmt: skip
    return tmp, init_path, data_path, results


def _saved_step(path) -> int:
    assert is_checkpoint_folder(path), f"{path} is not a complete sharded checkpoint"
    return torch.load(path / METADATA_FILENAME, weights_only=False)["global_step"]


def _assert_equal_weights(state, reference, what):
    assert state.keys() == reference.keys(), what
    for name, value in reference.items():
        assert torch.equal(state[name], value), f"{what}: {name} differs from the uninterrupted run"


@pytest.mark.parametrize("point", list(POINTS))
def test_requeue_signal_saves_at_a_step_boundary_and_resumes_exactly(preempted, point):
    tmp, _, _, results = preempted
    signal_step, saved_step = POINTS[point]
    root = tmp / "runs" / point
    first = 3 if point == "qgz_all_to_all" else 0
    assert results[first]["cases"][point]["done"] == {point: signal_step}, "the signal was not raised where planned"
    # one checkpoint, complete, at the step boundary after the signal; nothing else beside it
    assert sorted(p.name for p in root.iterdir() if p.name != "every2") == ["hpc_ckpt_1.ckpt", "scontrol.log"]
    assert _saved_step(root / "hpc_ckpt_1.ckpt") == saved_step
    # requeued once (the late copies on odd ranks start no second save), by rank 0, after the save
    assert (root / "scontrol.log").read_text().splitlines() == [f"requeue {JOB_ID}"]
    assert [r["cases"][point]["resumed_from"] for r in results] == [saved_step] * WORLD
    reference = results[0]["reference"]
    _assert_equal_weights(results[0]["cases"][point]["signalled"], reference, f"{point}: the signalled run")
    _assert_equal_weights(results[0]["cases"][point]["resumed"], reference, f"{point}: the resumed run")


def test_a_save_asked_for_inside_a_step_runs_at_the_boundary(preempted):
    """``trainer.save_checkpoint`` called on rank 1 alone, inside backward (as a signal handler of the user's would):
    the request waits for the step boundary, where every rank saves it; no requeue; the checkpoint resumes exactly."""
    tmp, _, _, results = preempted
    root = tmp / "runs" / "save_in_step"
    assert results[1]["cases"]["save_in_step"]["done"] == {"backward": 1}
    assert _saved_step(root / "asked.ckpt") == 2
    assert not (root / "scontrol.log").exists()
    assert [r["cases"]["save_in_step"]["resumed_from"] for r in results] == [2] * WORLD
    reference = results[0]["reference"]
    _assert_equal_weights(results[0]["cases"]["save_in_step"]["signalled"], reference, "the run that asked")
    _assert_equal_weights(results[0]["cases"]["save_in_step"]["resumed"], reference, "the resumed run")


def test_sigterm_during_the_requeue_save_waits_for_it_and_says_so(preempted):
    """SIGTERM raised on every rank inside the requeue save: the save completes, the run then stops (Lightning's
    SIGTERM handling) and the warning names the complete checkpoint and its step; the requeued job resumes exactly."""
    tmp, _, _, results = preempted
    root = tmp / "runs" / "sigterm_during_save"
    case = [r["cases"]["sigterm_during_save"] for r in results]
    assert [c["done"] for c in case] == [{"forward": 1, "checkpoint_save": 2}] * WORLD
    assert [c["stopped"] for c in case] == ["SIGTERMException"] * WORLD
    assert _saved_step(root / "hpc_ckpt_1.ckpt") == 2
    assert (root / "scontrol.log").read_text().splitlines() == [f"requeue {JOB_ID}"]
    said = [w for w in case[0]["signalled_warnings"] if "SIGTERM stopped the run" in w]
    assert len(said) == 1 and "after global step 2" in said[0], case[0]["signalled_warnings"]
    assert f"{root / 'hpc_ckpt_1.ckpt'} (global step 2) is complete" in said[0], said[0]
    assert [c["resumed_from"] for c in case] == [2] * WORLD
    _assert_equal_weights(case[0]["resumed"], results[0]["reference"], "the resumed run")


def test_a_killed_requeue_save_leaves_the_previous_one_to_resume_from(preempted):
    """Two requeue signals; every rank is killed (SIGKILL) inside the second requeue save, after writing its shards.
    ``hpc_ckpt_1`` stays whole; the incomplete save's hidden temporary does not confuse Lightning's search for the
    newest ``hpc_ckpt_N`` (its name holds no ``hpc_ckpt_``); the requeued job resumes from ``hpc_ckpt_1``, exactly,
    and its warning names the incomplete save."""
    tmp, init_path, data_path, results = preempted
    root = tmp / "killed"
    args = (str(root), str(tmp / "bin"), init_path, data_path, TIMEOUT_S)
    with pytest.raises(AssertionError) as killed:
        spawn(killed_save_worker, WORLD, *args, timeout=600)
    assert str(killed.value).count("no result (exit code -9)") == WORLD, str(killed.value)[-3000:]
    assert _saved_step(root / "hpc_ckpt_1.ckpt") == 2
    assert not (root / "hpc_ckpt_2.ckpt").exists()
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
    prefix = temporary_name(root / "hpc_ckpt_2.ckpt").name[:-8]  # without the random part
    assert len(leftovers) == 1 and leftovers[0].startswith(prefix), leftovers
    assert (root / "scontrol.log").read_text().splitlines() == [f"requeue {JOB_ID}"]  # the first save's requeue

    resumed = spawn(resume_worker, WORLD, *args, timeout=600)
    assert [r["resumed_from"] for r in resumed] == [2] * WORLD
    assert any("the save of hpc_ckpt_2.ckpt is incomplete" in w for w in resumed[0]["warnings"]), resumed[0]["warnings"]
    _assert_equal_weights(resumed[0]["state"], results[0]["reference"], "the job resumed from hpc_ckpt_1")


def test_fabric_save_during_a_step_is_refused_with_the_fix(tmp_path):
    """Fabric has no step boundary to wait for: ``fabric.save`` inside an optimizer step (where a signal handler
    could call it) raises on every rank, saying what to do, and writes nothing; saving after the step works."""
    for rank, r in enumerate(spawn(fabric_save_in_step_worker, 2, str(tmp_path), timeout=300)):
        assert r["error"] is not None and r["error"].startswith("ZeroPPStrategy: fabric.save("), (rank, r["error"])
        assert "call fabric.save after optimizer.step()" in r["error"], r["error"]
        assert r["saved"] == ["between_steps"], (rank, r["saved"])
