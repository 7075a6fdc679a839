"""``ZeroPPStrategy``: ZeRO-3 sharding on FSDP2 with ZeRO++'s qwZ, hpZ and qgZ, as a Lightning strategy."""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from . import checkpoint as ckpt
from . import fsdp_hooks, hpz
from . import kernels as tk
from .comm import ZeroPPComms
from .compat.lightning import (
    ForwardRedirection,
    ModelParallelBase,
    disable_inference_mode,
    materialize_distributed_module,
)
from .compat.torch import ForwardHooks
from .config import (
    BlockSize,
    Decay,
    KernelBackend,
    ModuleSelection,
    NonNegativeInt,
    PositiveInt,
    PositiveIntOrAuto,
    StateDictType,
    ZeroPPConfig,
    check_strategy_arguments,
)
from .ledger import CommLedger
from .sharding import apply_zeropp, refuse_fsdp1
from .topology import ProcessGroups, Topology, check_launch

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
_SHARDED_MARK = "_zeropp_sharding_layout"


class _StepRedirection(ForwardRedirection):
    """Runs a step method inside one call of the sharded root module, with FSDP2's root hooks firing once.

    ``fully_shard`` is applied in place to the LightningModule, so the step runs inside the root's ``forward``: FSDP2's
    pre-forward (lazy init, unshard) and post-forward (reshard, pre-backward hooks on the loss) wrap it. Around that
    outer call, the root runs only the forward hooks ``fully_shard`` registered (:class:`ForwardHooks`); the last of
    its pre-hooks switches to the other hooks (the user's) before the step method runs, and ``on_after_inner_forward``
    switches back before the post-hooks. So a step's ``self(x)`` runs the user's forward hooks with ``x``, as a plain
    call would, and not FSDP2's: a nested post-forward would reshard the root and defeat hpZ for its parameters.
    """

    def __init__(self, hooks: ForwardHooks) -> None:
        self.hooks = hooks

    @override
    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        self.hooks.switch_to_recorded()

    def run(self, module: pl.LightningModule, method_name: str, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.hooks.only_recorded():
            return self(module, module, method_name, *args, **kwargs)


def _enter_step(hooks: ForwardHooks):
    """The root's last pre-hook: inside a redirected step, from here on only the user's hooks run."""

    def hook(module: nn.Module, args: Any) -> None:
        if hooks.selecting:
            hooks.switch_to_others()

    return hook


class ZeroPPStrategy(ModelParallelBase):
    """ZeRO++: ZeRO-3 (FSDP2) with quantized weight all-gather, a secondary weight partition per node, and a
    2-hop quantized gradient reduce-scatter. ``ZeroPPStrategy(quantize_weights=False, hpz_partition_size=1,
    quantize_gradients=False)`` is plain ZeRO-3 (registered as ``"zero3"``); the defaults are ``"zeropp"``.

    Arguments:
        quantize_weights: qwZ. All-gather weights in the forward pass as block-quantized integers.
        weight_bits: 8 or 4 bits per weight on the wire.
        hpz_partition_size: hpZ. After forward each rank keeps 1/R of the dequantized weights so the backward
            all-gather runs among R consecutive ranks. ``"auto"``: ranks per node (never leaves the node);
            ``1``: off. Must divide the world size.
        quantize_gradients: qgZ. Reduce gradients by an intra-node then an inter-node all-to-all of quantized
            blocks, summed in fp32. On one node the exact reduce-scatter is used (nothing crosses nodes).
        gradient_bits: 4 or 8 bits per gradient on the inter-node hop.
        intra_node_gradient_bits: 4 or 8 bits per gradient on the intra-node hop.
        weight_block_size: weight elements per fp32 scale.
        gradient_block_size: gradient elements per fp32 scale.
        gradient_rounding: ``"nearest"`` (round half to even) or ``"stochastic"`` (unbiased) for gradients.
        block_alignment: ``"parameter"``: no quantization block (weights or gradients) holds elements of two
            parameters, so a small parameter never shares a scale with a large neighbour; ``"flat"``: fixed blocks
            over each unit's flat buffer (the reference implementation's layout; an ablation).
        gradient_error_feedback: qgZ error feedback: each rank keeps what the INT4 inter-node hop's quantization
            lost (fp32, 4 bytes per element of the M/N elements it sends) and adds it, times
            ``error_feedback_decay``, to the next reduction's values. Saved in checkpoints.
        error_feedback_decay: the residual's carry-over factor, in (0, 1].
        error_feedback_reset: zero the residuals every this many optimizer steps (0: never).
        pipeline_stages: qgZ pieces per chunk; piece s+1 crosses the node's links while piece s crosses nodes.
        ranks_per_node: ranks per node; ``"auto"`` is the launcher's local world size. A smaller value makes one
            machine act as several nodes (tests, demos). Must divide the local world size.
        auto_wrap_policy: module classes (or class names, as in YAML) that each become one FSDP unit. Default: every
            module held in an ``nn.ModuleList`` (transformer blocks). The root is always sharded last.
        activation_checkpointing_policy: module classes (or names) whose activations are recomputed in backward.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        state_dict_type: ``"sharded"``: a checkpoint folder written by every rank; ``"full"``: one file.
        kernel_backend: ``"auto"`` (Triton on CUDA, pure torch elsewhere), ``"triton"`` or ``"torch"``.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; default: chosen for the device.
        timeout: how long any collective waits for a peer: Lightning's default group and every group of the
            strategy's own (world, node, rail, hpZ) get it, so a frozen rank ends the job on the others after it.
        wrap_modules: deprecated spelling of ``auto_wrap_policy``.
        activation_checkpointing: deprecated spelling of ``activation_checkpointing_policy``.
    """

    strategy_name = "zeropp"

    def __init__(
        self,
        quantize_weights: bool = True,
        weight_bits: Literal[8, 4] = 8,
        hpz_partition_size: PositiveIntOrAuto = "auto",
        quantize_gradients: bool = True,
        gradient_bits: Literal[4, 8] = 4,
        intra_node_gradient_bits: Literal[4, 8] = 8,
        weight_block_size: BlockSize = 256,
        gradient_block_size: BlockSize = 128,
        gradient_rounding: Literal["nearest", "stochastic"] = "nearest",
        block_alignment: Literal["parameter", "flat"] = "parameter",
        gradient_error_feedback: bool = False,
        error_feedback_decay: Decay = 0.8,
        error_feedback_reset: NonNegativeInt = 1024,
        pipeline_stages: PositiveInt = 2,
        ranks_per_node: PositiveIntOrAuto = "auto",
        auto_wrap_policy: ModuleSelection = None,
        activation_checkpointing_policy: ModuleSelection = None,
        cpu_offload: bool = False,
        state_dict_type: StateDictType = "sharded",
        kernel_backend: KernelBackend = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        wrap_modules: ModuleSelection = None,
        activation_checkpointing: ModuleSelection = None,
    ) -> None:
        self.zeropp_config = ZeroPPConfig(
            quantize_weights=quantize_weights,
            weight_bits=weight_bits,
            hpz_partition_size=hpz_partition_size,
            quantize_gradients=quantize_gradients,
            gradient_bits=gradient_bits,
            intra_node_gradient_bits=intra_node_gradient_bits,
            weight_block_size=weight_block_size,
            gradient_block_size=gradient_block_size,
            gradient_rounding=gradient_rounding,
            block_alignment=block_alignment,
            gradient_error_feedback=gradient_error_feedback,
            error_feedback_decay=error_feedback_decay,
            error_feedback_reset=error_feedback_reset,
            pipeline_stages=pipeline_stages,
            ranks_per_node=ranks_per_node,
            kernel_backend=kernel_backend,
        )
        auto_wrap_policy = _renamed("wrap_modules", wrap_modules, "auto_wrap_policy", auto_wrap_policy)
        activation_checkpointing_policy = _renamed(
            "activation_checkpointing", activation_checkpointing, "activation_checkpointing_policy",
            activation_checkpointing_policy,
        )  # fmt: skip
        check_strategy_arguments(
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing_policy=activation_checkpointing_policy,
            cpu_offload=cpu_offload,
            state_dict_type=state_dict_type,
            process_group_backend=process_group_backend,
        )
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._auto_wrap_policy = auto_wrap_policy
        self._activation_checkpointing_policy = activation_checkpointing_policy
        self._cpu_offload = cpu_offload
        self._state_dict_type = state_dict_type
        self._collective_timeout = timeout
        self._topology: Topology | None = None
        self._ledger: CommLedger | None = None
        self._comms: ZeroPPComms | None = None
        self._steps: _StepRedirection | None = None

    # ------------------------------------------------------------------ properties
    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("ZeroPPStrategy.topology is known once the processes have started (Trainer.fit).")
        return self._topology

    @property
    def comm_ledger(self) -> CommLedger:
        """Bytes this rank sent, by collective kind, split into same-node and other-node peers."""
        if self._ledger is None:
            raise RuntimeError("ZeroPPStrategy.comm_ledger exists once the processes have started (Trainer.fit).")
        return self._ledger

    @property
    def state_dict_type(self) -> StateDictType:
        return self._state_dict_type

    @property
    def auto_wrap_policy(self) -> ModuleSelection:
        """The module classes (or names) that become FSDP units; None: the elements of the outermost ModuleLists."""
        return self._auto_wrap_policy

    @property
    def activation_checkpointing_policy(self) -> ModuleSelection:
        return self._activation_checkpointing_policy

    @property
    def cpu_offload(self) -> bool:
        return self._cpu_offload

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        assert self.cluster_environment is not None
        env = self.cluster_environment
        said = {k: v for k, v in os.environ.items() if isinstance(env, SLURMEnvironment) or not k.startswith("SLURM_")}
        check_launch(self.num_nodes, self.num_processes, env.local_rank(), env.node_rank(), said)
        self.setup_distributed()
        ranks_per_node, hpz_size = self.zeropp_config.resolve(self.world_size, self.num_processes)
        topology = Topology(self.world_size, ranks_per_node, self.global_rank, hpz_size)
        if topology != self._topology:  # fit, then validate with the same Trainer: keep mesh, ledger and state
            if topology.hpz_crosses_nodes:
                rank_zero_warn(
                    f"ZeroPPStrategy: hpz_partition_size={hpz_size} does not divide ranks_per_node={ranks_per_node},"
                    " so some hpZ groups span two nodes and their backward all-gather crosses nodes. Use a divisor of"
                    f" {ranks_per_node} to keep it inside a node."
                )
            self._mesh = init_device_mesh(self.root_device.type, (self.world_size,), mesh_dim_names=("data_parallel",))
            self._topology = topology
            if self._comms is not None:
                self._comms.release_groups()
            self._ledger = CommLedger(topology)
            groups = ProcessGroups.build(topology, self._collective_timeout)
            self._comms = ZeroPPComms(self.zeropp_config, groups, self._ledger)
        assert self._comms is not None
        self._comms.groups  # noqa: B018  (rebuilt here if the last run's teardown released them)
        self.set_device_mesh(self._mesh)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        precision = str(self.precision_plugin.precision)
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"ZeroPPStrategy does not support `precision={precision!r}`; use one of {SUPPORTED_PRECISIONS}."
            )
        tk.check_backend(self.zeropp_config.kernel_backend, self.root_device)
        disable_inference_mode(trainer)
        self.base_setup(trainer)  # converts the precision, calls shard_model, then sets up the optimizers

    @override
    def teardown(self) -> None:
        """Lightning's teardown, then the strategy's own process groups are destroyed (the next run, or a call of the
        sharded model after ``fit`` returned, builds them again): repeated runs in one process keep one set."""
        super().teardown()
        if self._comms is not None:
            self._comms.release_groups()

    @override
    def shard_model(self, model: nn.Module) -> nn.Module:
        """Shards the model in place (dtype already converted: the shards hold the converted values)."""
        assert self._comms is not None and self._topology is not None
        refuse_fsdp1(model)
        layout = self._sharding_layout(str(self.precision_plugin.precision))
        if getattr(model, _SHARDED_MARK, None) is not None:
            hooks = self._adopt_sharded_model(model, layout)
        else:

            def shard_and_enter() -> None:
                apply_zeropp(
                    model,
                    mesh=self.device_mesh,
                    comms=self._comms,
                    reshard_after_forward=layout["reshard_after_forward"],
                    precision=layout["precision"],
                    auto_wrap_policy=self._auto_wrap_policy,
                    activation_checkpointing_policy=self._activation_checkpointing_policy,
                    cpu_offload=self._cpu_offload,
                )
                model.register_forward_pre_hook(_enter_step(hooks))  # after FSDP2's root pre-hook

            hooks = ForwardHooks(model)
            hooks.record(shard_and_enter)
            setattr(model, _SHARDED_MARK, (layout, hooks, self._comms))
            materialize_distributed_module(model, self.root_device)
        self._steps = _StepRedirection(hooks)
        self.barrier()
        return model

    def _sharding_layout(self, precision: str) -> dict[str, Any]:
        """What the sharding of a model depends on; a model sharded differently cannot be adopted."""
        assert self._topology is not None
        return {
            "world_size": self._topology.world_size,
            "reshard_after_forward": hpz.reshard_after_forward(
                self._topology.hpz_partition_size, self._topology.world_size
            ),
            "precision": precision,
            "cpu_offload": self._cpu_offload,
        }

    def _adopt_sharded_model(self, model: nn.Module, layout: dict[str, Any]) -> ForwardHooks:
        """A model sharded by an earlier ZeroPPStrategy (an earlier Trainer): route its collectives through ours."""
        assert self._comms is not None
        sharded_as, hooks, earlier = getattr(model, _SHARDED_MARK)
        differences = [f"{k}: {sharded_as[k]!r} then, {v!r} now" for k, v in layout.items() if sharded_as[k] != v]
        if differences:
            raise ValueError(
                "ZeroPPStrategy: this model was sharded by an earlier Trainer with other settings ("
                + "; ".join(differences)
                + "). Build a fresh model and load a checkpoint instead: sharded checkpoints load on any world size"
                " and settings."
            )
        if earlier is not self._comms:  # the earlier strategy's groups (rebuilt if the model was called after its run)
            earlier.release_groups()
        fsdp_hooks.install(model, self._comms)
        setattr(model, _SHARDED_MARK, (layout, hooks, self._comms))
        self._reshard()
        return hooks

    def _reshard(self) -> None:
        """Drops every unsharded and hpZ secondary copy of the weights; the next forward gathers the primary shards.

        Called after every evaluation step and checkpoint load. A forward without backward (validation, test,
        predict) leaves each unit holding its hpZ slice as the module's parameters: callbacks would then see other
        parameter objects than before the loop, and anything that changed the weights meanwhile (a checkpoint load,
        a callback swapping EMA weights in for validation and back) would be silently undone by the next forward,
        which gathers from those slices.
        """
        if self.model is None:
            return
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

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

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Steps the optimizer and counts the step (error feedback residuals reset every
        ``error_feedback_reset`` optimizer steps)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._comms is not None:
            self._comms.optimizer_stepped()
        return output

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Writes to a temporary name and renames it into place when complete, so an interrupted save never
        damages the checkpoint already at ``filepath``."""
        if storage_options is not None:
            raise TypeError(
                "ZeroPPStrategy.save_checkpoint(..., storage_options=...) is not supported: the strategy writes the"
                " checkpoint itself (a sharded folder or one file), not through a CheckpointIO plugin."
            )
        comms_state = self._comms.state_dict() if self._comms is not None else None
        ckpt.save(self, checkpoint, filepath, self._state_dict_type, self.checkpoint_io.save_checkpoint, comms_state)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        read = super().load_checkpoint

        def restore(states: Any, path: Path) -> None:
            if self._comms is not None:
                ckpt.restore_comms(self._comms, states, path, path.is_dir(), self.world_size, self.global_rank)

        optimizers = [
            (type(o).__name__, keys)
            for o, keys in zip(self.optimizers, ckpt.optimizer_keys(self.model, self.optimizers))
        ]
        loaded = ckpt.load(
            self, checkpoint_path, shapes, self.lightning_module.strict_loading, lambda p: read(p, weights_only),
            restore, optimizers,
        )  # fmt: skip
        self._reshard()
        return loaded

    # ------------------------------------------------------------------ steps
    # ``fully_shard`` is applied in place to the LightningModule, so ``self.model is self.lightning_module`` and
    # Lightning would call ``training_step`` directly, skipping FSDP2's root forward hooks (lazy init, unsharding
    # the root's own parameters). Always route the steps through ``forward`` (see ``_StepRedirection``).
    def _step(self, method_name: str, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        assert self._steps is not None and self.lightning_module is not None
        return self._steps.run(self.lightning_module, method_name, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context():
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
        strategy_registry.register(
            "zeropp",
            cls,
            description="ZeRO++: ZeRO-3 on FSDP2 with quantized weights (qwZ), hpZ and quantized gradients (qgZ)",
            override=True,
        )
        strategy_registry.register(
            "zero3",
            cls,
            description="ZeRO-3 on FSDP2 (ZeroPPStrategy with qwZ, hpZ and qgZ off): the ZeRO++ baseline",
            override=True,
            quantize_weights=False,
            hpz_partition_size=1,
            quantize_gradients=False,
        )


def _renamed(old: str, old_value: ModuleSelection, new: str, new_value: ModuleSelection) -> ModuleSelection:
    """The value of an argument that was renamed to Lightning's spelling; the old name still works, with a warning."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ValueError(f"ZeroPPStrategy: `{old}` is the deprecated spelling of `{new}`; pass only `{new}`.")
    rank_zero_deprecation(f"ZeroPPStrategy: `{old}` is deprecated and will be removed; use `{new}` (Lightning's name).")
    return old_value
