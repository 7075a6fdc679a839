"""``CommVolumeMonitor``: logs how many bytes each optimizer step sent inside and across nodes."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}


class CommVolumeMonitor(Callback):
    """Logs ``comm/inter_node_MB`` and ``comm/intra_node_MB`` (this rank's payload) after every optimizer step.

    Args:
        per_kind: also log one pair of metrics per collective kind (``comm/weight_all_gather/inter_node_MB``, ...).
        prog_bar: show the two totals in the progress bar.
        unit: ``"B"``, ``"KB"``, ``"MB"`` or ``"GB"`` (decimal); the metric names carry it.
    """

    def __init__(self, per_kind: bool = False, prog_bar: bool = True, unit: str = "MB") -> None:
        if unit not in _UNITS:
            raise ValueError(f"CommVolumeMonitor: `unit={unit!r}` is not allowed; choose one of {list(_UNITS)}.")
        self.per_kind = per_kind
        self.prog_bar = prog_bar
        self.unit = unit
        self._last_global_step = -1
        self._accumulating = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from .strategy import ZeroPPStrategy

        if not isinstance(trainer.strategy, ZeroPPStrategy):
            raise TypeError(
                f"CommVolumeMonitor reads ZeroPPStrategy's ledger, but the Trainer uses"
                f" {type(trainer.strategy).__name__}. Pass `strategy=ZeroPPStrategy(...)` or drop the callback."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_global_step = trainer.global_step
        self._accumulating = False

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # Counting starts with the step's first micro-batch, so validation run between steps is not charged to it.
        if not self._accumulating:
            trainer.strategy.comm_ledger.start_step()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Automatic optimization: wait for the micro-batch that steps the optimizer (its reduction belongs to the
        # step). Manual optimization decides itself when to step (or not at all): every batch is a step.
        self._accumulating = pl_module.automatic_optimization and trainer.global_step == self._last_global_step
        if self._accumulating:
            return
        self._last_global_step = trainer.global_step
        ledger = trainer.strategy.comm_ledger
        scale = _UNITS[self.unit]
        step = ledger.step()
        metrics = {
            f"comm/inter_node_{self.unit}": step.inter_node_bytes / scale,
            f"comm/intra_node_{self.unit}": step.intra_node_bytes / scale,
        }
        pl_module.log_dict(metrics, prog_bar=self.prog_bar, on_step=True, on_epoch=False, rank_zero_only=True)
        if self.per_kind:
            per_kind = {}
            for kind, traffic in ledger.by_kind(step=True).items():
                per_kind[f"comm/{kind}/inter_node_{self.unit}"] = traffic.inter_node_bytes / scale
                per_kind[f"comm/{kind}/intra_node_{self.unit}"] = traffic.intra_node_bytes / scale
            pl_module.log_dict(per_kind, on_step=True, on_epoch=False, rank_zero_only=True)
