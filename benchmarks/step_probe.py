"""``StepProbe``: a callback that records, after every optimizer step, what a benchmark needs to isolate steady state.

One JSON line per step in ``<out_dir>/rank<global rank>.jsonl``: the step, a monotonic timestamp, the loss, the
cluster environment Lightning detected, the strategy's ledger totals (``ZeroPPStrategy`` only) and, on the first
rank of each node, the byte counters of a network interface as this process sees it (its own network namespace).
It knows nothing of emulation: on a real cluster, point ``interface`` at the NIC between nodes.

    trainer:
      callbacks:
        - class_path: step_probe.StepProbe
          init_args: {out_dir: runs/probe, interface: eth0}
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


def interface_counters(interface: str) -> tuple[int, int]:
    stats = Path("/sys/class/net") / interface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


class StepProbe(Callback):
    """Args:
    out_dir: folder for the per-rank JSON-lines files.
    interface: network interface whose counters the first rank of each node records; ``None``: none.
    """

    def __init__(self, out_dir: str, interface: str | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.interface = interface
        self._file = None
        self._last_step = -1

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._file = (self.out_dir / f"rank{trainer.global_rank}.jsonl").open("w")
        self._last_step = trainer.global_step
        self._record(trainer, float("nan"))  # step 0: the start of the first step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: the optimizer step is still to come
        self._last_step = trainer.global_step
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._record(trainer, float(loss))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _record(self, trainer: Trainer, loss: float) -> None:
        row: dict[str, Any] = {
            "step": trainer.global_step,
            "time": time.monotonic(),
            "loss": loss,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
            "hostname": os.uname().nodename,
        }
        ledger = getattr(trainer.strategy, "comm_ledger", None)
        if ledger is not None:
            total = ledger.total()
            row["ledger_inter_bytes"], row["ledger_intra_bytes"] = total.inter_node_bytes, total.intra_node_bytes
            row["ledger_by_kind"] = {k: [t.intra_node_bytes, t.inter_node_bytes] for k, t in ledger.by_kind().items()}
        if self.interface and trainer.local_rank == 0:
            row["tx_bytes"], row["rx_bytes"] = interface_counters(self.interface)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
