"""The example launched by SLURM's ``srun``: Lightning's SLURM environment path, for real (needs a running SLURM).

``.ci/slurm_up.sh`` starts a one-host SLURM. ``srun -n4 --overcommit`` starts 4 tasks on it; Lightning reads ranks
from SLURM's variables (``SLURMEnvironment``), and ``ranks_per_node: 2`` in the demo config makes the 4 tasks act
as 2 nodes x 2. Lightning refuses ``--ntasks`` without ``--ntasks-per-node``, and SLURM refuses
``--ntasks-per-node=4`` on a host with fewer than 4 CPUs even with ``--overcommit``; so the tasks get
``SLURM_NTASKS_PER_NODE=4`` through ``--export``, the value ``--ntasks-per-node=4`` sets on a larger host.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zeropp.testing.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt"

pytestmark = pytest.mark.slurm

TASKS = 4


def _slurm_missing() -> str | None:
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "SLURM is not installed (srun/sinfo missing); .ci/run installs and starts it"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20).stdout
    except subprocess.TimeoutExpired:
        return "SLURM does not answer (sinfo timed out); start it with .ci/slurm_up.sh"
    if not any(s.startswith(("idle", "mixed")) for s in states.split()):
        return f"no idle SLURM node (sinfo states: {states.split() or 'none'}); start it with .ci/slurm_up.sh"
    return None


@pytest.mark.skipif(_slurm_missing() is not None, reason=str(_slurm_missing()))
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
