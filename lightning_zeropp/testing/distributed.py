"""Spawned gloo ranks for tests, and a quiet CPU Trainer for one of them."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer

from lightning_zeropp.spawn import free_port, run_local_ranks

__all__ = ["free_port", "lightning_trainer", "slurm_missing", "spawn"]


def spawn(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`~lightning_zeropp.spawn.run_local_ranks` for tests: a failing or hanging rank fails the test.

    ``fn`` must be importable by name (a module-level function of an importable module): the ranks are fresh
    processes. Keyword arguments (``ranks_per_machine``, ``timeout``, ``env``) go to ``run_local_ranks``.
    """
    try:
        return run_local_ranks(fn, world_size, *args, **kwargs)
    except RuntimeError as err:
        raise AssertionError(str(err)) from None


def lightning_trainer(world_size: int, strategy: Any, num_nodes: int = 1, **kwargs: Any) -> Trainer:
    """A quiet CPU Trainer for one of the spawned ranks (the processes exist already: Lightning only joins them).

    ``world_size // num_nodes`` devices per node; ``kwargs`` override the defaults (no logger, no checkpointing,
    no progress bar, no validation).
    """
    defaults = dict(
        accelerator="cpu",
        devices=world_size // num_nodes,
        num_nodes=num_nodes,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


def slurm_missing() -> str | None:
    """Why no job can be launched with ``srun`` here (None: SLURM is installed and has an idle node)."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "SLURM is not installed (srun/sinfo missing); .ci/run installs and starts it"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20).stdout
    except subprocess.TimeoutExpired:
        return "SLURM does not answer (sinfo timed out); start it with .ci/slurm_up.sh"
    if not any(s.startswith(("idle", "mixed")) for s in states.split()):
        return f"no idle SLURM node (sinfo states: {states.split() or 'none'}); start it with .ci/slurm_up.sh"
    return None
