"""Lightning's SLURM path, for real (needs a running SLURM): the example launched by ``srun``, and a batch job that
the requeue signal checkpoints, requeues and resumes.

``.ci/slurm_up.sh`` starts a one-host SLURM. ``srun -n4 --overcommit`` starts 4 tasks on it; Lightning reads ranks
from SLURM's variables (``SLURMEnvironment``), and ``ranks_per_node: 2`` in the demo config makes the 4 tasks act
as 2 nodes x 2. Lightning refuses ``--ntasks`` without ``--ntasks-per-node``, and SLURM refuses
``--ntasks-per-node=4`` on a host with fewer than 4 CPUs even with ``--overcommit``; so the tasks get
``SLURM_NTASKS_PER_NODE=4`` through ``--export``, the value ``--ntasks-per-node=4`` sets on a larger host.
"""

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_zeropp.testing.distributed import free_port, slurm_missing

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt"

pytestmark = pytest.mark.slurm

TASKS = 4


@pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))
def test_srun_launches_the_example_as_two_nodes(tmp_path):
    override = tmp_path / "slurm.yaml"
    override.write_text(
        json.dumps(  # YAML is a superset of JSON
            {
                "trainer": {
                    "callbacks": [
                        {"class_path": "lightning_zeropp.CommVolumeMonitor"},
                        {"class_path": "step_probe.StepProbe", "init_args": {"out_dir": str(tmp_path / "probe")}},
                    ],
                    "logger": {
                        "class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(tmp_path)},
                    },
                }
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")]),
    )
    cmd = [
        "srun", f"-n{TASKS}", "--overcommit", f"--export=ALL,SLURM_NTASKS_PER_NODE={TASKS}", "--time=10",
        sys.executable, str(EXAMPLE / "train.py"), "fit",
        "--config", str(EXAMPLE / "configs" / "cpu_demo.yaml"), "--config", str(override),
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
        "--model.block_size", "64", "--data.batch_size", "2", "--data.max_bytes", "300000",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    probes = sorted((tmp_path / "probe").glob("rank*.jsonl"))
    assert [p.name for p in probes] == [f"rank{r}.jsonl" for r in range(TASKS)]
    for path in probes:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2, 3]
        assert all(r["cluster_environment"] == "SLURMEnvironment" and r["world_size"] == TASKS for r in rows)
        assert all(math.isfinite(r["loss"]) for r in rows[1:])
        # 4 tasks on one SLURM node act as 2 nodes x 2: the ledger sees traffic across the emulated boundary
        assert rows[-1]["ledger_inter_bytes"] > 0 and rows[-1]["ledger_intra_bytes"] > 0


def _job_state(job_id: str) -> tuple[str, str]:
    """(state, reason) of a job while SLURM lists it in its queue; ("", "") once it has left."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout.split()
    return (out[0], out[1]) if len(out) >= 2 else ("", "")


def _run_reference(args: tuple, failures: list[str]) -> None:
    from lightning_zeropp.testing.distributed import spawn
    from lightning_zeropp.testing.preemption import srun_reference_worker

    try:
        spawn(srun_reference_worker, TASKS, *args, timeout=600)
    except AssertionError as err:
        failures.append(str(err))


@pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))
def test_requeue_signal_to_an_sbatch_job_requeues_it_and_it_resumes_exactly(tmp_path):
    """A batch job (``sbatch --requeue``, ``srun`` of 4 tasks acting as 2 nodes x 2) gets SIGUSR1 from ``scancel
    --signal=USR1`` in the middle of its training: every task saves ``hpc_ckpt_1.ckpt`` at the same step boundary,
    rank 0 runs the real ``scontrol requeue``, SLURM ends the job (SIGTERM), queues it again, and the restarted job
    resumes from the checkpoint (Lightning's default under SLURM) and ends with every parameter equal, bit for bit,
    to the same task never interrupted (run meanwhile on spawned ranks given the variables srun sets). SLURM holds a
    requeued job for a while before it may start again; the test lets it start at once (``scontrol update
    StartTime=now``)."""
    from lightning_zeropp.checkpoint_files import is_checkpoint_folder
    from lightning_zeropp.compat.lightning import METADATA_FILENAME
    from lightning_zeropp.testing.preemption import BATCH
    from lightning_zeropp.testing.workers import save_inputs

    steps, timeout_s = 6, 120
    init_path, data_path, *_ = save_inputs(tmp_path, TASKS * BATCH * steps)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    srun = ["srun", f"-n{TASKS}", "--overcommit", f"--export=ALL,SLURM_NTASKS_PER_NODE={TASKS}"]
    task = [sys.executable, "-m", "lightning_zeropp.testing.preemption"]

    root = tmp_path / "job"
    root.mkdir()
    script = tmp_path / "job.sh"
    line = " ".join([*srun, *task, str(root), init_path, data_path, str(steps), "1", str(timeout_s)])
    script.write_text(f"#!/bin/bash\n{line}\n")
    submit = [
        "sbatch", "--parsable", "--requeue", f"-n{TASKS}", "--overcommit", "--time=15", "--open-mode=append",
        f"--output={tmp_path / 'job.out'}", str(script),
    ]  # fmt: skip
    job_id = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    # The uninterrupted run, on spawned ranks with the variables srun sets (the same task function, no signal),
    # while the job runs: it waits on its pauses and on SLURM's requeue most of the time.
    reference, failures = tmp_path / "reference", []
    reference.mkdir()
    args = (str(reference), init_path, data_path, steps, timeout_s)
    worker = threading.Thread(target=_run_reference, args=(args, failures), daemon=True)
    worker.start()
    signalled, released = False, False
    for _ in range(3600):  # at most 15 minutes
        state, reason = _job_state(job_id)
        if not state:
            break
        progress = root / "progress"
        if not signalled and progress.exists() and int(progress.read_text() or 0) >= 2:
            subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
            signalled = True
        if signalled and state == "PENDING" and reason == "BeginTime":
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True)
            released = True
        time.sleep(0.25)
    else:
        subprocess.run(["scancel", job_id])
        pytest.fail(f"job {job_id} did not finish in 15 minutes; its output:\n{(tmp_path / 'job.out').read_text()}")
    worker.join(timeout=600)
    assert not worker.is_alive() and not failures, failures or "the reference run did not end in 10 minutes"
    log = (tmp_path / "job.out").read_text()
    assert signalled and released, log[-5000:]

    first = [json.loads((root / f"task{r}-0.json").read_text()) for r in range(TASKS)]
    second = [json.loads((root / f"task{r}-1.json").read_text()) for r in range(TASKS)]
    saved = root / "hpc_ckpt_1.ckpt"
    assert is_checkpoint_folder(saved) and not (root / "hpc_ckpt_2.ckpt").exists(), log[-5000:]
    step = torch.load(saved / METADATA_FILENAME, weights_only=False)["global_step"]
    assert 2 <= step < steps, log[-5000:]
    # the first run: from the start, until the requeue's SIGTERM stopped it after the save
    assert all(t["start"] == 0 and t["stopped"] and t["batches"] >= step for t in first), (first, log[-5000:])
    # the requeued run: from the checkpoint to the end
    assert [(t["start"], t["stopped"], t["batches"]) for t in second] == [(step, False, steps - step)] * TASKS, second
    assert log.count("Requeued SLURM job") == 1, log[-5000:]
    assert "SIGTERM stopped the run" in log and f"{saved} (global step {step}) is complete" in log, log[-5000:]
    expected = torch.load(reference / "final.pt", weights_only=True)
    resumed = torch.load(root / "final.pt", weights_only=True)
    assert resumed.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), f"{name} differs from the uninterrupted job"
