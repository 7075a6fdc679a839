"""torch's functional collectives as the dispatcher sees them: what a tensor-parallel plan's DTensors send.

DTensor redistributes (``Partial`` to ``Replicate``, ``Shard`` to ``Replicate``, ...) with the native functional
collectives, ``torch.ops._c10d_functional`` (a private namespace), on plain tensors. :class:`CollectiveWatch` is a
``TorchDispatchMode`` (private base class) that reports each of them, the way torch's public
``torch.distributed.tensor.debug.CommDebugMode`` counts them: an operator with a DTensor among its arguments is handed
back (``NotImplemented``) so that DTensor desugars it first, and the mode sees the collectives it issues. The mode only
looks: every operator runs as it would without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor

from .torch import TorchDispatchMode
from .versions import require

require(hasattr(torch._ops, "HigherOrderOperator"), "torch", "telling higher-order operators from collectives")


@dataclass(frozen=True, slots=True)
class Collective:
    """One functional collective, described without torch's operator names.

    Attributes:
        op: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``.
        group_name: the process group's ``group_name``.
        tensors: ``(numel, element_size)`` of each input (several for a coalesced call).
        splits: all-to-all only: the input's rows (dim 0) addressed to each member, in group order; empty: equal.
    """

    op: str
    group_name: str
    tensors: tuple[tuple[int, int], ...]
    splits: tuple[int, ...] = ()


def _name(group: Any) -> str:
    # torch 2.9 passes the group's name; 2.13's schemas also take the ProcessGroup itself ("Any group_name")
    return group if isinstance(group, str) else group.group_name


def _one(op: str) -> Callable[[tuple], Collective]:
    return lambda args: Collective(op, _name(args[-1]), ((args[0].numel(), args[0].element_size()),))


def _many(op: str) -> Callable[[tuple], Collective]:
    return lambda args: Collective(op, _name(args[-1]), tuple((t.numel(), t.element_size()) for t in args[0]))


def _all_to_all_single(args: tuple) -> Collective:
    # (input, output_split_sizes, input_split_sizes, group_name)
    x = args[0]
    return Collective("all_to_all", _name(args[-1]), ((x.numel(), x.element_size()),), tuple(int(s) for s in args[2]))


def _shard_dim_alltoall(args: tuple) -> Collective:
    # (input, gather_dim, shard_dim, group_name): DTensor pads the input so that every member's chunk is equal
    x = args[0]
    return Collective("all_to_all", _name(args[-1]), ((x.numel(), x.element_size()),))


def _table() -> dict[Any, Callable[[tuple], Collective]]:
    """Operator packet -> description, for the operators this torch has (older ones lack some)."""
    wanted = {
        ("_c10d_functional", "all_reduce"): _one("all_reduce"),
        ("_c10d_functional", "all_reduce_"): _one("all_reduce"),
        ("_c10d_functional", "all_reduce_coalesced"): _many("all_reduce"),
        ("_c10d_functional", "all_reduce_coalesced_"): _many("all_reduce"),
        ("_c10d_functional", "all_gather_into_tensor"): _one("all_gather"),
        ("_c10d_functional", "all_gather_into_tensor_out"): _one("all_gather"),
        ("_c10d_functional", "all_gather_into_tensor_coalesced"): _many("all_gather"),
        ("_c10d_functional", "reduce_scatter_tensor"): _one("reduce_scatter"),
        ("_c10d_functional", "reduce_scatter_tensor_out"): _one("reduce_scatter"),
        ("_c10d_functional", "reduce_scatter_tensor_coalesced"): _many("reduce_scatter"),
        ("_c10d_functional", "all_to_all_single"): _all_to_all_single,
        # the autograd-aware variants: seen here when called directly; their inner native call is then not seen
        # (the mode is off while it runs an operator), so each collective is counted once
        ("_c10d_functional_autograd", "all_gather_into_tensor"): _one("all_gather"),
        ("_c10d_functional_autograd", "reduce_scatter_tensor"): _one("reduce_scatter"),
        ("_c10d_functional_autograd", "all_to_all_single"): _all_to_all_single,
        # DTensor's Shard(i) -> Shard(j) on a backend with all-to-all (on gloo it all-gathers with the ops above)
        ("_dtensor", "shard_dim_alltoall"): _shard_dim_alltoall,
    }
    table = {}
    for (namespace, name), describe in wanted.items():
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            table[packet] = describe
    return table


_CORE_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
require(
    all(hasattr(torch.ops._c10d_functional, n) for n in _CORE_OPS),
    "torch",
    "counting tensor-parallel collectives (torch.ops._c10d_functional)",
)


require(hasattr(distributed_c10d, "_resolve_process_group"), "torch", "finding a process group by its name")


def group_ranks(group_name: str) -> list[int]:
    """The ranks (as the job numbers them) of the live process group named ``group_name``. Needed because a mesh's
    group is not always the one the model's DTensors use: a DeviceMesh built later over the same ranks (FSDP2's 2-D
    mesh of a tensor-parallel model) can take an earlier group of those ranks (another strategy's, in the same
    process), under another name."""
    return dist.get_process_group_ranks(distributed_c10d._resolve_process_group(group_name))


class CollectiveWatch(TorchDispatchMode):
    """While entered (``with watch:``), calls ``seen(collective)`` after each functional collective has run.

    Args:
        seen: receives a :class:`Collective` per call, on any group (the caller picks its own by ``group_name``).
    """

    def __init__(self, seen: Callable[[Collective], None]) -> None:
        super().__init__()
        self.seen = seen
        self.table = _table()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):  # no operator packet, never a collective
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first: its redistributions come back here as plain-tensor collectives
        out = func(*args, **kwargs)
        describe = self.table.get(func.overloadpacket)
        if describe is not None:
            self.seen(describe(args))
        return out
