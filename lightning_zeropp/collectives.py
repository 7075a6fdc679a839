"""Flat collectives across torch versions, and the reduce ops FSDP2 passes."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 deprecates the *_into_tensor / *_tensor names; torch 2.11 and older lack the *_single ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op, async_op=False):
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


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
