"""The objects FSDP2 calls for a sharded module's all-gather and reduce-scatter (its custom-collective hooks).

FSDP2 calls ``AllGather.__call__(output, input, group, async_op)`` with ``input`` aliasing this rank's slot of
``output`` (an in-place all-gather of one flat buffer holding every parameter's padded shard), and
``ReduceScatter.__call__(output, input, group, op)`` with ``input`` laid out as world-size equal chunks in rank
order. ``allocate`` must hand out fresh memory: the reduce-scatter output becomes ``param.grad``'s storage.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .blocks import UnitBlocks
from .comm import ZeroPPComms
from .compat.torch import AllGather, ReduceScatter


class _OnComms:
    """Both hooks of one sharded unit: calls go to the model's :class:`ZeroPPComms` with the unit's blocks; buffers
    are fresh memory, never reused."""

    def __init__(self, comms: ZeroPPComms, unit: UnitBlocks) -> None:
        self.comms = comms
        self.unit = unit

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class ZeroPPAllGather(_OnComms, AllGather):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        return self.comms.all_gather(output_tensor, input_tensor, group, async_op, self.unit)


class ZeroPPReduceScatter(_OnComms, ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ) -> None:
        # Synchronous whatever ``async_op`` says (FSDP2 never asks for async): the output is complete on return.
        self.comms.reduce_scatter(output_tensor, input_tensor, group, op, self.unit)


def install(model: torch.nn.Module, comms: ZeroPPComms) -> list[UnitBlocks]:
    """Routes the collectives of every ``FSDPModule`` in ``model`` through ``comms``, each with its unit's blocks
    (the unit is named by its module path, which also keys its error feedback residual in checkpoints); returns
    the units, in module order."""
    units = []
    plan = comms.plan
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            unit = UnitBlocks(module, name, aligned=plan.aligned, weight_block_size=plan.forward.block_size,
                              gradient_block_size=plan.gradients.block_size)  # fmt: skip
            units.append(unit)
            module.set_custom_all_gather(ZeroPPAllGather(comms, unit))
            module.set_custom_reduce_scatter(ZeroPPReduceScatter(comms, unit))
            if plan.native_all_reduce:  # FSDP all-reduces across nodes itself; the hook, run after, records it
                module.set_all_reduce_hook(comms.all_reduced)
            elif plan.gradients.quantized_rail and comms.topology.ranks_per_node == 1:  # no reduce-scatter call
                module.set_all_reduce_hook(functools.partial(comms.reduce_alone_on_rail, unit))
    return units
