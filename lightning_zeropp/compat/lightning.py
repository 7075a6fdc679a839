"""Lightning symbols that are private or changed between the versions lightning-zeropp supports (lightning >= 2.6).

Lightning's strategies are extended through a few private hooks and helpers; this module is the only place that names
them. :class:`ModelParallelBase` gives the private extension points of ``ModelParallelStrategy`` public names, so the
strategy itself is written against this module's names only.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .versions import LIGHTNING_VERSION, require

require(LIGHTNING_VERSION >= (2, 6), "lightning", "ModelParallelStrategy with FSDP2 and distributed checkpoints")
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy  # noqa: E402
from lightning.fabric.strategies import Strategy as FabricStrategy  # noqa: E402
from lightning.fabric.strategies.strategy import _BackwardSyncControl  # noqa: E402
from lightning.fabric.utilities.load import _METADATA_FILENAME  # noqa: E402
from lightning.fabric.utilities.optimizer import _optimizers_to_device  # noqa: E402
from lightning.pytorch.strategies.strategy import _ForwardRedirection  # noqa: E402
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector  # noqa: E402

require(
    hasattr(ModelParallelStrategy, "_setup_distributed"),
    "lightning",
    "the strategy hooks ZeroPPStrategy overrides",
)

# The file of a sharded checkpoint folder that holds everything but the tensors; Lightning's loader reads it.
METADATA_FILENAME: str = _METADATA_FILENAME

require(
    hasattr(_SignalConnector, "_slurm_sigusr_handler_fn") and hasattr(_HandlersCompose, "__init__"),
    "lightning",
    "the SLURM auto-requeue signal handler ZeroPPStrategy runs at a step boundary",
)

# What ``Trainer.save_checkpoint`` names the barrier it calls right after ``strategy.save_checkpoint``.
SAVE_CHECKPOINT_BARRIER = "Trainer.save_checkpoint"

require(
    hasattr(FabricModelParallelStrategy, "_setup_distributed"),
    "lightning",
    "the Fabric strategy hook lightning_zeropp.fabric.ZeroPPStrategy builds on",
)

__all__ = [
    "METADATA_FILENAME",
    "SAVE_CHECKPOINT_BARRIER",
    "FabricModelParallelBase",
    "ForwardRedirection",
    "ModelParallelBase",
    "disable_inference_mode",
    "requeue_handler",
]


class ForwardRedirection(_ForwardRedirection):
    """Lightning's forward redirection: a step method called through the wrapper module's ``forward``, with two hooks,
    ``on_after_inner_forward`` (the method returned, the wrapper's forward has not) and ``on_after_outer_forward``."""


class ModelParallelBase(ModelParallelStrategy):
    """``ModelParallelStrategy`` with the private parts lightning-zeropp builds on given public names.

    Subclasses implement :meth:`shard_model` (called by :meth:`base_setup` after the precision plugin converted the
    model) and call :meth:`setup_distributed`, :meth:`set_device_mesh` and :meth:`base_setup`.
    """

    def shard_model(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def setup_distributed(self) -> None:
        """Lightning's process-group setup of ``ModelParallelStrategy`` (ranks, backend, timeout), without its mesh."""
        self._setup_distributed()

    def set_device_mesh(self, mesh: Any) -> None:
        """The mesh ``device_mesh`` returns, also on the LightningModule (``configure_model`` may read it)."""
        self._device_mesh = mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = mesh

    def base_setup(self, trainer: pl.Trainer) -> None:
        """``ModelParallelStrategy.setup`` for a strategy that shards the model itself: the accelerator, the precision
        conversion, :meth:`shard_model` (which also materializes what is left on the meta device), whatever the
        units left off the device, then the optimizers and the precision plugin.

        Lightning's ``ModelParallelStrategy.setup`` requires ``configure_model`` to parallelize the model, and its
        base ``Strategy.setup`` moves the whole model to the device before ``_setup_model``: a plain ``.to(device)``
        that fails on meta tensors (``init_module(empty_init=True)``) and would put the whole model on one device.
        Here ``fully_shard`` moves each unit's parameters as it shards them."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self.shard_model(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)


def disable_inference_mode(trainer: pl.Trainer) -> None:
    """Evaluation loops run under ``torch.no_grad`` instead of ``torch.inference_mode``.

    FSDP2's buffers must not be created under inference mode (pytorch#95957); Lightning falls back to no_grad only
    for gloo and for its own FSDPStrategy. The loops hold the choice in an attribute that is not part of the API.
    """
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        require(hasattr(loop, "inference_mode"), "lightning", "evaluation loops without inference_mode")
        loop.inference_mode = False


class _NoGradientSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: with ``enabled``, no gradient is reduced inside the context (each
    sharded module accumulates its unsharded gradients); on exit every module reduces again. With ``enabled=False``
    nothing changes. (Lightning's own control sets the modules to ``enabled`` on exit, so after
    ``no_backward_sync(model, enabled=False)`` no gradient would ever be reduced again.)"""

    @contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        units = [m for m in module.modules() if isinstance(m, FSDPModule)] if enabled else []
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)


class FabricModelParallelBase(FabricModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` with the private parts lightning-zeropp builds on given public names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _NoGradientSync()

    def setup_distributed(self) -> None:
        """The device set up by the accelerator (Fabric's ``Strategy.setup_environment``), then the process-group
        setup of ``ModelParallelStrategy`` (ranks, backend, timeout), without its 2-D mesh: as the Trainer's
        ``ModelParallelStrategy`` does in its own ``_setup_distributed``."""
        FabricStrategy.setup_environment(self)
        self._setup_distributed()

    def set_device_mesh(self, mesh: Any) -> None:
        self._device_mesh = mesh


def requeue_handler(signum: int) -> Callable[[int, Any], None] | None:
    """The handler installed for ``signum`` if it is the one Lightning's SLURM auto-requeue installs (``Trainer.fit``
    and the other entry points do, under ``SLURMEnvironment(auto_requeue=True)``, unless the signal already had a
    handler): called as ``handler(signum, frame)``, it finalizes the loggers, saves ``hpc_ckpt_N.ckpt`` with
    ``trainer.save_checkpoint`` on every rank, and runs ``scontrol requeue <job id>`` on rank 0. None otherwise."""
    handler = signal.getsignal(signum)
    if not isinstance(handler, _HandlersCompose):
        return None
    requeue = _SignalConnector._slurm_sigusr_handler_fn
    if any(getattr(h, "__func__", None) is requeue for h in handler.signal_handlers):
        return handler
    return None
