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
from torch.distributed.tensor import DTensor

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
    already_sharded: str | None = None,
) -> list[nn.Module]:
    """Shards ``model`` in place; returns the sharded modules, root last.

    ``already_sharded``: where the user called ``fully_shard`` on the units they chose (Fabric's "`parallelize_fn`",
    the Trainer's "`configure_model`"), None if they did not; their units are checked against the strategy's layout
    (``mesh``, ``reshard_after_forward``), and the root is sharded if it is not yet.
    """
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mixed_precision_policy(precision),
        "offload_policy": offload_policy(cpu_offload),
    }
    if already_sharded is not None:
        for argument, chosen in (("auto_wrap_policy", auto_wrap_policy),
                                 ("activation_checkpointing_policy", activation_checkpointing_policy)):  # fmt: skip
            if chosen:
                raise ValueError(
                    f"ZeroPPStrategy: {already_sharded} called `fully_shard` on the units it chose, so `{argument}`"
                    f" would have no effect. Leave `{argument}` unset (apply activation checkpointing in"
                    f" {already_sharded}, before `fully_shard`), or let the strategy shard the model."
                )
        targets = _check_user_units(model, mesh, reshard_after_forward, already_sharded)
        return _shard_root(model, targets, kwargs)
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


def _check_user_units(
    model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool | int, where: str = "`parallelize_fn`"
) -> list[nn.Module]:
    """The modules the user sharded in ``where`` (root excluded), after checking that each was sharded over the
    strategy's mesh (with tensor parallelism its data-parallel dimension) with its ``reshard_after_forward`` (the hpZ
    partition size when hpZ is on)."""
    refuse_fsdp1(model)
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError(
            "ZeroPPStrategy: `parallelize_fn` returned a model without any module sharded with `fully_shard`. Call"
            " `fully_shard(block, mesh=device_mesh, reshard_after_forward=strategy.reshard_after_forward)` on the"
            " units you choose, or pass no `parallelize_fn` to shard the blocks by default."
        )
    fabric = where == "`parallelize_fn`"
    mesh_text = ("device_mesh" if fabric else "self.device_mesh") + (
        "['data_parallel']" if mesh.mesh_dim_names == ("data_parallel",) else ""
    )
    strategy = "strategy" if fabric else "self.trainer.strategy"
    shards = mesh.size(mesh.ndim - 1)  # all ranks; HSDP: the ranks of a node
    want = shards if reshard_after_forward is True else int(reshard_after_forward)
    for name, module in units:
        shard_size, post_forward = unit_mesh_sizes(module)
        if shard_size is None:
            continue  # manages no parameter of its own
        if shard_size != shards or post_forward != want:
            over = f"all {shards} ranks" if mesh.ndim == 1 else f"the {shards} ranks of each node (HSDP)"
            raise ValueError(
                f"ZeroPPStrategy: {where} sharded {name or '<root>'!r} over {shard_size} ranks keeping"
                f" {'whole weights' if post_forward is None else f'1/{post_forward} of the weights'} after forward;"
                f" this strategy shards over {over} and keeps 1/{want}. Call"
                f" `fully_shard(module, mesh={mesh_text}, reshard_after_forward={strategy}.reshard_after_forward)`."
            )
    return [m for name, m in units if m is not model]


def check_tensor_parallel(model: nn.Module, tensor_parallel_size: int, where: str) -> None:
    """With tensor parallelism, refuses a model none of whose parameters ``where`` split over the mesh's
    ``"tensor_parallel"`` dimension: each rank of a tensor-parallel group would hold and train the whole model on
    the same data, for nothing."""
    if tensor_parallel_size == 1:
        return
    for p in model.parameters():
        if isinstance(p, DTensor) and "tensor_parallel" in (p.device_mesh.mesh_dim_names or ()):
            return
    fix = (
        "apply parallelize_module(..., self.device_mesh['tensor_parallel'], plan) in configure_model"
        if where == "`configure_model`"
        else "apply parallelize_module(model, device_mesh['tensor_parallel'], plan) in parallelize_fn"
    )
    raise ValueError(
        f"ZeroPPStrategy: `tensor_parallel_size={tensor_parallel_size}`, but after {where} no parameter of the model"
        f" is split over the mesh's 'tensor_parallel' dimension; {fix}, or set tensor_parallel_size=1."
    )
