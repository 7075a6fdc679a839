"""torch symbols that are private or changed between the versions lightning-zeropp supports (torch >= 2.9).

Everything else in the package uses torch's public API only (``tests/test_private_api.py`` checks that). Each symbol
here is looked up when this module is imported; a torch without it fails at import with the symbol, the installed
version and the supported range, not later in the middle of a training step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .versions import TORCH_VERSION, require

# FSDP2's communication extension points (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch
# 2.9) take objects of these classes; torch keeps them in a private module.
require(TORCH_VERSION >= (2, 9), "torch", "FSDP2's custom all-gather and reduce-scatter hooks")
# In-place activation checkpointing that keeps parameter names unchanged (the wrapper class would add a prefix).
from torch.distributed._composable import checkpoint as _checkpoint_in_place  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: E402

# Multi-tensor element-wise ops: one launch for a list of tensors on a GPU (torch.optim's foreach path uses them);
# the second-moment correction lowers a unit's parameters with them.
foreach_addcmul = torch._foreach_addcmul
foreach_mul_ = torch._foreach_mul_
foreach_minimum_ = torch._foreach_minimum_
foreach_sub_ = torch._foreach_sub_
foreach_norm = torch._foreach_norm
# FSDP2 over a tensor-parallel plan places a parameter sharded twice along one dim as (_StridedShard, Shard): the
# tensor-parallel split first, then FSDP's split of each piece (DTensor keeps that placement class private); and a
# mode that sees every operator dispatched (the benchmarks count the correction's with it).
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def strided_shard_factor(placement: object) -> int | None:
    """For a ``_StridedShard`` placement (sharded after ``split_factor`` splits by later mesh dims along its dim): its
    split factor; None for any other placement."""
    return placement.split_factor if isinstance(placement, _StridedShard) else None


# torch 2.13 deprecates the *_into_tensor / *_tensor names; torch 2.11 and older lack the *_single ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "AllGather",
    "ReduceScatter",
    "ForwardHooks",
    "TorchDispatchMode",
    "foreach_addcmul",
    "foreach_minimum_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sub_",
    "all_gather_single",
    "checkpoint_in_place",
    "in_backward",
    "live_process_groups",
    "reduce_scatter_single",
    "replace_meta_tensors",
    "reset_function",
    "unit_parameters",
    "unit_versions",
]


require(hasattr(torch._C, "_current_graph_task_id"), "torch", "telling FSDP2's backward re-gather from forward's")


def in_backward() -> bool:
    """Whether the caller runs inside autograd's backward pass (a graph task is executing)."""
    return torch._C._current_graph_task_id() != -1


def call_after_backward(callback: Callable[[], None]) -> None:
    """Calls ``callback`` when the running backward ends, after FSDP2's own end-of-backward work (queued before it,
    at the backward's start); at once where no backward runs."""
    if in_backward():
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    else:
        callback()


def checkpoint_in_place(module: nn.Module) -> None:
    """Recomputes ``module``'s activations in backward, without renaming its parameters."""
    _checkpoint_in_place(module)


class ForwardHooks:
    """The forward hooks of one module, split into the ones added between this object's creation and
    :meth:`keep_added` (FSDP2's root hooks, registered by ``fully_shard``, and the strategy's) and all the others
    (the user's), with a switch between the two sets.

    ``nn.Module`` keeps its hooks in private ordered dicts; a module call copies them into a tuple before it runs the
    pre-hooks, and reads the forward hooks again after ``forward`` returns, so switching sets in the middle of a call
    (from a pre-hook or from inside ``forward``) changes which forward hooks that call runs.
    """

    _DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")  # fmt: skip

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._before = {name: set(getattr(module, name, {})) for name in self._DICTS}
        self._added: dict[str, set[int]] = {name: set() for name in self._DICTS}
        self._saved: dict[str, OrderedDict] | None = None

    def keep_added(self) -> None:
        """The forward hooks added to the module since this object was made become the recorded set."""
        for name in self._DICTS:
            self._added[name] |= set(getattr(self.module, name, {})) - self._before[name]

    @property
    def selecting(self) -> bool:
        """Whether :meth:`only_recorded` is active."""
        return self._saved is not None

    def _absorb(self) -> None:
        """Hooks registered while a subset was installed join the saved full set."""
        assert self._saved is not None
        for name, hooks in self._saved.items():
            current = getattr(self.module, name)
            if current is not hooks:
                hooks.update((k, v) for k, v in current.items() if k not in hooks)

    def _select(self, added: bool) -> None:
        self._absorb()
        assert self._saved is not None
        for name, hooks in self._saved.items():
            kept = OrderedDict((k, v) for k, v in hooks.items() if (k in self._added[name]) == added)
            setattr(self.module, name, kept)

    @contextmanager
    def only_recorded(self) -> Iterator[None]:
        """Inside: the module's calls run only the recorded hooks, until :meth:`switch_to_others`."""
        self._saved = {name: getattr(self.module, name) for name in self._DICTS if hasattr(self.module, name)}
        self._select(True)
        try:
            yield
        finally:
            self._absorb()
            for name, hooks in self._saved.items():
                setattr(self.module, name, hooks)
            self._saved = None

    def switch_to_others(self) -> None:
        """Inside :meth:`only_recorded`: from now on the module's calls run every hook but the recorded ones."""
        self._select(False)

    def switch_to_recorded(self) -> None:
        self._select(True)


_probe = nn.Module()
require(all(isinstance(getattr(_probe, n, None), dict) for n in ForwardHooks._DICTS), "torch", "nn.Module's hooks")


def unit_parameters(module: nn.Module) -> list[tuple[int, bool]]:
    """Per parameter a sharded module (``fully_shard``) manages, in the order of its flat all-gather and
    reduce-scatter buffers: the padded shard's element count (its length in every rank's chunk) and whether it
    takes gradients. FSDP2 keeps this in its private parameter group."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:  # a module that manages no parameter of its own (all in sharded children)
        return []
    return [(p.padded_sharded_param_size.numel(), p.sharded_param.requires_grad) for p in group.fsdp_params]


def unit_fsdp_parameters(module: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """For a sharded module: per parameter it manages that takes gradients, in the order of its reduce-scatter
    chunk, the sharded parameter (the one the optimizer holds) and its padded shard's element count (its length in
    every rank's chunk; the shard's own elements come first)."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return []
    return [(p.sharded_param, p.padded_sharded_param_size.numel()) for p in group.fsdp_params
            if p.sharded_param.requires_grad]  # fmt: skip


def unit_mesh_sizes(module: nn.Module) -> tuple[int | None, int | None]:
    """For a sharded module: the number of ranks its parameters are sharded over, and over how many ranks it keeps
    them after forward (``None``: it keeps whole weights); ``(None, None)`` if it manages no parameter itself."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return None, None
    post = group.post_forward_mesh_info
    return group.mesh_info.shard_mesh_size, (None if post is None else post.shard_mesh_size)


def unit_gradient_divide_factor(module: nn.Module) -> float | None:
    """For a sharded module: the factor set by ``set_gradient_divide_factor`` (FSDP then divides the gradients' sum by
    it, over its own mesh's reduction), or None (FSDP averages over its mesh)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return None if group is None else group.gradient_divide_factor


def unit_versions(module: nn.Module) -> tuple[tuple[int, int], ...]:
    """For a sharded module: per parameter it manages, ``(id, version)`` of its sharded parameter. The version counter
    (``Tensor._version``) counts in-place writes (an optimizer step, ``copy_`` under ``no_grad``, ``load_state_dict``,
    a distributed checkpoint load); writes through ``param.data`` bypass it. ``()`` if it manages no parameter."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return ()
    return tuple((id(p.sharded_param), p.sharded_param._version) for p in group.fsdp_params)


def _probe_unit_parameters() -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    require(hasattr(FSDPModule, "_get_fsdp_state"), "torch", "reading a sharded module's parameter layout")
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    require("gradient_divide_factor" in FSDPParamGroup.__init__.__code__.co_names, "torch",
            "reading a sharded module's gradient divide factor (FSDPParamGroup.gradient_divide_factor)")  # fmt: skip
    require(
        "padded_sharded_param_size" in getattr(FSDPParam, "__annotations__", {}),
        "torch",
        "reading a sharded module's parameter layout (FSDPParam.padded_sharded_param_size)",
    )


_probe_unit_parameters()


def replace_meta_tensors(module: nn.Module, device: torch.device) -> None:
    """Gives every meta parameter and buffer of ``module`` uninitialized storage on ``device`` (``to_empty`` for the
    meta tensors alone: the others keep their data). Called on the sharded root: FSDP2's ``FSDPModule._apply``
    re-points its parameter groups at the new shards."""
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


# torch.nn modules whose constructor initializes their own tensors with a private ``_reset_parameters()`` and that
# have no public ``reset_parameters`` (torch 2.9 - 2.13: these two). A model built on the meta device calls it when it
# materializes them, as the constructor does; without it their projections would stay uninitialized.
PRIVATE_RESETS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.Transformer)
require(
    all(callable(getattr(c, "_reset_parameters", None)) for c in PRIVATE_RESETS),
    "torch",
    "initializing nn.MultiheadAttention and nn.Transformer built on the meta device (their _reset_parameters)",
)


def reset_function(module: nn.Module) -> Callable[[], None] | None:
    """What initializes ``module``'s own tensors as its constructor does: its ``reset_parameters()``, or for the
    torch.nn modules that only have a private one (:data:`PRIVATE_RESETS`), that; ``None`` if it has neither."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    if isinstance(module, PRIVATE_RESETS):
        return module._reset_parameters
    return None


def live_process_groups() -> int:
    """The process groups this process holds now (the default group included): a leak shows as a growing count."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map) if dist.is_initialized() else 0
