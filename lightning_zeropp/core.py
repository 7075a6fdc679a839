"""What the two front doors share: the Trainer's :class:`lightning_zeropp.ZeroPPStrategy` and Fabric's
:class:`lightning_zeropp.fabric.ZeroPPStrategy` each hold one :class:`ZeroPPCore` and add only what their loop needs.

The core owns the validated arguments, the topology, the process groups, the ledger and the collectives
(:class:`~lightning_zeropp.comm.ZeroPPComms`), shards a model (:meth:`ZeroPPCore.shard`), and saves and loads
checkpoints in the one layout both front doors read and write (:meth:`ZeroPPCore.save`, :meth:`ZeroPPCore.load`):
a checkpoint written through one loads through the other, and consolidates the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from . import arguments, fsdp_hooks
from . import checkpoint as ckpt
from . import kernels as tk
from .comm import ZeroPPComms
from .commplan import CommPlan, check_kernels, job_topology, resolve
from .compat.torch import ForwardHooks
from .config import CpuOffload, ModuleSelection, StateDictType, ZeroPPConfig, offloads
from .ledger import CommLedger
from .materialize import materialize_meta_tensors
from .optimizers import check_runs_sharded
from .preemption import Preemption
from .sharding import apply_zeropp, check_tensor_parallel, refuse_fsdp1
from .tensor_parallel_comms import TensorParallelCounter
from .topology import ProcessGroups, Topology, check_launch, own_group

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
_SHARDED = "_zeropp_sharded"  # the one attribute sharding sets on the user's model: its ShardedModel


@dataclasses.dataclass(frozen=True)
class Sharding:
    """What the sharding of a model depends on; a model sharded otherwise cannot be adopted by a strategy.
    ``mesh_shape``: FSDP's mesh (all ranks; HSDP nodes x ranks per node; quantized HSDP the node's ranks; with
    tensor parallelism the data-parallel ranks)."""

    front_door: str
    world_size: int
    reshard_after_forward: bool | int
    precision: str
    cpu_offload: bool
    sharding_strategy: str = "FULL_SHARD"
    mesh_shape: tuple[int, ...] = ()
    tensor_parallel_size: int = 1

    def differences(self, now: Sharding) -> list[str]:
        return [
            f"{f.name}: {getattr(self, f.name)!r} then, {getattr(now, f.name)!r} now"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(now, f.name)
        ]


@dataclasses.dataclass(eq=False)
class ShardedModel:
    """What sharding made of one model, owned by the core that sharded (or adopted) it; the model holds it as one
    attribute so that a later strategy can adopt the model (a second ``Trainer``, Fabric's setup of a model sharded
    before).

    ``root_hooks``: the forward hooks sharding added to the root module (FSDP2's root hooks and the two below), which
    the Trainer's step redirection runs around a step; ``comms``: the collectives every unit calls.
    """

    sharding: Sharding
    comms: ZeroPPComms
    root_hooks: ForwardHooks

    def begin_forward(self, module: nn.Module, args: Any) -> None:
        """The root's first forward pre-hook: the collectives prepare the forward pass (with weight deltas, every
        rank agrees which node copies to update; hpZ's kept pieces are renewed), before FSDP2's root pre-hook gathers
        the root's weights."""
        if self.comms.deltas is not None or self.comms.secondary is not None:
            self.comms.begin_forward(next((p.device for p in module.parameters()), torch.device("cpu")))

    def enter_step(self, module: nn.Module, args: Any) -> None:
        """The root's last forward pre-hook: inside a step that runs only ``root_hooks`` around it (the Trainer's
        redirection), the module's other hooks (the user's) run from here on."""
        if self.root_hooks.selecting:
            self.root_hooks.switch_to_others()


class ZeroPPCore:
    """One strategy's ZeRO++ state, whichever front door holds it.

    Built from the strategy's validated arguments (a :class:`ZeroPPConfig`: both front doors refuse the same values
    with the same messages). Then, once the processes exist: :meth:`check_launch` and :meth:`connect` (topology,
    process groups, ledger, collectives, mesh); :meth:`shard` a model; :meth:`save` / :meth:`load` checkpoints;
    :meth:`release` the groups at teardown.
    """

    def __init__(self, config: ZeroPPConfig) -> None:
        self.config = config
        self.mesh: DeviceMesh | None = None  # what the model's code sees (`device_mesh`, Fabric's parallelize_fn)
        self.shard_mesh: DeviceMesh | None = None  # what FSDP shards over: the mesh, or its "data_parallel" dimension
        self._topology: Topology | None = None
        self._ledger: CommLedger | None = None
        self._comms: ZeroPPComms | None = None
        self._count_tensor_parallel = False  # the switch, kept across jobs; the counter exists once the mesh does
        self._tensor_parallel: TensorParallelCounter | None = None

    # ------------------------------------------------------------------ state once the processes exist
    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError(
                "ZeroPPStrategy.topology is known once the processes have started (Trainer.fit, fabric.launch)."
            )
        return self._topology

    @property
    def ledger(self) -> CommLedger:
        if self._ledger is None:
            raise RuntimeError(
                "ZeroPPStrategy.comm_ledger exists once the processes have started (Trainer.fit, fabric.launch)."
            )
        return self._ledger

    @property
    def comms(self) -> ZeroPPComms | None:
        return self._comms

    def check_launch(self, env: ClusterEnvironment, num_nodes: int, num_processes: int, front_door: str) -> None:
        """Refuses a launch whose shape differs from the one the strategy was given (before any group exists)."""
        said = {k: v for k, v in os.environ.items() if isinstance(env, SLURMEnvironment) or not k.startswith("SLURM_")}
        check_launch(num_nodes, num_processes, env.local_rank(), env.node_rank(), said, front_door)

    def check_device(self, precision: str, device: torch.device) -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"ZeroPPStrategy does not support `precision={precision!r}`; use one of {SUPPORTED_PRECISIONS}."
            )
        if self.config.second_moment_correction is True and precision == "16-true":
            raise ValueError(
                "ZeroPPStrategy: `second_moment_correction=True` cannot follow fp16 gradients (`precision='16-true'`):"
                " FSDP divides them after the reduction, outside qgZ, so the noise estimate would be off by that"
                " factor. Use bf16-mixed, bf16-true or 32-true, or leave the correction off."
            )
        tk.check_backend(self.config.kernel_backend, device)
        check_kernels(self.config, device.type)

    def connect(
        self, world_size: int, local_world_size: int, rank: int, device_type: str, precision: str | None = None
    ) -> DeviceMesh:
        """Topology, mesh, ledger, process groups and collectives for a job of ``world_size`` ranks launched
        ``local_world_size`` per machine, training in ``precision`` (what the plan's "auto" settings read); kept as
        they are when called again for the same job (fit, then validate)."""
        topology = job_topology(self.config, world_size, local_world_size, rank)
        if topology != self._topology:
            if topology.hpz_crosses_nodes:
                hpz_size, ranks_per_node = topology.hpz_partition_size, topology.ranks_per_node
                node = (
                    f"ranks_per_node={ranks_per_node}"
                    if topology.tensor_parallel_size == 1
                    else f"the node's {ranks_per_node} data-parallel ranks (tensor_parallel_size="
                    f"{topology.tensor_parallel_size})"
                )
                rank_zero_warn(
                    f"ZeroPPStrategy: hpz_partition_size={hpz_size} does not divide {node},"
                    " so some hpZ groups span two nodes and their backward all-gather crosses nodes. Use a divisor of"
                    f" {ranks_per_node} to keep it inside a node."
                )
            plan = resolve(self.config, topology, precision)
            self.mesh = self._build_mesh(topology, plan, device_type)
            self.shard_mesh = self.mesh["data_parallel"] if topology.tensor_parallel_size > 1 else self.mesh
            self._topology = topology
            self.release()
            self._ledger = CommLedger(topology)
            self._tensor_parallel = None
            if topology.tensor_parallel_size > 1:
                self._tensor_parallel = TensorParallelCounter(self._ledger, self.mesh["tensor_parallel"].get_group())
                self._tensor_parallel.enable(self._count_tensor_parallel)
            groups = ProcessGroups.build(topology, self.config.timeout, plan.hybrid)
            self._comms = ZeroPPComms(self.config, groups, self._ledger, plan)
        assert self._comms is not None and self.mesh is not None
        self._comms.ensure_groups()  # built again if the last run's teardown released them
        return self.mesh

    def _build_mesh(self, topology: Topology, plan: CommPlan, device_type: str) -> DeviceMesh:
        """The mesh every ``fully_shard`` call gets: all ranks (ZeRO-3), or (HSDP) nodes x ranks per node,
        ``("replicate", "shard")``: sharded inside each node, FSDP's all-reduce on the rails; or (quantized HSDP)
        the node's ranks, ``("shard",)``, the rails' all-reduce run by our reduce-scatter hook. The HSDP groups are
        FSDP's, made here with the strategy's ``timeout`` and kept for the job (the strategy's own groups are
        released at every teardown, and a model keeps its mesh).

        With tensor parallelism: data-parallel x tensor-parallel, ``("data_parallel", "tensor_parallel")``, global rank
        ``d * t + j`` as Lightning's ModelParallelStrategy lays it out; FSDP shards over the first dimension."""
        if topology.tensor_parallel_size > 1:
            me, timeout = topology.global_rank, self.config.timeout
            data = own_group(topology.partitions()["world"], me, timeout)
            tensor = own_group(topology.tensor_parallel_partition(), me, timeout)
            ranks = torch.arange(topology.global_world_size).view(topology.world_size, topology.tensor_parallel_size)
            names = ("data_parallel", "tensor_parallel")
            return DeviceMesh.from_group([data, tensor], device_type, ranks, mesh_dim_names=names)
        if not plan.hybrid:
            return init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=("data_parallel",))
        K, N, rank, timeout = topology.num_nodes, topology.ranks_per_node, topology.rank, self.config.timeout
        replicate = own_group([topology.rail_ranks(local) for local in range(N)], rank, timeout)
        shard = own_group([topology.intra_node_ranks(node) for node in range(K)], rank, timeout)
        if not plan.native_all_reduce:  # quantized HSDP: FSDP shards over the node alone; the rail is ours
            node = torch.tensor(topology.intra_node_ranks())
            return DeviceMesh.from_group(shard, device_type, node, mesh_dim_names=("shard",))
        ranks = torch.arange(topology.world_size).view(K, N)
        return DeviceMesh.from_group([replicate, shard], device_type, ranks, mesh_dim_names=("replicate", "shard"))

    def count_tensor_parallel(self, enabled: bool) -> bool:
        """Switches the counting of the model's tensor-parallel collectives; returns the previous setting."""
        previous, self._count_tensor_parallel = self._count_tensor_parallel, enabled
        if self._tensor_parallel is not None:
            self._tensor_parallel.enable(enabled)
        return previous

    def counting_tensor_parallel(self) -> AbstractContextManager:
        """Around a step's forward or backward: counts its tensor-parallel collectives while the switch is on."""
        return self._tensor_parallel.counting() if self._tensor_parallel is not None else nullcontext()

    def release(self) -> None:
        """Destroys the strategy's own process groups (the next run, or a call of the model, builds them again)."""
        if self._comms is not None:
            self._comms.release_groups()

    def agree_max(self, values: list[int], device: torch.device) -> list[int]:
        """The largest of every rank's ``values``, element by element: one all-reduce (MAX) of int64 on the
        strategy's world group (its ``timeout`` applies), recorded in the ledger as ``preemption_all_reduce``."""
        if self._comms is None or self.topology.global_world_size == 1:
            return list(values)
        flags = torch.tensor(values, dtype=torch.int64, device=device)
        # the ledger counts data-parallel peers: with tensor parallelism the tensor-parallel ones are not in it yet
        ranks = list(range(self.topology.world_size))
        self.ledger.record_small_all_reduce("preemption_all_reduce", ranks, 8 * len(values))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._comms.ensure_groups().all_ranks)
        return [int(v) for v in flags.tolist()]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` of rank ``src`` on every rank (on the strategy's world group)."""
        if self._comms is None or self.topology.global_world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._comms.ensure_groups().all_ranks)
        return box[0]

    # ------------------------------------------------------------------ sharding
    @property
    def reshard_after_forward(self) -> bool | int:
        """What every ``fully_shard`` call of this strategy passes: an int (the hpZ partition size) when hpZ is on."""
        return self.plan.reshard_after_forward

    @property
    def plan(self) -> CommPlan:
        """What each collective runs (built when the job's topology is known)."""
        if self._comms is None:
            raise RuntimeError("ZeroPPStrategy: the communication plan exists once the processes are connected.")
        return self._comms.plan

    def sharding(self, precision: str, front_door: str) -> Sharding:
        """What the sharding of a model depends on; a model sharded differently cannot be adopted."""
        topology = self.topology
        return Sharding(front_door, topology.global_world_size, self.reshard_after_forward, precision,
                        offloads(self.config.cpu_offload), self.plan.sharding, self.plan.mesh_shape,
                        topology.tensor_parallel_size)  # fmt: skip

    def shard(
        self,
        model: nn.Module,
        precision: str,
        device: torch.device,
        front_door: str,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
    ) -> tuple[nn.Module, ShardedModel]:
        """Shards ``model`` in place (ZeRO-3 on FSDP2, collectives through ZeRO++) and materializes what is left on
        the meta device; returns the model and its :class:`ShardedModel`.

        ``parallelize_fn(model, mesh)`` (Fabric), or a ``configure_model`` that called ``fully_shard`` (the Trainer,
        as ModelParallelStrategy's users write it): the user's own units instead of the default ones; they must be
        sharded over :attr:`shard_mesh` with :attr:`reshard_after_forward` (hpZ), and the root is sharded here if
        they left it. With tensor parallelism the model must hold parameters split over the mesh's
        ``"tensor_parallel"`` dimension by then. A model sharded earlier by a strategy with the same sharding is
        adopted: its collectives are routed through this core.
        """
        assert self._comms is not None and self.mesh is not None and self.shard_mesh is not None
        refuse_fsdp1(model)
        sharding = self.sharding(precision, front_door)
        sharded: ShardedModel | None = getattr(model, _SHARDED, None)
        if sharded is not None:
            self._adopt(model, sharded, sharding)
            return model, sharded
        root_hooks = ForwardHooks(model)  # the hooks added from here on are the root's sharding hooks
        if parallelize_fn is not None:
            parallelized = _user_parallelized(model, parallelize_fn, self.mesh)
            if parallelized is not model:
                model, root_hooks = parallelized, ForwardHooks(parallelized)
        where = "`parallelize_fn`" if parallelize_fn is not None else "`configure_model`"
        check_tensor_parallel(model, self.topology.tensor_parallel_size, where)
        apply_zeropp(
            model,
            mesh=self.shard_mesh,
            reshard_after_forward=sharding.reshard_after_forward,
            precision=precision,
            auto_wrap_policy=self.config.auto_wrap_policy,
            activation_checkpointing_policy=self.config.activation_checkpointing_policy,
            cpu_offload=self.config.cpu_offload,
            already_sharded=where if parallelize_fn is not None or _holds_units(model) else None,
        )
        self._comms.use_units(fsdp_hooks.install(model, self._comms))
        sharded = ShardedModel(sharding, self._comms, root_hooks)
        model.register_forward_pre_hook(sharded.begin_forward, prepend=True)  # before FSDP2's root pre-hook
        model.register_forward_pre_hook(sharded.enter_step)  # after it
        root_hooks.keep_added()
        setattr(model, _SHARDED, sharded)
        materialize_meta_tensors(model, device)
        return model, sharded

    def _adopt(self, model: nn.Module, sharded: ShardedModel, sharding: Sharding) -> None:
        """A model sharded by an earlier strategy (an earlier Trainer): route its collectives through ours."""
        assert self._comms is not None
        differences = sharded.sharding.differences(sharding)
        if differences:
            raise ValueError(
                "ZeroPPStrategy: this model was sharded by an earlier strategy with other settings ("
                + "; ".join(differences)
                + "). Build a fresh model and load a checkpoint instead: sharded checkpoints load on any world size"
                " and settings."
            )
        if sharded.comms is not self._comms:  # the earlier strategy's groups (rebuilt if the model ran after its run)
            sharded.comms.release_groups()
        self._comms.use_units(fsdp_hooks.install(model, self._comms))
        sharded.comms = self._comms
        reshard(model)

    # ------------------------------------------------------------------ checkpoints
    def save(self, ranks: ckpt.Ranks, checkpoint: dict[str, Any], path: str | os.PathLike, save_file: Callable) -> None:
        """Writes Lightning's checkpoint dict (``state_dict``, ``optimizer_states``, the rest) atomically."""
        sharded = self.config.state_dict_type == "sharded"  # a full file leaves out the weight deltas' node copies
        comms_state = self._comms.state_dict(node_copies=sharded) if self._comms is not None else None
        ckpt.save(ranks, checkpoint, path, self.config.state_dict_type, save_file, comms_state)

    def load(
        self,
        ranks: ckpt.Ranks,
        path: str | os.PathLike,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        strict: bool,
        weights_only: bool | None,
        model_key: str | None = None,
        optimizer_keys: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Checks the checkpoint against ``model`` and ``optimizers`` and loads them from it, in any layout
        :func:`~lightning_zeropp.checkpoint.read_keys` reads (``model_key`` / ``optimizer_keys``: a Fabric state's
        names); restores the random states and the collectives' state, and reshards the model. Returns the rest of
        the checkpoint, with a Fabric file's schedulers as the Trainer's ``lr_schedulers`` list."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # the names checkpoints use (a compiled block's `_orig_mod.` left out), with global shapes
        shapes = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}

        def restore(states: Any, where: Path) -> None:
            if self._comms is not None:
                ckpt.restore_comms(self._comms, states, where, where.is_dir(), ranks.world_size, ranks.global_rank)

        def read(where: Path, keys: ckpt.CheckpointKeys) -> dict[str, Any]:
            loaded = ckpt.read_checkpoint(where, keys, model, optimizers, strict, weights_only)
            if keys.schedulers is not None:
                loaded[ckpt.SCHEDULERS_KEY] = [loaded.pop(key) for key in keys.schedulers if key in loaded]
            for key in (ckpt.FABRIC_KEYS, ckpt.OPTIMIZER_STATES):
                loaded.pop(key, None)
            return loaded

        expected = [(type(o).__name__, keys) for o, keys in zip(optimizers, ckpt.optimizer_keys(model, optimizers))]
        if self._comms is not None:  # node copies are rebuilt, unless the checkpoint restores them
            self._comms.weights_replaced()
        loaded = ckpt.load(ranks, path, shapes, strict, read, restore, expected, model_key, optimizer_keys)
        reshard(model)
        return loaded


class FrontDoor:
    """What both strategy classes add to their Lightning base class, mixed in before it: the arguments, the core's
    state as properties, starting the processes, counting optimizer steps, releasing the groups at teardown. The class
    sets ``front_door`` (``"Trainer"`` or ``"Fabric"``, as messages name it) and ``_core``.

    The arguments come from a config class, named when the class is defined: ``class S(FrontDoor, Base,
    config=ZeroPPConfig, own_arguments=...)`` gives ``S.__init__`` the config's fields as its signature, and ``S`` the
    ``Arguments:`` docstring (:func:`lightning_zeropp.arguments.declare`); ``__init__`` reads them with
    :meth:`configure`. A subclass that names another config (a dataclass derived from :class:`ZeroPPConfig`) takes its
    fields in the same way.
    """

    front_door: str
    config_class: type[ZeroPPConfig]
    own_arguments: type | None = None
    arguments_signature: inspect.Signature
    _core: ZeroPPCore
    _preemption: Preemption

    def __init_subclass__(
        cls, config: type[ZeroPPConfig] | None = None, own_arguments: type | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if config is not None or own_arguments is not None:
            arguments.declare(cls, config or cls.config_class, own_arguments or cls.own_arguments)

    @classmethod
    def configure(cls, args: tuple, kwargs: dict[str, Any]) -> tuple[ZeroPPConfig, dict[str, Any]]:
        """``__init__``'s arguments bound to the class's signature: the validated config (deprecated spellings mapped
        to their fields, with a warning), and this front door's own arguments."""
        return arguments.bind(cls, args, kwargs)

    @classmethod
    def from_config(cls, config: ZeroPPConfig, **kwargs: Any) -> Any:
        """The strategy with the arguments of ``config`` (``kwargs``: the front door's own, e.g. Fabric's
        ``parallelize_fn``). ``strategy.zeropp_config == config``."""
        if not isinstance(config, ZeroPPConfig):
            raise TypeError(
                f"{cls.__name__}.from_config: `config` must be a ZeroPPConfig, got {type(config).__name__}; pass"
                f" the arguments by name instead: {cls.__name__}(quantize_weights=..., ...)."
            )
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, **kwargs)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """The data-parallel replicas split the data: every rank, whatever the mesh (HSDP's has two dimensions); with
        tensor parallelism the ranks of one tensor-parallel group read the same batch (the data-parallel ranks of
        the mesh, as ModelParallelStrategy's sampler)."""
        topology = self._core._topology
        if topology is not None:
            return {"num_replicas": topology.world_size, "rank": topology.rank}
        strategy: Any = self
        return {"num_replicas": strategy.world_size, "rank": strategy.global_rank}

    @property
    def zeropp_config(self) -> ZeroPPConfig:
        return self._core.config

    @property
    def topology(self) -> Topology:
        return self._core.topology

    @property
    def comm_ledger(self) -> CommLedger:
        """Bytes this rank sent, by collective kind, split into same-node and other-node peers (per step:
        ``comm_ledger.step_metrics()``, what ``CommVolumeMonitor`` logs and a Fabric loop passes to ``log_dict``)."""
        return self._core.ledger

    def count_tensor_parallel_bytes(self, enabled: bool = True) -> bool:
        """Counts (or stops counting) the collectives of the model's tensor-parallel plan in :attr:`comm_ledger`, as
        the ``tensor_parallel_*`` kinds, apart from the data-parallel totals (see :mod:`lightning_zeropp.ledger`);
        returns the previous setting. Off by default: it watches every operator of the step. The Trainer's strategy
        counts in ``training_step`` and its backward (``CommVolumeMonitor`` switches it on for its run), Fabric's in
        every forward of the model and in ``fabric.backward``. No effect with ``tensor_parallel_size=1``."""
        if not isinstance(enabled, bool):
            raise TypeError(f"count_tensor_parallel_bytes: `enabled` must be True or False, got {enabled!r}.")
        return self._core.count_tensor_parallel(enabled)

    @property
    def comms(self) -> ZeroPPComms | None:
        """The collectives every sharded module of the model calls (None before the processes start)."""
        return self._core.comms

    @property
    def state_dict_type(self) -> StateDictType:
        return self._core.config.state_dict_type

    @property
    def auto_wrap_policy(self) -> ModuleSelection:
        """The module classes (or names) that become FSDP units; None: the elements of the outermost ModuleLists."""
        return self._core.config.auto_wrap_policy

    @property
    def activation_checkpointing_policy(self) -> ModuleSelection:
        return self._core.config.activation_checkpointing_policy

    @property
    def cpu_offload(self) -> CpuOffload:
        return self._core.config.cpu_offload

    @property
    def reshard_after_forward(self) -> bool | int:
        """What every ``fully_shard`` call passes (a ``parallelize_fn`` too): the hpZ partition size when hpZ is on."""
        return self._core.reshard_after_forward

    def start_processes(self) -> None:
        """The launch checked against ``num_nodes`` x ``devices``, then the default process group, the core's
        topology, groups and collectives, and the mesh. ``setup_environment`` of both front doors."""
        strategy: Any = self
        assert strategy.cluster_environment is not None
        self._core.check_launch(
            strategy.cluster_environment, strategy.num_nodes, strategy.num_processes, self.front_door
        )
        strategy.setup_distributed()
        plugin = getattr(strategy, "precision_plugin", None) or getattr(strategy, "precision", None)  # Trainer, Fabric
        mesh = self._core.connect(
            strategy.world_size,
            strategy.num_processes,
            strategy.global_rank,
            strategy.root_device.type,
            str(plugin.precision) if plugin is not None else None,
        )
        strategy.set_device_mesh(mesh)

    def optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Steps the optimizer inside the preemption's step boundary (a save asked for meanwhile waits for it). What
        runs around the update itself (the second-moment correction, weight deltas, the step count) runs from the
        optimizer's step hooks (:meth:`attach_optimizers`), whoever calls ``step``."""
        with self._preemption.in_flight():
            output = super().optimizer_step(optimizer, *args, **kwargs)  # type: ignore[misc]
        self._preemption.stepped = True
        return output

    def attach_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Hooks each optimizer's steps to the step's owner (``Optimizer.register_step_pre_hook`` /
        ``register_step_post_hook``; nothing of the optimizer is replaced), after the second-moment correction has
        decided for each from what it is; rank 0 says once what it decided. Refuses, before any step, an optimizer
        ``second_moment_correction=True`` cannot correct and one FSDP2's sharded parameters cannot step."""
        comms = self._core.comms
        if comms is None:
            return
        device = self.root_device  # type: ignore[attr-defined]
        for optimizer in optimizers:
            check_runs_sharded(optimizer, self._core.shard_mesh, device)
        if comms.moments is not None:
            verdicts = [comms.moments.judge_optimizer(optimizer) for optimizer in optimizers]
            if verdicts:
                rank_zero_info("ZeroPPStrategy: second-moment correction: " + "; ".join(v.describe() for v in verdicts))
        for optimizer in optimizers:
            comms.owner.attach(optimizer)

    def refresh_weight_copies(self) -> None:
        """With ``weight_deltas``: the next forward rebuilds every node copy exactly. Changes made with in-place
        writes to the parameters are detected by themselves; call this after writing through ``param.data``."""
        if self._core.comms is not None:
            self._core.comms.weights_replaced()

    @property
    def persistent_memory(self) -> dict[str, int]:
        """Bytes the collectives keep on this rank across steps: ``error_feedback`` (qgZ residuals),
        ``second_moment_noise`` (the second-moment correction's noise estimates, one fp32 per gradient block),
        ``weight_deltas_node_copy`` (this rank's slice of its node's copy, M / R elements in the compute dtype) and
        ``weight_deltas_tracked_copy`` (what the other nodes hold of this rank's shard, M / W elements)."""
        comms = self._core.comms
        if comms is None:
            return {"error_feedback": 0, "second_moment_noise": 0, "weight_deltas_node_copy": 0,
                    "weight_deltas_tracked_copy": 0}  # fmt: skip
        return comms.persistent_nbytes()

    def teardown(self) -> None:
        """Lightning's teardown, then the strategy's own process groups are destroyed (the next run, or a call of the
        sharded model after the run, builds them again): repeated runs in one process keep one set."""
        super().teardown()  # type: ignore[misc]
        if self._core.comms is not None:
            self._core.comms.detach_optimizers()
        self._core.release()


HSDP_ARGUMENTS = dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=False)
"""What ``"hsdp"`` sets: HSDP (shard inside each node, replicate across nodes) with exact collectives."""
QUANTIZED_HSDP_ARGUMENTS = dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True)
"""What ``"qhsdp"`` sets: HSDP whose cross-node all-reduce is an INT4 reduce-scatter and an INT8 all-gather."""


def register_names(registry: Any, strategy_class: type) -> None:
    """Registers ``"zeropp"`` (the defaults), ``"zero3"`` (qwZ, hpZ and qgZ off), ``"hsdp"`` (HYBRID_SHARD) and
    ``"qhsdp"`` (HYBRID_SHARD, the cross-node all-reduce quantized) in a Trainer or Fabric registry."""
    registry.register(
        "zeropp",
        strategy_class,
        description="ZeRO++: ZeRO-3 on FSDP2 with quantized weights (qwZ), hpZ and quantized gradients (qgZ)",
        override=True,
    )
    registry.register(
        "zero3",
        strategy_class,
        description="ZeRO-3 on FSDP2 (ZeroPPStrategy with qwZ, hpZ and qgZ off): the ZeRO++ baseline",
        override=True,
        quantize_weights=False,
        hpz_partition_size=1,
        quantize_gradients=False,
    )
    registry.register(
        "hsdp",
        strategy_class,
        description="HSDP on FSDP2 (ZeroPPStrategy with sharding_strategy='HYBRID_SHARD'): sharded inside each node,"
        " replicated across nodes; the baseline beside ZeRO-3 and ZeRO++",
        override=True,
        **HSDP_ARGUMENTS,
    )
    registry.register(
        "qhsdp",
        strategy_class,
        description="Quantized HSDP (ZeroPPStrategy with sharding_strategy='HYBRID_SHARD', quantize_gradients=True):"
        " HSDP whose cross-node gradient all-reduce is an INT4 reduce-scatter and an INT8 all-gather",
        override=True,
        **QUANTIZED_HSDP_ARGUMENTS,
    )


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by a ZeroPPStrategy (either front door)."""
    return getattr(model, _SHARDED, None) is not None


def reshard(model: nn.Module | None) -> None:
    """Drops every unsharded and hpZ secondary copy of the weights; the next forward gathers the primary shards.

    Needed after every forward without backward (evaluation) and every checkpoint load. A forward without backward
    leaves each unit holding its hpZ slice as the module's parameters: code that reads or writes parameters would
    then see other objects than the optimizer's, and anything that changed the weights meanwhile (a checkpoint load,
    a callback swapping EMA weights in and back) would be silently undone by the next forward, which gathers from
    those slices.
    """
    if model is None:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _holds_units(model: nn.Module) -> bool:
    """Whether the user sharded modules of ``model`` (``fully_shard`` in ``configure_model``)."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _user_parallelized(
    model: nn.Module, parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module], mesh: DeviceMesh
) -> nn.Module:
    out = parallelize_fn(model, mesh)
    if not isinstance(out, nn.Module):
        raise TypeError(
            f"ZeroPPStrategy: `parallelize_fn` must return the nn.Module, but returned {type(out).__name__}."
        )
    return out
