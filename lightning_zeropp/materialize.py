"""Materializing a sharded model whose tensors were created on the meta device (the big-model path).

A model built under ``trainer.init_module(empty_init=True)`` / ``fabric.init_module(empty_init=True)``, or on the meta
device inside ``configure_model``, holds no data. The strategy shards it first (``fully_shard`` keeps meta tensors
meta, so no rank ever allocates a whole parameter), then :func:`materialize_meta_tensors` allocates each rank's shards
on the device and initializes them with the modules' own ``reset_parameters()``.

What differs from Lightning's helper for ``ModelParallelStrategy``:

- Only meta tensors are replaced. Tensors that already hold data (a layer built outside the meta context, weights
  loaded before ``fit``) keep it: Lightning empties the whole model once any tensor is meta.
- ``reset_parameters`` runs on every module whose subtree holds a meta tensor, children before parents and the
  LightningModule (the root) last, so that a parent's initialization of its subtree (a GPT's scaled residual
  projections) wins over its children's defaults, as it does when the model is built on a real device. Lightning
  calls it only on modules that hold a tensor directly.
- Nothing is left uninitialized silently: floating-point tensors start as NaN, and any that still hold a NaN after
  every ``reset_parameters`` ran are refused by name, on every rank (each rank checks its own shards; one small
  all-reduce makes the verdict common). Integer and boolean tensors cannot be told apart that way: they need a
  ``reset_parameters`` on a module on their path from the root.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from torch import nn

from .compat.torch import replace_meta_tensors

__all__ = ["materialize_meta_tensors", "has_meta_tensors"]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _direct_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def materialize_meta_tensors(model: nn.Module, device: torch.device) -> list[str]:
    """Allocates every meta parameter and buffer of the (sharded) ``model`` on ``device`` and initializes it with
    ``reset_parameters()`` of every module whose subtree holds a meta tensor, children before parents (``model``
    itself last). Returns the names of the tensors it materialized. Raises ``ValueError`` naming the tensors no
    ``reset_parameters`` initialized. Collective when the default process group exists (every rank must call it)."""
    owners: dict[str, nn.Module] = {}  # tensor name -> the module that holds it directly
    for prefix, module in model.named_modules():
        for name, t in _direct_tensors(module):
            if t.is_meta:
                owners.setdefault(f"{prefix}.{name}" if prefix else name, module)
    if not owners:
        return []
    # Children before parents, the root last: a parent's (or the LightningModule's) own initialization of its
    # subtree wins over its children's defaults, as when the model is built on a real device.
    resetting = [
        m
        for m in reversed(list(model.modules()))
        if callable(getattr(m, "reset_parameters", None)) and has_meta_tensors(m)
    ]
    covered = {id(m) for m in resetting}
    # Integer/bool tensors: no NaN tells whether they were set; a module on their path to the root must say how.
    unknowable = sorted(
        name
        for name in owners
        if not (_get(model, name).is_floating_point() or _get(model, name).is_complex())
        and not any(id(m) in covered for m in _path(model, name))
    )
    replace_meta_tensors(model, device)
    with torch.no_grad():
        for name in owners:
            t = _get(model, name)
            if t.is_floating_point() or t.is_complex():
                _local(t).fill_(math.nan)
        for module in resetting:
            module.reset_parameters()
    left = [name for name in owners if _holds_nan(_get(model, name))]
    left = _agreed(sorted(owners), left, device)
    problems = sorted(set(left) | set(unknowable))
    if problems:
        shown = ", ".join(problems[:8]) + (f", ... ({len(problems)} in all)" if len(problems) > 8 else "")
        classes = sorted({type(owners[n]).__name__ for n in problems})
        raise ValueError(
            f"ZeroPPStrategy: the model was built on the meta device (`init_module(empty_init=True)` or in"
            f" `configure_model`), and no `reset_parameters()` initialized these tensors: {shown}. Define"
            f" `reset_parameters()` on their modules ({', '.join(classes)}) or on the LightningModule (it runs last,"
            " after every submodule's), or build those layers outside the meta device."
        )
    return sorted(owners)


def _path(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules from ``model`` down to the one that holds the tensor ``name``."""
    modules, module = [model], model
    for part in name.split(".")[:-1]:
        module = module.get_submodule(part)
        modules.append(module)
    return modules


def _get(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attr)


def _holds_nan(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()):
        return False
    return bool(torch.isnan(_local(t)).any())


def _agreed(names: list[str], left: list[str], device: torch.device) -> list[str]:
    """The union over ranks of the uninitialized tensors (each rank sees only its own shards)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return left
    flags = torch.tensor([name in left for name in names], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [name for name, flag in zip(names, flags.tolist()) if flag]
