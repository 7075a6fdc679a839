"""``ZeroPPStrategy``: ZeRO-3 sharding on FSDP2 with ZeRO++'s qwZ, hpZ and qgZ, as a Lightning strategy."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from . import checkpoint as ckpt
from . import fsdp_hooks, hpz
from . import kernels as tk
from .comm import ZeroPPComms
from .config import (
    KernelBackend,
    ModuleSelection,
    StateDictType,
    ZeroPPConfig,
    check_strategy_arguments,
)
from .ledger import CommLedger
from .sharding import apply_zeropp
from .topology import ProcessGroups, Topology

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
_SHARDED_MARK = "_zeropp_sharding_layout"


class _RootStepRedirection(_ForwardRedirection):
    """Runs a step method inside one call of the sharded root module, with FSDP2's root hooks firing once.

    The step runs inside the root's ``forward`` so FSDP2's pre-forward (lazy init, unshard) and post-forward
    (reshard, pre-backward hooks on the loss) wrap it. A step that calls ``self(x)`` calls the root again; if its
    hooks fired on that nested call, the nested post-forward would reshard the root and leave it idle, and the outer
    post-forward would then reshard it fully, defeating hpZ for the root's parameters. So the root's own forward
    hooks are set aside while the step runs.
    """

    def __call__(
        self, wrapper_module: nn.Module, original_module: pl.LightningModule, method_name: str, *args, **kwargs
    ) -> STEP_OUTPUT:
        original_forward = original_module.forward

        def step_as_forward(*_args: Any, **_kwargs: Any) -> Any:
            original_module.forward = original_forward  # type: ignore[method-assign]
            hooks = (original_module._forward_pre_hooks, original_module._forward_hooks)
            original_module._forward_pre_hooks, original_module._forward_hooks = OrderedDict(), OrderedDict()
            try:
                return getattr(original_module, method_name)(*_args, **_kwargs)
            finally:
                original_module._forward_pre_hooks, original_module._forward_hooks = hooks

        original_module.forward = step_as_forward  # type: ignore[method-assign]
        try:
            return wrapper_module(*args, **kwargs)
        finally:
            original_module.forward = original_forward  # type: ignore[method-assign]


class ZeroPPStrategy(ModelParallelStrategy):
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
        pipeline_stages: qgZ pieces per chunk; piece s+1 crosses the node's links while piece s crosses nodes.
        ranks_per_node: ranks per node; ``"auto"`` is the launcher's local world size. A smaller value makes one
            machine act as several nodes (tests, demos). Must divide the local world size.
        wrap_modules: module classes (or class names, as in YAML) that each become one FSDP unit. Default: every
            module held in an ``nn.ModuleList`` (transformer blocks). The root is always sharded last.
        activation_checkpointing: module classes (or names) whose activations are recomputed in backward.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        state_dict_type: ``"sharded"``: a checkpoint folder written by every rank; ``"full"``: one file.
        kernel_backend: ``"auto"`` (Triton on CUDA, pure torch elsewhere), ``"triton"`` or ``"torch"``.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; default: chosen for the device.
        timeout: timeout of collectives.
    """

    strategy_name = "zeropp"

    def __init__(
        self,
        quantize_weights: bool = True,
        weight_bits: Literal[8, 4] = 8,
        hpz_partition_size: int | Literal["auto"] = "auto",
        quantize_gradients: bool = True,
        gradient_bits: Literal[4, 8] = 4,
        intra_node_gradient_bits: Literal[4, 8] = 8,
        weight_block_size: int = 256,
        gradient_block_size: int = 128,
        gradient_rounding: Literal["nearest", "stochastic"] = "nearest",
        pipeline_stages: int = 2,
        ranks_per_node: int | Literal["auto"] = "auto",
        wrap_modules: ModuleSelection = None,
        activation_checkpointing: ModuleSelection = None,
        cpu_offload: bool = False,
        state_dict_type: StateDictType = "sharded",
        kernel_backend: KernelBackend = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
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
            pipeline_stages=pipeline_stages,
            ranks_per_node=ranks_per_node,
            kernel_backend=kernel_backend,
        )
        check_strategy_arguments(
            wrap_modules=wrap_modules,
            activation_checkpointing=activation_checkpointing,
            cpu_offload=cpu_offload,
            state_dict_type=state_dict_type,
            process_group_backend=process_group_backend,
        )
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._wrap_modules = wrap_modules
        self._activation_checkpointing = activation_checkpointing
        self._cpu_offload = cpu_offload
        self._state_dict_type = state_dict_type
        self._topology: Topology | None = None
        self._groups: ProcessGroups | None = None
        self._ledger: CommLedger | None = None
        self._comms: ZeroPPComms | None = None
        self._forward_redirection = _RootStepRedirection()

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

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        ranks_per_node, hpz_size = self.zeropp_config.resolve(self.world_size, self.num_processes)
        topology = Topology(self.world_size, ranks_per_node, self.global_rank, hpz_size)
        if topology != self._topology:  # fit, then validate with the same Trainer: keep mesh, groups and ledger
            if topology.hpz_crosses_nodes:
                rank_zero_warn(
                    f"ZeroPPStrategy: hpz_partition_size={hpz_size} does not divide ranks_per_node={ranks_per_node},"
                    " so some hpZ groups span two nodes and their backward all-gather crosses nodes. Use a divisor of"
                    f" {ranks_per_node} to keep it inside a node."
                )
            self._device_mesh = init_device_mesh(
                self.root_device.type, (self.world_size,), mesh_dim_names=("data_parallel",)
            )
            self._topology = topology
            self._groups = ProcessGroups.build(topology)
            self._ledger = CommLedger(topology)
            self._comms = ZeroPPComms(self.zeropp_config, self._groups, self._ledger)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        precision = str(self.precision_plugin.precision)
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"ZeroPPStrategy does not support `precision={precision!r}`; use one of {SUPPORTED_PRECISIONS}."
            )
        self._check_kernel_backend()
        # FSDP2's buffers must not be created under inference_mode (pytorch#95957); Lightning only falls back to
        # no_grad for gloo and for its own FSDPStrategy.
        for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop,
                     trainer.predict_loop):  # fmt: skip
            loop.inference_mode = False
        assert self._comms is not None and self._topology is not None
        layout = self._sharding_layout(precision)
        if getattr(self.model, _SHARDED_MARK, None) is not None:
            self._adopt_sharded_model(layout)
        else:
            # Dtype conversion (bf16-true, 16-true) before sharding: the shards then hold the converted values.
            self.model = self.precision_plugin.convert_module(self.model)
            apply_zeropp(
                self.model,
                mesh=self.device_mesh,
                comms=self._comms,
                reshard_after_forward=layout["reshard_after_forward"],
                precision=precision,
                wrap_modules=self._wrap_modules,
                activation_checkpointing=self._activation_checkpointing,
                cpu_offload=self._cpu_offload,
            )
            setattr(self.model, _SHARDED_MARK, layout)
            _materialize_distributed_module(self.model, self.root_device)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_kernel_backend(self) -> None:
        if self.zeropp_config.kernel_backend != "triton":
            return
        if self.root_device.type != "cuda" and not tk._interpreting():
            raise ValueError(
                f'ZeroPPStrategy: `kernel_backend="triton"` needs CUDA devices, but this job runs on'
                f' {self.root_device.type} (on the CPU, Triton runs only under TRITON_INTERPRET=1). Use "auto".'
            )
        tk._triton_ops()  # raises with the reason when triton cannot be imported

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

    def _adopt_sharded_model(self, layout: dict[str, Any]) -> None:
        """A model sharded by an earlier ZeroPPStrategy (an earlier Trainer): route its collectives through ours."""
        assert self.model is not None and self._comms is not None
        sharded_as = getattr(self.model, _SHARDED_MARK)
        differences = [f"{k}: {sharded_as[k]!r} then, {v!r} now" for k, v in layout.items() if sharded_as[k] != v]
        if differences:
            raise ValueError(
                "ZeroPPStrategy: this model was sharded by an earlier Trainer with other settings ("
                + "; ".join(differences)
                + "). Build a fresh model and load a checkpoint instead: sharded checkpoints load on any world size"
                " and settings."
            )
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                fsdp_hooks.install(module, self._comms)
        self._reshard()

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

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Writes to a temporary name and renames it into place when complete, so an interrupted save never
        damages the checkpoint already at ``filepath``."""
        if storage_options is not None:
            raise TypeError(
                "ZeroPPStrategy.save_checkpoint(..., storage_options=...) is not supported: the strategy writes the"
                " checkpoint itself (a sharded folder or one file), not through a CheckpointIO plugin."
            )
        path = Path(self.broadcast(filepath))
        checkpoint[ckpt.RNG_KEY] = self._gather_rng_states()  # every rank's, so a resume continues each stream
        if self._state_dict_type == "full":
            self._on_rank_zero_or_raise(
                path, lambda: ckpt.save_full(checkpoint, path, self.checkpoint_io.save_checkpoint)
            )
            return
        from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save
        from torch.distributed.checkpoint.api import CheckpointException

        tmp = Path(self.broadcast(str(ckpt.temporary_name(path)) if self.is_global_zero else None))
        converted = {ckpt.MODEL_KEY: checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        try:
            _distributed_checkpoint_save(converted, tmp)  # every rank writes its shards; fails on all if one does
        except CheckpointException as err:  # a BaseException: it would slip past `except Exception` in user code
            if self.is_global_zero:
                ckpt.remove(tmp)
            failures = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(err.failures.items()))
            raise RuntimeError(
                f"ZeroPPStrategy: saving the checkpoint {path} failed ({failures}). The checkpoint previously at that"
                " path, if any, is untouched."
            ) from err

        def finish() -> None:
            try:
                torch.save(checkpoint, tmp / _METADATA_FILENAME)  # last: a folder without it is incomplete
                ckpt.replace_atomically(tmp, path)
            except BaseException:
                ckpt.remove(tmp)
                raise

        self._on_rank_zero_or_raise(path, finish)

    def _on_rank_zero_or_raise(self, path: Path, write: Any) -> None:
        """Runs ``write`` on rank 0 and makes every rank raise if it failed (no rank is left waiting)."""
        error: BaseException | None = None
        if self.is_global_zero:
            try:
                write()
            except Exception as err:
                error = err
        message = self.broadcast(None if error is None else f"{type(error).__name__}: {error}")
        if message is not None:
            raise RuntimeError(
                f"ZeroPPStrategy: saving the checkpoint {path} failed on rank 0 ({message}). The checkpoint previously"
                " at that path, if any, is untouched."
            ) from error

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        # Every rank reads the files itself (they may not share a filesystem): agree before any collective load.
        problem: BaseException | None = None
        try:
            if not path.exists():
                raise FileNotFoundError(f"ZeroPPStrategy: checkpoint {path} does not exist.")
            ckpt.check_compatible(path, shapes, strict)
        except (FileNotFoundError, ckpt.CheckpointMismatchError) as err:
            problem = err
        self._raise_if_any_rank_failed(problem)
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            loaded = super().load_checkpoint(path, weights_only=weights_only)
        except ckpt.CheckpointMismatchError:
            raise
        except (Exception, CheckpointException) as err:  # a truncated shard, an unreadable file: name them
            raise ckpt.CheckpointMismatchError(f"ZeroPPStrategy: loading the checkpoint {path} failed: {err}") from err
        self._restore_rng_state(loaded.pop(ckpt.RNG_KEY, None))
        self._reshard()
        return loaded

    def _raise_if_any_rank_failed(self, problem: BaseException | None) -> None:
        """Raises on every rank if any rank hit a problem (its own error, or the first failing rank's), else returns."""
        import torch.distributed as dist

        message = None if problem is None else (type(problem).__name__, str(problem))
        messages = [message]
        if self.world_size > 1:
            messages = [None] * self.world_size
            dist.all_gather_object(messages, message)
        failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
        if not failed:
            return
        if problem is not None:
            raise problem
        rank, (kind, text) = failed[0]
        error = FileNotFoundError if kind == "FileNotFoundError" else ckpt.CheckpointMismatchError
        raise error(f"{text} (seen on rank {rank})")

    def _gather_rng_states(self) -> list[dict[str, Any]]:
        import torch.distributed as dist

        states: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(states, ckpt.rng_state())
        else:
            states[0] = ckpt.rng_state()
        return states

    def _restore_rng_state(self, states: list[dict[str, Any]] | None) -> None:
        if not states:
            return
        if len(states) != self.world_size:
            rank_zero_warn(
                f"ZeroPPStrategy: the checkpoint was written by {len(states)} ranks and is loaded by {self.world_size};"
                " the weights, optimizer and loops resume exactly, the random number streams (dropout) start afresh."
            )
            return
        ckpt.set_rng_state(states[self.global_rank])

    @override
    def model_to_device(self) -> None:
        if self._cpu_offload:
            return  # FSDP's CPUOffloadPolicy owns placement: shards on the host, unsharded weights on the device
        super().model_to_device()

    # ------------------------------------------------------------------ steps
    # ``fully_shard`` is applied in place to the LightningModule, so ``self.model is self.lightning_module`` and
    # Lightning would call ``training_step`` directly, skipping FSDP2's root forward hooks (lazy init, unsharding
    # the root's own parameters). Always route the steps through ``forward`` (see ``_RootStepRedirection``).
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            out = self._forward_redirection(self.model, self.lightning_module, "validation_step", *args, **kwargs)
        self._reshard()
        return out

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            out = self._forward_redirection(self.model, self.lightning_module, "test_step", *args, **kwargs)
        self._reshard()
        return out

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.predict_step_context():
            out = self._forward_redirection(self.model, self.lightning_module, "predict_step", *args, **kwargs)
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
