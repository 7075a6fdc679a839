"""``ZeroPPStrategy`` for Lightning Fabric: ZeRO++ in a hand-written training loop.

    import lightning_zeropp  # registers "zeropp" and "zero3" with the Trainer and with Fabric
    fabric = Fabric(accelerator="cuda", devices=8, num_nodes=2, strategy="zeropp")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)

The same arguments, validation, sharding, collectives, ledger and checkpoint layout as the Trainer's
:class:`lightning_zeropp.ZeroPPStrategy`: both hold one :class:`~lightning_zeropp.core.ZeroPPCore`. This module adds
what a Fabric loop needs: ``setup_module`` shards the model, an optimizer built before sharding is pointed at the
sharded parameters, ``save_checkpoint`` / ``load_checkpoint`` map Fabric's named state onto the Trainer's layout, and a
forward without gradients (evaluation) drops the hpZ copies it left behind.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override

from .checkpoint import (
    COMMS_KEY,
    FABRIC_KEYS,
    MODEL_KEY,
    OPTIMIZER_STATES,
    RNG_KEY,
    SCHEDULERS_KEY,
    VERSION_KEY,
    index_keyed,
    load_plain_weights,
)
from .checkpoint_files import is_checkpoint_file
from .compat.lightning import FabricModelParallelBase
from .config import ZeroPPConfig, argument
from .core import FrontDoor, ZeroPPCore, is_sharded, register_names, reshard
from .preemption import Preemption

__all__ = ["FabricArguments", "ZeroPPStrategy"]

_RESERVED = (MODEL_KEY, OPTIMIZER_STATES, SCHEDULERS_KEY, RNG_KEY, COMMS_KEY, FABRIC_KEYS, VERSION_KEY)
_RESHARD_HOOK = "_zeropp_fabric_reshard_hook"
_COUNT_HOOKS = "_zeropp_fabric_count_hooks"


def _no_parallelize(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    return module


@dataclass(kw_only=True, frozen=True)
class FabricArguments:
    """The Fabric strategy's own arguments, beside those of :class:`~lightning_zeropp.ZeroPPConfig`."""

    parallelize_fn: Callable[[Any, DeviceMesh], Any] | None = argument(
        None,
        "parallelize_fn(model, device_mesh) -> model, for users who choose their own units: it calls"
        " fully_shard(unit, mesh=device_mesh, reshard_after_forward=strategy.reshard_after_forward) on them (the"
        " strategy checks both, and shards the root if the function did not). With tensor_parallel_size > 1 the"
        " mesh is 2-D, as Fabric's ModelParallelStrategy passes it: parallelize_module(..., device_mesh"
        "['tensor_parallel'], plan), then fully_shard(..., mesh=device_mesh['data_parallel']). None: the units are"
        " the blocks (auto_wrap_policy), as for the Trainer.",
    )


class ZeroPPStrategy(FrontDoor, FabricModelParallelBase, config=ZeroPPConfig, own_arguments=FabricArguments):
    """ZeRO++ for Fabric: quantized weight all-gather (qwZ), an in-node weight partition (hpZ), quantized gradients.

    The arguments of :class:`lightning_zeropp.ZeroPPStrategy` (the fields of
    :class:`~lightning_zeropp.ZeroPPConfig`, with the same defaults and checks), plus ``parallelize_fn``;
    ``ZeroPPStrategy.from_config(config, parallelize_fn=...)`` takes them from a config.

    Checkpoints (``fabric.save`` / ``fabric.load``) are written in the Trainer strategy's layout: the model under
    ``state_dict``, the optimizers as ``optimizer_states`` and the learning-rate schedulers as ``lr_schedulers``
    (each matched by its order in the state), everything else as metadata. So a checkpoint saved here resumes in the
    Trainer (weights, optimizers, schedulers; its loop counters start at zero, as Fabric keeps none) and the other
    way round, and consolidates with ``python -m lightning_zeropp.consolidate``. Saves are atomic and carry every
    rank's random state; a sharded checkpoint loads on any world size.
    """

    front_door = "Fabric"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config, own = self.configure(args, kwargs)
        parallelize_fn = own["parallelize_fn"]
        core = ZeroPPCore(config)
        if parallelize_fn is not None:
            if not callable(parallelize_fn):
                raise TypeError(
                    f"ZeroPPStrategy: `parallelize_fn` must be a function (model, device_mesh) -> model, got"
                    f" {type(parallelize_fn).__name__}."
                )
            chosen = [n for n in ("auto_wrap_policy", "activation_checkpointing_policy") if getattr(config, n)]
            if chosen:
                raise ValueError(
                    f"ZeroPPStrategy: `parallelize_fn` chooses the units and wraps them itself, so `{chosen[0]}` would"
                    " have no effect. Pass one or the other: apply activation checkpointing inside `parallelize_fn`"
                    " (before `fully_shard`), or drop `parallelize_fn` and let the policies choose."
                )
        super().__init__(
            parallelize_fn=parallelize_fn or _no_parallelize,
            save_distributed_checkpoint=config.state_dict_type == "sharded",
            process_group_backend=config.process_group_backend,
            timeout=config.timeout,
        )
        self._core = core
        self._preemption = Preemption()
        self._user_parallelize = parallelize_fn
        self._forward_counting = ExitStack()  # the tensor-parallel counting of the forward that is running
        # id of a parameter before sharding -> (it, the sharded parameter that replaced it), both weakly held
        self._before_sharding: dict[int, tuple[weakref.ref, weakref.ref | None]] = {}

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        self._core.check_device(str(self.precision.precision), self.root_device)
        self.start_processes()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shards ``module`` in place and materializes what ``fabric.init_module(empty_init=True)`` left on the meta
        device. An optimizer built on its parameters before this call is pointed at the sharded ones when it is set
        up (:meth:`setup_optimizer`)."""
        # Sharding replaces each parameter on the module that holds it; a `parallelize_fn` may wrap the model (and
        # so rename the parameters), but the modules that hold them stay: follow each by its holder and attribute.
        before = [
            (holder, name, p) for holder in module.modules() for name, p in holder.named_parameters(recurse=False)
        ]
        precision = str(self.precision.precision)
        model, _ = self._core.shard(module, precision, self.root_device, "Fabric", self._user_parallelize)
        if not hasattr(model, _RESHARD_HOOK):
            setattr(model, _RESHARD_HOOK, model.register_forward_hook(_reshard_without_grad))
        if not hasattr(model, _COUNT_HOOKS):  # Fabric's loop owns the forward: count it from the model's own hooks
            start = model.register_forward_pre_hook(self._start_counting_forward)
            stop = model.register_forward_hook(self._stop_counting_forward, always_call=True)  # raised or not
            setattr(model, _COUNT_HOOKS, (start, stop))
        for holder, name, p in before:
            new = getattr(holder, name, None)
            replaced = isinstance(new, nn.Parameter) and new is not p
            self._before_sharding[id(p)] = (weakref.ref(p), weakref.ref(new) if replaced else None)
        self.barrier()
        return model

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Points an optimizer built before sharding (``fabric.setup(model, optimizer)``) at the sharded parameters;
        its param groups and their settings stay as they are."""

        def entry(p: Any) -> tuple[weakref.ref, weakref.ref | None] | None:
            found = self._before_sharding.get(id(p))
            return found if found is not None and found[0]() is p else None

        def sharded(p: Any) -> nn.Parameter | None:
            found = entry(p)
            return found[1]() if found is not None and found[1] is not None else None

        lost = [p for group in optimizer.param_groups for p in group["params"] if entry(p) and sharded(p) is None]
        if lost:
            raise ValueError(
                f"ZeroPPStrategy: the optimizer holds {len(lost)} parameter(s) of the model as it was before sharding"
                " that the sharded model no longer holds (did `parallelize_fn` copy modules?); it would train nothing."
                " Build the optimizer after setting up the model: `model = fabric.setup_module(model)`, then"
                " `optimizer = fabric.setup_optimizers(Optimizer(model.parameters()))`."
            )
        held = [p for group in optimizer.param_groups for p in group["params"] if sharded(p) is not None]
        if any(optimizer.state.get(p) for p in held):  # checked first: a refused optimizer is left as it was
            raise ValueError(
                "ZeroPPStrategy: the optimizer already holds state (it has stepped) for the model's parameters as"
                " they were before sharding; that state cannot follow them into their shards. Set up the model first"
                " (`model = fabric.setup_module(model)`), then build the optimizer on `model.parameters()` and set it"
                " up (`optimizer = fabric.setup_optimizers(optimizer)`)."
            )
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                new = sharded(p)
                if new is not None:
                    params[i] = new
        optimizer = super().setup_optimizer(optimizer)
        self.attach_optimizers([optimizer])
        return optimizer

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clips by the global norm over every rank's shards; returns that norm as a plain tensor."""
        norm = super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        with self._preemption.in_flight(), self._core.counting_tensor_parallel():
            super().backward(tensor, module, *args, **kwargs)

    def _start_counting_forward(self, module: nn.Module, args: Any) -> None:
        """Tensor-parallel bytes (:meth:`count_tensor_parallel_bytes`): the forward's, from its pre-hook to its
        post-hook (which runs when the forward raises, too)."""
        self._forward_counting.enter_context(self._core.counting_tensor_parallel())

    def _stop_counting_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_counting.close()

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Writes the model, the optimizers and the rest of ``state`` under a temporary name renamed into place when
        complete. A sharded folder (default) in the Trainer strategy's layout, so that it resumes in either front
        door; a full file (``state_dict_type="full"``) under the state's own keys, as a plain ``Fabric`` writes it
        (optimizer states keyed by parameter index), so that a plain ``Fabric`` (one device, DDP) loads it. Refused
        during a backward, an optimizer step or another save (from a signal handler): the loop has no step boundary
        the save could wait for, and reading the state then would reshard weights the step is using."""
        if storage_options is not None:
            raise TypeError(
                "ZeroPPStrategy.save_checkpoint(..., storage_options=...) is not supported: the strategy writes the"
                " checkpoint itself (a sharded folder or one file), not through a CheckpointIO plugin."
            )
        if self._preemption.busy:
            raise RuntimeError(
                f"ZeroPPStrategy: fabric.save({str(path)!r}, ...) was called while a backward, an optimizer step or a"
                " save of the sharded model is running (from a signal handler?). Save between steps: let the handler"
                " set a flag, and call fabric.save after optimizer.step() when it is set, on every rank."
            )
        if filter is not None and self.state_dict_type == "sharded":
            raise NotImplementedError(
                "ZeroPPStrategy: `fabric.save(..., filter=...)` needs `state_dict_type='full'`: a sharded checkpoint"
                " must hold every tensor of the model and optimizers to load on another world size."
            )
        with self._preemption.saving():
            self._write_checkpoint(path, state, filter or {})

    def _write_checkpoint(
        self, path: str | os.PathLike, state: dict[str, Any], filters: dict[str, Callable[[str, Any], bool]]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = self.state_dict_type == "full"
        module_key, module, optimizers = _split_state(state, "save")
        schedulers = _schedulers(state)
        options = StateDictOptions(full_state_dict=full, cpu_offload=True)
        model_state = _filtered(module_key, filters, get_model_state_dict(module, options=options))
        optimizer_states = []
        for key, optimizer in optimizers:
            optimizer_state = get_optimizer_state_dict(module, optimizer, options=options)
            if full and self.is_global_zero:
                optimizer_state = index_keyed(optimizer_state)
            optimizer_states.append(_filtered(key, filters, optimizer_state))
        names = {
            "model": module_key,
            "optimizers": [key for key, _ in optimizers],
            "lr_schedulers": [key for key, _ in schedulers],
        }
        if full:
            _check_full_keys(names)
            checkpoint: dict[str, Any] = {module_key: model_state, **dict(zip(names["optimizers"], optimizer_states))}
            checkpoint.update({key: scheduler.state_dict() for key, scheduler in schedulers})
        else:
            checkpoint = {
                MODEL_KEY: model_state,
                OPTIMIZER_STATES: optimizer_states,
                SCHEDULERS_KEY: [scheduler.state_dict() for _, scheduler in schedulers],
            }
        checkpoint.update({FABRIC_KEYS: names, VERSION_KEY: lightning.__version__})
        for key, obj in state.items():
            if key == module_key or isinstance(obj, (Optimizer, LRScheduler)):
                continue
            if key in _RESERVED:
                raise ValueError(
                    f"ZeroPPStrategy: the state key {key!r} is reserved in a checkpoint (it holds the"
                    f" {'model' if key == MODEL_KEY else 'strategy'}'s own data); rename it."
                )
            checkpoint[key] = _filtered(key, filters, obj.state_dict() if _stateful(obj) else obj)
        self._core.save(self, checkpoint, path, lambda data, where: torch.save(data, where))

    @override
    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restores ``state`` from a checkpoint written by this strategy (Fabric or Trainer; sharded or full; any
        world size): the model, the optimizers in order, every other key of ``state`` (objects with
        ``load_state_dict`` in place); returns what the checkpoint holds beyond that. ``state`` may also be the
        model alone (``fabric.load_raw``): its weights from such a checkpoint or from a plain state-dict file."""
        if not state:
            raise ValueError(
                f"ZeroPPStrategy.load_checkpoint(..., state={state!r}): pass the objects to restore, at least the"
                " model: `fabric.load(path, {'model': model, 'optimizer': optimizer, ...})`."
            )
        path = Path(self.broadcast(path))
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "ZeroPPStrategy: loading an optimizer alone is not supported; load it together with its model:"
                " `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
            )
        if isinstance(state, nn.Module):
            self._load_weights(path, state, strict, weights_only)
            return {}
        module_key, module, optimizers = _split_state(state, "load")
        loaded = self._core.load(
            self, path, module, [o for _, o in optimizers], strict, weights_only,
            model_key=module_key, optimizer_keys=tuple(k for k, _ in optimizers),
        )  # fmt: skip
        schedulers = _schedulers(state)
        stored_schedulers = loaded.pop(SCHEDULERS_KEY, None)
        if stored_schedulers is not None:  # this strategy's checkpoints: matched by order
            if strict and len(stored_schedulers) != len(schedulers):
                raise KeyError(
                    f"ZeroPPStrategy: the checkpoint {path} holds {len(stored_schedulers)} learning-rate scheduler(s),"
                    f" the state {len(schedulers)}; schedulers are matched by their order. Pass `strict=False` to load"
                    " the ones both have."
                )
            for (_, scheduler), scheduler_state in zip(schedulers, stored_schedulers):
                scheduler.load_state_dict(scheduler_state)
        loaded.pop(VERSION_KEY, None)
        for key, obj in state.items():
            if key == module_key or isinstance(obj, Optimizer):
                continue
            if isinstance(obj, LRScheduler) and stored_schedulers is not None:
                continue
            if key not in loaded:  # a plain Fabric file keeps schedulers under their keys, as any other object
                if strict:
                    raise KeyError(
                        f"ZeroPPStrategy: the state key {key!r} is not in the checkpoint {path} (it holds"
                        f" {sorted(loaded)[:8]}). Pass `strict=False` to load the rest."
                    )
                continue
            value = loaded.pop(key)
            if _stateful(obj):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return loaded

    def _load_weights(self, path: Path, module: nn.Module, strict: bool, weights_only: bool | None) -> None:
        """The model's weights alone: from a checkpoint of this strategy, or a plain state-dict file."""
        if path.is_dir() or _is_lightning_file(path):
            self._core.load(self, path, module, [], strict, weights_only)
            return
        load_plain_weights(path, module, strict, weights_only)
        reshard(module)

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)


def _reshard_without_grad(module: nn.Module, args: Any, output: Any) -> None:
    """After a forward without gradients (evaluation), drop the hpZ copies it left (see :func:`reshard`)."""
    if not torch.is_grad_enabled():
        reshard(module)


def _split_state(state: dict[str, Any], action: str) -> tuple[str, nn.Module, list[tuple[str, Optimizer]]]:
    """The one sharded model in ``state`` (its key and itself) and the optimizers in order."""
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module) and is_sharded(v)]
    if len(modules) != 1:
        found = "no model set up" if not modules else f"{len(modules)} models ({', '.join(k for k, _ in modules)})"
        raise ValueError(
            f"ZeroPPStrategy: to {action} a checkpoint, `state` must hold exactly one model set up with this strategy"
            f" (`model = fabric.setup(model)`); it holds {found}. Save each model in its own checkpoint."
        )
    optimizers = [(k, v) for k, v in state.items() if isinstance(v, Optimizer)]
    return modules[0][0], modules[0][1], optimizers


def _stateful(obj: Any) -> bool:
    """An object saved through its ``state_dict()`` and restored in place with ``load_state_dict`` (as Fabric does)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _schedulers(state: dict[str, Any]) -> list[tuple[str, LRScheduler]]:
    return [(k, v) for k, v in state.items() if isinstance(v, LRScheduler)]


def _filtered(key: str, filters: dict[str, Callable[[str, Any], bool]], value: Any) -> Any:
    if key in filters and isinstance(value, dict):
        return {k: v for k, v in value.items() if filters[key](k, v)}
    return value


def _check_full_keys(names: dict[str, Any]) -> None:
    """A full file keeps the model and optimizers under the state's own keys; the Trainer layout's names would make
    it read as a Trainer checkpoint."""
    taken = [k for k in [names["model"], *names["optimizers"]] if k in _RESERVED or _numbered_optimizer(k)]
    if taken:
        raise ValueError(
            f"ZeroPPStrategy: the state key {taken[0]!r} is reserved in a full checkpoint (the Trainer's layout uses"
            " it); rename it, e.g. `fabric.save(path, {'model': model, 'optimizer': optimizer})`."
        )


def _numbered_optimizer(key: str) -> bool:
    return key.startswith("optimizer_") and key[len("optimizer_") :].isdigit()


def _is_lightning_file(path: Path) -> bool:
    return path.is_file() and is_checkpoint_file(path)


ZeroPPStrategy.register_strategies(STRATEGY_REGISTRY)
