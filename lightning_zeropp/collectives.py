"""Flat collectives (one buffer per rank) and the reduce ops FSDP2 passes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .compat.torch import all_gather_single, reduce_scatter_single


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    return all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op, async_op=False):
    return reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def split_reduce_op(op) -> tuple[dist.ReduceOp.RedOpType, float | None]:
    """``(AVG | SUM, premultiplier or None)`` for an op FSDP passes: AVG, SUM or PREMUL_SUM(factor)."""
    kind = getattr(op, "op", op)  # PREMUL_SUM(factor) is a ReduceOp object holding .op and .factor
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError("ZeroPPStrategy: got ReduceOp.PREMUL_SUM without a factor; cannot reduce gradients.")
        return dist.ReduceOp.SUM, float(factor)
    if kind in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return kind, None
    raise ValueError(f"ZeroPPStrategy: FSDP asked for a gradient reduction with {op}; only AVG, SUM, PREMUL_SUM work.")
