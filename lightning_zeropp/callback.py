"""``CommVolumeMonitor``: logs how many bytes each optimizer step sent inside and across nodes.
``ZeroGradientMonitor``: finds parameters whose reduced gradient is exactly zero (parameters that do not train)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from .ledger import UNITS


class CommVolumeMonitor(Callback):
    """Logs ``comm/inter_node_MB`` and ``comm/intra_node_MB`` (this rank's payload) after every optimizer step.

    Those totals are the strategy's own, data-parallel collectives. With ``tensor_parallel_size`` > 1 the monitor also
    switches on the counting of the model's tensor-parallel collectives for its run
    (``ZeroPPStrategy.count_tensor_parallel_bytes``) and logs their totals apart, ``comm/tensor_parallel/inter_node_MB``
    and ``comm/tensor_parallel/intra_node_MB``.

    Args:
        per_kind: also log one pair of metrics per collective kind (``comm/weight_all_gather/inter_node_MB``, ...;
            ``comm/tensor_parallel_all_reduce/intra_node_MB``, ... for the tensor-parallel ones).
        prog_bar: also show the two totals in the progress bar (off by default: their names are long, and the bar
            would wrap; the metrics go to the loggers either way).
        unit: ``"B"``, ``"KB"``, ``"MB"`` or ``"GB"`` (decimal); the metric names carry it.
    """

    def __init__(self, per_kind: bool = False, prog_bar: bool = False, unit: str = "MB") -> None:
        for name, value in (("per_kind", per_kind), ("prog_bar", prog_bar)):
            if not isinstance(value, bool):
                raise TypeError(f"CommVolumeMonitor: `{name}` must be True or False, got {value!r}.")
        if unit not in UNITS:
            raise ValueError(f"CommVolumeMonitor: `unit={unit!r}` is not allowed; choose one of {list(UNITS)}.")
        self.per_kind = per_kind
        self.prog_bar = prog_bar
        self.unit = unit
        self._last_global_step = -1
        self._accumulating = False
        self._counted_before: bool | None = None  # the strategy's tensor-parallel switch before this run

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from .strategy import ZeroPPStrategy

        if not isinstance(trainer.strategy, ZeroPPStrategy):
            raise TypeError(
                f"CommVolumeMonitor reads ZeroPPStrategy's ledger, but the Trainer uses"
                f" {type(trainer.strategy).__name__}. Pass `strategy=ZeroPPStrategy(...)` or drop the callback."
            )
        if trainer.strategy.topology.tensor_parallel_size > 1 and self._counted_before is None:
            self._counted_before = trainer.strategy.count_tensor_parallel_bytes(True)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._counted_before is not None:  # the switch as this run found it
            trainer.strategy.count_tensor_parallel_bytes(self._counted_before)
            self._counted_before = None

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
        totals = ledger.step_metrics(self.unit, per_kind=False, restart=False)
        pl_module.log_dict(totals, prog_bar=self.prog_bar, on_step=True, on_epoch=False, rank_zero_only=True)
        if self.per_kind:
            metrics = ledger.step_metrics(self.unit, per_kind=True, restart=False)
            per_kind = {k: v for k, v in metrics.items() if k not in totals}
            pl_module.log_dict(per_kind, on_step=True, on_epoch=False, rank_zero_only=True)


class ZeroGradientMonitor(Callback):
    """Finds trained parameters whose gradient is exactly zero in every element, on all ranks, at an optimizer step.

    Why: a parameter whose gradient arrives as exact zeros while its true gradient is not never trains, and nothing
    else shows it; the loss only drifts a little. Quantized gradient communication can do this: when a small
    parameter (a bias, a norm weight) shares a quantization block with a large one, the block's scale follows the
    large values and the small gradients round to zero, every step. This callback makes that visible. A parameter
    that is genuinely unused by the loss also shows up here (its gradient is exactly zero too), which is worth
    knowing on its own.

    Runs in ``on_before_optimizer_step`` (once per optimizer step, after gradient accumulation and reduction). Per
    trained parameter (``requires_grad`` and a gradient) each rank checks its local part (``grad.to_local()`` for
    the DTensor shards of FSDP2) for any non-zero element; one ``all_reduce(MAX)`` of a small tensor over the
    default process group combines the ranks (none when ``torch.distributed`` is not initialized). Works with any
    strategy.

    Logs (rank 0, on step): ``zeropp/zero_gradient_parameters`` (parameters all-zero at this step) and
    ``zeropp/starved_parameters`` (parameters all-zero at any step so far). ``monitor.starved`` is the set of
    their names over the whole run; ``monitor.last_zero`` the names at the latest step.

    Args:
        verbose: at the end of training, print (rank 0) the names of the starved parameters.
    """

    def __init__(self, verbose: bool = True) -> None:
        self.verbose = verbose
        self.starved: set[str] = set()
        self.last_zero: list[str] = []

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        names, flags, device = [], [], None
        for name, param in pl_module.named_parameters():
            if not param.requires_grad:
                continue
            # 0: no gradient here; 1: a gradient, all zero here; 2: a gradient with a non-zero element here. The
            # list holds every trained parameter, gradient or not, so it has the same length on every rank.
            grad = param.grad
            names.append(name)
            if grad is None:
                flags.append(torch.zeros((), dtype=torch.float32))
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            device = local.device
            flags.append(1.0 + local.ne(0).any().float())
        if not names:
            return
        device = device or pl_module.device
        combined = torch.stack([f.to(device) for f in flags])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(combined, op=dist.ReduceOp.MAX)
        zero = [name for name, flag in zip(names, combined.tolist(), strict=True) if flag == 1.0]
        self.last_zero = zero
        self.starved.update(zero)
        metrics = {
            "zeropp/zero_gradient_parameters": float(len(zero)),
            "zeropp/starved_parameters": float(len(self.starved)),
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.verbose and self.starved:
            rank_zero_info(
                f"ZeroGradientMonitor: {len(self.starved)} parameter(s) had an all-zero gradient at some step:"
                f" {', '.join(sorted(self.starved))}"
            )
