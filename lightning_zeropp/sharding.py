"""Applies ZeRO-3 sharding with FSDP2 to a model (the core then routes its collectives through ZeRO++).

Order matters: activation checkpointing first (it must see the plain blocks), then ``fully_shard`` bottom-up (a
parent's ``fully_shard`` skips parameters its sharded children already manage), the root last; only then the
custom collectives (``fsdp_hooks.install``), which every sharded module shares.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard

from .compat.torch import checkpoint_in_place, unit_mesh_sizes
from .config import CpuOffload, ModulePolicy, ModuleSelection, offload_policy


def module_policy(model: nn.Module, selection: ModuleSelection, argument: str) -> ModulePolicy | None:
    """Turns ``auto_wrap_policy`` / ``activation_checkpointing_policy`` into a predicate over modules: classes, class
    names (as written in YAML; each must name a class present in ``model``), or the user's callable as it is."""
    if not selection:
        return None
    if callable(selection) and not isinstance(selection, type):
        return selection
    items = [selection] if isinstance(selection, type) else list(selection)
    present = {type(m).__name__: type(m) for m in model.modules()}
    classes: set[type[nn.Module]] = set()
    for item in items:
        if isinstance(item, str):
            if item not in present:
                raise ValueError(
                    f"ZeroPPStrategy: `{argument}` names {item!r}, but the model has no module of that class."
                    f" Classes in the model: {sorted(present)}."
                )
            classes.add(present[item])
        else:
            classes.add(item)
    chosen = tuple(classes)
    return lambda module: isinstance(module, chosen)


def _describe(selection: ModuleSelection) -> str:
    if callable(selection) and not isinstance(selection, type):
        return f"the policy {getattr(selection, '__name__', repr(selection))}"
    items = [selection] if isinstance(selection, type) else list(selection or ())
    return str(sorted(i if isinstance(i, str) else i.__name__ for i in items))


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def default_wrap_targets(model: nn.Module) -> list[nn.Module]:
    """The elements of the outermost ``nn.ModuleList``s (transformer blocks): one FSDP unit each.

    Lists nested inside a block (heads, experts) stay part of their block's unit, and containers, which have no
    forward of their own (their hooks would never fire), are never units.
    """
    targets: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                targets.extend(m for m in child if not isinstance(m, _CONTAINERS))
            else:
                visit(child)

    visit(model)
    return targets


def wrap_targets(model: nn.Module, policy: ModulePolicy, selection: ModuleSelection) -> list[nn.Module]:
    """The submodules ``policy`` selects, containers excepted (they have no forward, so their hooks never fire)."""
    targets = [m for m in model.modules() if m is not model and not isinstance(m, _CONTAINERS) and policy(m)]
    if not targets:
        raise ValueError(
            f"ZeroPPStrategy: `auto_wrap_policy` ({_describe(selection)}) selects no submodule of the model. Name the"
            " classes of your transformer blocks, or leave it None to shard every module held in an nn.ModuleList."
        )
    return targets


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16-mixed is DeepSpeed's bf16 mode: fp32 sharded master weights, bf16 compute, all-gather and reduction."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return MixedPrecisionPolicy()


def apply_zeropp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool | int,
    precision: str,
    auto_wrap_policy: ModuleSelection,
    activation_checkpointing_policy: ModuleSelection,
    cpu_offload: CpuOffload,
    already_sharded: bool = False,
) -> list[nn.Module]:
    """Shards ``model`` in place; returns the sharded modules, root last.

    ``already_sharded``: the user's ``parallelize_fn`` called ``fully_shard`` on the units it chose; they are checked
    against the strategy's layout (``mesh``, ``reshard_after_forward``), and the root is sharded if it is not yet.
    """
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mixed_precision_policy(precision),
        "offload_policy": offload_policy(cpu_offload),
    }
    if already_sharded:
        targets = _check_user_units(model, mesh, reshard_after_forward)
        return _shard_root(model, targets, kwargs)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise TypeError(
            "ZeroPPStrategy shards the model itself, but it already holds modules wrapped with `fully_shard`."
            " Build the layers in `configure_model` without calling `fully_shard`; choose the units with"
            " `ZeroPPStrategy(auto_wrap_policy=...)`."
        )
    wrap_policy = module_policy(model, auto_wrap_policy, "auto_wrap_policy")
    targets = wrap_targets(model, wrap_policy, auto_wrap_policy) if wrap_policy else default_wrap_targets(model)
    # A nested target (a block inside a block) is sharded before its parent: reverse module order is bottom-up.
    order = {id(m): i for i, m in enumerate(model.modules())}
    targets.sort(key=lambda m: order[id(m)], reverse=True)

    ac_policy = module_policy(model, activation_checkpointing_policy, "activation_checkpointing_policy")
    if ac_policy is not None:
        for module in [m for m in model.modules() if m is not model and not isinstance(m, _CONTAINERS)]:
            if ac_policy(module):
                checkpoint_in_place(module)

    for module in targets:
        fully_shard(module, **kwargs)
    return _shard_root(model, targets, kwargs)


def _shard_root(model: nn.Module, targets: list[nn.Module], kwargs: dict) -> list[nn.Module]:
    # The steps run inside the root's forward with its hooks firing once (strategy._StepRedirection), so a
    # root that cast its inputs would cast the whole batch, labels included. The units below still cast theirs,
    # and bf16-mixed autocast covers the root's own layers.
    if not isinstance(model, FSDPModule):
        root_policy = dataclasses.replace(kwargs["mp_policy"], cast_forward_inputs=False)
        fully_shard(model, **{**kwargs, "mp_policy": root_policy})
    return [*targets, model]


def refuse_fsdp1(model: nn.Module) -> None:
    """Raises TypeError if ``model`` holds modules wrapped by FSDP1 (``FullyShardedDataParallel``): each rank's flat
    shard would be taken for a whole parameter and sharded again, and every rank would train something different."""
    wrapped = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]
    if wrapped:
        raise TypeError(
            f"ZeroPPStrategy: the model holds modules already wrapped with FSDP1's FullyShardedDataParallel"
            f" ({', '.join(wrapped[:4])}{', ...' if len(wrapped) > 4 else ''}). ZeroPPStrategy shards the plain"
            " model itself (on FSDP2): pass the unwrapped model, and choose the units with `auto_wrap_policy`."
        )


def _check_user_units(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool | int) -> list[nn.Module]:
    """The modules a user's ``parallelize_fn`` sharded (root excluded), after checking that each was sharded over the
    strategy's mesh with its ``reshard_after_forward`` (the hpZ partition size when hpZ is on)."""
    refuse_fsdp1(model)
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError(
            "ZeroPPStrategy: `parallelize_fn` returned a model without any module sharded with `fully_shard`. Call"
            " `fully_shard(block, mesh=device_mesh, reshard_after_forward=strategy.reshard_after_forward)` on the"
            " units you choose, or pass no `parallelize_fn` to shard the blocks by default."
        )
    shards = mesh.size(mesh.ndim - 1)  # all ranks; HSDP: the ranks of a node
    want = shards if reshard_after_forward is True else int(reshard_after_forward)
    for name, module in units:
        shard_size, post_forward = unit_mesh_sizes(module)
        if shard_size is None:
            continue  # manages no parameter of its own
        if shard_size != shards or post_forward != want:
            over = f"all {shards} ranks" if mesh.ndim == 1 else f"the {shards} ranks of each node (HSDP)"
            raise ValueError(
                f"ZeroPPStrategy: `parallelize_fn` sharded {name or '<root>'!r} over {shard_size} ranks keeping"
                f" {'whole weights' if post_forward is None else f'1/{post_forward} of the weights'} after forward;"
                f" this strategy shards over {over} and keeps 1/{want}. Call"
                " `fully_shard(module, mesh=device_mesh, reshard_after_forward=strategy.reshard_after_forward)`."
            )
    return [m for name, m in units if m is not model]
