"""Lightning symbols that are private or changed between the versions lightning-zeropp supports (lightning >= 2.6).

Lightning's strategies are extended through a few private hooks and helpers; this module is the only place that names
them. :class:`ModelParallelBase` gives the private extension points of ``ModelParallelStrategy`` public names, so the
strategy itself is written against this module's names only.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import nn

from .versions import LIGHTNING_VERSION, require

require(LIGHTNING_VERSION >= (2, 6), "lightning", "ModelParallelStrategy with FSDP2 and distributed checkpoints")
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy  # noqa: E402
from lightning.fabric.strategies import Strategy as FabricStrategy  # noqa: E402
from lightning.fabric.strategies import model_parallel as _fabric_model_parallel  # noqa: E402
from lightning.fabric.utilities.init import _materialize_distributed_module  # noqa: E402
from lightning.fabric.utilities.load import _METADATA_FILENAME  # noqa: E402
from lightning.pytorch.strategies.strategy import _ForwardRedirection  # noqa: E402
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector  # noqa: E402

require(
    hasattr(Strategy, "_setup_model") and hasattr(ModelParallelStrategy, "_setup_distributed"),
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
    hasattr(FabricModelParallelStrategy, "_setup_distributed")
    and hasattr(_fabric_model_parallel, "_load_checkpoint")
    and hasattr(_fabric_model_parallel, "_load_raw_module_state_from_path"),
    "lightning",
    "the Fabric strategy hooks and checkpoint loaders lightning_zeropp.fabric.ZeroPPStrategy builds on",
)

__all__ = [
    "METADATA_FILENAME",
    "SAVE_CHECKPOINT_BARRIER",
    "FabricModelParallelBase",
    "ForwardRedirection",
    "ModelParallelBase",
    "disable_inference_mode",
    "load_checkpoint",
    "load_raw_module_state",
    "requeue_handler",
]


class ForwardRedirection(_ForwardRedirection):
    """Lightning's forward redirection: a step method called through the wrapper module's ``forward``, with two hooks,
    ``on_after_inner_forward`` (the method returned, the wrapper's forward has not) and ``on_after_outer_forward``."""


class ModelParallelBase(ModelParallelStrategy):
    """``ModelParallelStrategy`` with the private parts lightning-zeropp builds on given public names.

    Subclasses implement :meth:`shard_model` (called by Lightning's ``Strategy.setup`` at the point where strategies
    wrap the model, after the precision plugin converted it) and call :meth:`setup_distributed`,
    :meth:`set_device_mesh` and :meth:`base_setup`.
    """

    def shard_model(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return self.shard_model(model)

    def setup_distributed(self) -> None:
        """Lightning's process-group setup of ``ModelParallelStrategy`` (ranks, backend, timeout), without its mesh."""
        self._setup_distributed()

    def set_device_mesh(self, mesh: Any) -> None:
        """The mesh ``device_mesh`` returns, also on the LightningModule (``configure_model`` may read it)."""
        self._device_mesh = mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = mesh

    def base_setup(self, trainer: pl.Trainer) -> None:
        """``Strategy.setup``: accelerator, precision conversion, :meth:`shard_model`, optimizers, precision plugin,
        optimizers to the device. ``ModelParallelStrategy.setup`` is skipped: it requires ``configure_model`` to
        parallelize the model itself, where this strategy shards any model."""
        Strategy.setup(self, trainer)


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Materializes parameters and buffers left on the meta device (``empty_init``) as sharded tensors on ``device``."""
    _materialize_distributed_module(module, device)


def disable_inference_mode(trainer: pl.Trainer) -> None:
    """Evaluation loops run under ``torch.no_grad`` instead of ``torch.inference_mode``.

    FSDP2's buffers must not be created under inference mode (pytorch#95957); Lightning falls back to no_grad only
    for gloo and for its own FSDPStrategy. The loops hold the choice in an attribute that is not part of the API.
    """
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        require(hasattr(loop, "inference_mode"), "lightning", "evaluation loops without inference_mode")
        loop.inference_mode = False


class FabricModelParallelBase(FabricModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` with the private parts lightning-zeropp builds on given public names."""

    def setup_distributed(self) -> None:
        """The device set up by the accelerator (Fabric's ``Strategy.setup_environment``), then the process-group
        setup of ``ModelParallelStrategy`` (ranks, backend, timeout), without its 2-D mesh: as the Trainer's
        ``ModelParallelStrategy`` does in its own ``_setup_distributed``."""
        FabricStrategy.setup_environment(self)
        self._setup_distributed()

    def set_device_mesh(self, mesh: Any) -> None:
        self._device_mesh = mesh


def load_checkpoint(path: Any, state: dict[str, Any], strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Lightning's loader of a checkpoint in the Trainer's layout (a sharded folder or one file) into ``state``
    (``{"state_dict": model, "optimizer_0": optimizer, ...}``); returns the rest of the checkpoint."""
    return _fabric_model_parallel._load_checkpoint(
        path=path, state=state, strict=strict, optimizer_states_from_list=True, weights_only=weights_only
    )


def load_raw_module_state(path: Any, module: nn.Module, world_size: int, strict: bool) -> None:
    """Lightning's loader of a plain state-dict file (``torch.save(model.state_dict())``) into a sharded module."""
    _fabric_model_parallel._load_raw_module_state_from_path(path, module=module, world_size=world_size, strict=strict)


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
