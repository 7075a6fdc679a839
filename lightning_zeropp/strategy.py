"""``ZeroPPStrategy``: ZeRO-3 sharding on FSDP2 with ZeRO++'s qwZ, hpZ and qgZ, as a Lightning strategy."""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from .checkpoint import index_keyed
from .compat.lightning import ForwardRedirection, ModelParallelBase, disable_inference_mode
from .compat.torch import ForwardHooks
from .config import ZeroPPConfig
from .core import SUPPORTED_PRECISIONS, FrontDoor, ZeroPPCore, register_names, reshard
from .preemption import Boundaries, Preemption

__all__ = ["SUPPORTED_PRECISIONS", "ZeroPPStrategy"]


class _StepRedirection(ForwardRedirection):
    """Runs a step method inside one call of the sharded root module, with FSDP2's root hooks firing once.

    ``fully_shard`` is applied in place to the LightningModule, so the step runs inside the root's ``forward``: FSDP2's
    pre-forward (lazy init, unshard) and post-forward (reshard, pre-backward hooks on the loss) wrap it. Around that
    outer call, the root runs only the forward hooks sharding registered (:class:`ForwardHooks`); the last of its
    pre-hooks (``ShardedModel.enter_step``) switches to the other hooks (the user's) before the step method runs, and
    ``on_after_inner_forward`` switches back before the post-hooks. So a step's ``self(x)`` runs the user's forward
    hooks with ``x``, as a plain call would, and not FSDP2's: a nested post-forward would reshard the root and defeat
    hpZ for its parameters.
    """

    def __init__(self, hooks: ForwardHooks) -> None:
        self.hooks = hooks

    @override
    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        self.hooks.switch_to_recorded()

    def run(self, module: pl.LightningModule, method_name: str, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.hooks.only_recorded():
            return self(module, module, method_name, *args, **kwargs)


class ZeroPPStrategy(FrontDoor, ModelParallelBase, config=ZeroPPConfig):
    """ZeRO++ on FSDP2: quantized weight all-gather (qwZ), an in-node weight partition (hpZ), quantized gradients.

    ZeRO-3 (FSDP2) with a quantized weight all-gather, a secondary weight partition per node, and a 2-hop quantized
    gradient reduce-scatter. ``ZeroPPStrategy(quantize_weights=False, hpz_partition_size=1,
    quantize_gradients=False)`` is plain ZeRO-3 (registered as ``"zero3"``); the defaults are ``"zeropp"``.

    The arguments are the fields of :class:`~lightning_zeropp.ZeroPPConfig` (this signature and the section below are
    generated from it); ``ZeroPPStrategy.from_config(config)`` takes them from one.
    """

    strategy_name = "zeropp"
    front_door = "Trainer"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config, _ = self.configure(args, kwargs)
        self._core = ZeroPPCore(config)
        super().__init__(
            save_distributed_checkpoint=config.state_dict_type == "sharded",
            process_group_backend=config.process_group_backend,
            timeout=config.timeout,
        )
        self._steps: _StepRedirection | None = None
        self._preemption = Preemption()
        self._boundaries = Boundaries(self._at_boundary, self._preemption)
        self._callbacks_list: list | None = None

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        self.start_processes()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._core.check_device(str(self.precision_plugin.precision), self.root_device)
        disable_inference_mode(trainer)
        self.base_setup(trainer)  # converts the precision, calls shard_model, then sets up the optimizers
        if self._boundaries not in trainer.callbacks:  # last: after ModelCheckpoint's saves of the same hook
            trainer.callbacks.append(self._boundaries)
        self._callbacks_list = trainer.callbacks

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's, then each optimizer hooked to the step's owner (:meth:`attach_optimizers`)."""
        super().setup_optimizers(trainer)
        self.attach_optimizers(self.optimizers)

    @override
    def shard_model(self, model: nn.Module) -> nn.Module:
        """Shards the model in place (dtype already converted: the shards hold the converted values)."""
        precision = str(self.precision_plugin.precision)
        model, sharded = self._core.shard(model, precision, self.root_device, "Trainer")
        self._steps = _StepRedirection(sharded.root_hooks)
        self.barrier()
        return model

    def _reshard(self) -> None:
        """Drops every unsharded and hpZ secondary copy of the weights (see :func:`lightning_zeropp.core.reshard`);
        after every evaluation step and checkpoint load."""
        reshard(self.model)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no gradient communication on non-final micro-batches (FSDP2 accumulates the
        unsharded gradients locally and reduces once, on the micro-batch that steps the optimizer)."""
        if not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ preemption (see lightning_zeropp.preemption)
    def _take_over_requeue_signal(self) -> None:
        """Under SLURM auto-requeue, once Lightning has installed its requeue handler: the signal is only counted,
        and Lightning's handler runs at the next step boundary on every rank."""
        env = self.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue:
            self._preemption.take_over(env.requeue_signal)

    def _at_boundary(self, trainer: pl.Trainer, saves: bool = True) -> None:
        self._preemption.boundary(
            trainer,
            lambda values: self._core.agree_max(values, self.root_device),
            self._core.broadcast_object,
            self.world_size,
            self.global_rank,
            saves,
        )

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._preemption.skips(name):  # the barrier of a save that waits for the step boundary
            return
        # The Trainer's first call once Lightning has installed its signal handlers ("run-stage"): from here on, no
        # requeue signal reaches Lightning's handler before a boundary.
        self._take_over_requeue_signal()
        super().barrier(name)

    @override
    def on_train_start(self) -> None:
        self._take_over_requeue_signal()

    @override
    def on_validation_start(self) -> None:
        self._take_over_requeue_signal()

    @override
    def on_test_start(self) -> None:
        self._take_over_requeue_signal()

    @override
    def on_predict_start(self) -> None:
        self._take_over_requeue_signal()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            step = self.lightning_module.trainer.global_step if self.lightning_module is not None else 0
            rank_zero_warn(self._preemption.sigterm_report(step))

    @override
    def teardown(self) -> None:
        self._preemption.release()
        if self._callbacks_list is not None and self._boundaries in self._callbacks_list:
            self._callbacks_list.remove(self._boundaries)
        self._callbacks_list = None
        super().teardown()

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Writes to a temporary name and renames it into place when complete, so an interrupted save never
        damages the checkpoint already at ``filepath``.

        Called while a step is in flight (from a signal handler, or a hook inside the step), the save is recorded
        and runs at the next step boundary on every rank: the ranks are at different points of their step, and the
        save would reshard weights the step is using. A SIGTERM during the save is held until it is over.
        """
        if storage_options is not None:
            raise TypeError(
                "ZeroPPStrategy.save_checkpoint(..., storage_options=...) is not supported: the strategy writes the"
                " checkpoint itself (a sharded folder or one file), not through a CheckpointIO plugin."
            )
        if self._preemption.busy:
            self._preemption.defer(str(filepath), weights_only="optimizer_states" not in checkpoint)
            return
        step = int(checkpoint.get("global_step", 0))
        with self._preemption.saving() as held:
            try:
                self._core.save(self, checkpoint, filepath, self.checkpoint_io.save_checkpoint)
            except Exception as err:
                if not held:
                    raise
                raise RuntimeError(
                    f"ZeroPPStrategy: SIGTERM arrived while saving {filepath} (SLURM sends it at the time limit, on"
                    f" scancel and after `scontrol requeue`), and the save failed: {err}"
                ) from err
        self._preemption.record_save(str(filepath), step)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state (sharded, or full on rank 0); empty while a step is in flight: reading it would reshard
        the weights under the running step (a save asked for then is collected again at the step boundary)."""
        if self._preemption.busy:
            return {}
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state as the checkpoint stores it: this rank's shards (sharded), or on rank 0 the whole
        state keyed by parameter index as an unsharded optimizer's ``state_dict()`` is (full; numbered in the order
        of the param groups, so that DDP or one device loads it, whatever the order of the groups). Empty while a
        step is in flight (see :meth:`lightning_module_state_dict`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if self._preemption.busy:
            return {}

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        full = self.state_dict_type == "full"
        options = StateDictOptions(full_state_dict=full, cpu_offload=True)
        state = get_optimizer_state_dict(self.model, optimizer, options=options)
        return index_keyed(state) if full and self.is_global_zero else state

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads a checkpoint of either front door (sharded or full), Lightning's consolidation of a sharded one, or
        a full checkpoint of another strategy (DDP, single device), into the sharded model and optimizers."""
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        return self._core.load(self, checkpoint_path, self.model, self.optimizers, strict, weights_only)

    # ------------------------------------------------------------------ steps
    # ``fully_shard`` is applied in place to the LightningModule, so ``self.model is self.lightning_module`` and
    # Lightning would call ``training_step`` directly, skipping FSDP2's root forward hooks (lazy init, unsharding
    # the root's own parameters). Always route the steps through ``forward`` (see ``_StepRedirection``).
    def _step(self, method_name: str, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        assert self._steps is not None and self.lightning_module is not None
        with self._preemption.in_flight():
            return self._steps.run(self.lightning_module, method_name, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # outside an optimizer step on the micro-batches of an accumulation; tensor-parallel bytes: see training_step
        with self._preemption.in_flight(), self._core.counting_tensor_parallel():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        # the model's tensor-parallel collectives are counted in the training step and its backward alone, while the
        # switch is on (count_tensor_parallel_bytes): validation's are not the step's
        with self.precision_plugin.train_step_context(), self._core.counting_tensor_parallel():
            return self._step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context(), args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context(), args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context(), args, kwargs)

    def _evaluation_step(self, method_name: str, context: Any, args: tuple, kwargs: dict) -> STEP_OUTPUT:
        """A step without backward, then every unit resharded (see :meth:`_reshard`)."""
        with context:
            out = self._step(method_name, *args, **kwargs)
        self._reshard()
        return out

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)
