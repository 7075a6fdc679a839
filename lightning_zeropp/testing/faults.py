"""Faults injected into spawned training ranks: a rank that freezes or dies mid-step, a launch that disagrees with
the Trainer. Used by ``tests/test_reliability.py`` and ``benchmarks/reliability.py`` (which times them)."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy

from .distributed import lightning_trainer
from .models import TinyLM, make_batches

__all__ = ["FaultAtStep", "fault_worker", "launch_worker", "loader"]


def loader(n: int = 16) -> DataLoader:
    return DataLoader(TensorDataset(*make_batches(n)), batch_size=2)


class FaultAtStep(Callback):
    """At optimizer step ``step``, ``rank`` freezes (SIGSTOP: what a hung data loader or device looks like to its
    peers) or dies (``os._exit``); every rank first writes the time that step started to ``out/at{rank}``."""

    def __init__(self, fault: str, rank: int, out: str, step: int = 2) -> None:
        if fault not in ("freeze", "die"):
            raise ValueError(f"fault={fault!r}: use 'freeze' or 'die'")
        self.fault, self.rank, self.out, self.step = fault, rank, out, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        Path(self.out, f"at{trainer.global_rank}").write_text(str(time.time()))
        if trainer.global_rank == self.rank:
            if self.fault == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os._exit(13)


def fault_worker(rank: int, world: int, out: str, fault: str, timeout_s: float, per_node: int) -> None:
    """Trains TinyLM with every ZeRO++ technique on while the last rank freezes or dies at step 2. A survivor writes
    ``out/survivor{rank}.json``: seconds from the fault to its error, and the error; then re-raises."""
    torch.manual_seed(0)
    strategy = ZeroPPStrategy(ranks_per_node=per_node, timeout=timedelta(seconds=timeout_s))
    faulty = world - 1
    trainer = lightning_trainer(
        world, strategy, num_nodes=world // per_node, max_steps=8, callbacks=[FaultAtStep(fault, faulty, out)]
    )
    report: dict = {"error": None}
    try:
        trainer.fit(TinyLM(), loader())
    except BaseException as err:
        faulted_at = float(Path(out, f"at{faulty}").read_text())
        report = {"after_fault_s": time.time() - faulted_at, "error": f"{type(err).__name__}: {err}"}
        raise
    finally:
        Path(out, f"survivor{rank}.json").write_text(json.dumps(report))


def launch_worker(rank: int, world: int, num_nodes: int, devices: int) -> dict:
    """Starts ``fit`` with a Trainer of ``num_nodes`` x ``devices`` in a process the launcher placed otherwise;
    returns the error (or "trained") and the seconds it took."""
    start = time.time()
    trainer = lightning_trainer(num_nodes * devices, ZeroPPStrategy(), num_nodes=num_nodes, max_steps=1)
    try:
        trainer.fit(TinyLM(), loader(4))
    except RuntimeError as err:
        return {"error": str(err), "seconds": time.time() - start}
    return {"error": "trained", "seconds": time.time() - start}
