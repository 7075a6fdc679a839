"""Flat collectives (one buffer per rank), the reduce ops FSDP2 passes, and agreeing on failure."""

from __future__ import annotations

import builtins

import torch
import torch.distributed as dist

from .compat.torch import all_gather_single, reduce_scatter_single


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    return all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op, async_op=False):
    return reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def split_reduce_op(op, divide_factor: float | None = None) -> tuple[dist.ReduceOp.RedOpType, float | None]:
    """``(AVG | SUM, premultiplier or None)`` for an op FSDP passes: AVG, SUM or PREMUL_SUM(factor). FSDP makes its
    PREMUL_SUM from the module's gradient divide factor (1 / factor); where the op object does not expose its factor
    (torch 2.9's NCCL-made op), ``divide_factor``, read from the module, gives it."""
    kind = getattr(op, "op", op)  # PREMUL_SUM(factor) is a ReduceOp object holding .op and .factor
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None and divide_factor is not None:
            factor = 1.0 / divide_factor
        if factor is None:
            raise ValueError("ZeroPPStrategy: got ReduceOp.PREMUL_SUM without a factor; cannot reduce gradients.")
        return dist.ReduceOp.SUM, float(factor)
    if kind in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return kind, None
    raise ValueError(f"ZeroPPStrategy: FSDP asked for a gradient reduction with {op}; only AVG, SUM, PREMUL_SUM work.")


def agree_or_raise(error: BaseException | None, context: str | None = None, after: str = "") -> None:
    """Collective: every rank passes the error it hit, or None. Returns on every rank when none failed; otherwise
    every rank raises, so no rank is left waiting in the next collective.

    A failing rank raises its own error, the others an error of the same type (RuntimeError when that type is not a
    built-in one nor defined in this package) with the first failing rank's message. Without ``context`` the
    message is the error's own, followed by the failing rank; with it, ``"{context} failed on rank r (Type:
    message). {after}"``, raised as RuntimeError on every rank, from the rank's own error where it has one.
    """
    mine = None if error is None else (type(error).__module__, type(error).__qualname__, str(error))
    everyone = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    failed = [(rank, e) for rank, e in enumerate(everyone) if e is not None]
    if not failed:
        return
    rank, (module, name, text) = failed[0]
    if context is not None:
        raise RuntimeError(f"{context} failed on rank {rank} ({name}: {text}). {after}".rstrip()) from error
    if error is not None:
        raise error
    raise _rebuild(module, name)(f"{text} (on rank {rank})")


def _rebuild(module: str, name: str) -> type[Exception]:
    """The exception class a rank reported, when it can be rebuilt from its message alone."""
    if module == "builtins":
        found = getattr(builtins, name, None)
    elif module.split(".")[0] == __name__.split(".")[0]:
        import importlib

        found = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part, None)
    else:
        found = None
    return found if isinstance(found, type) and issubclass(found, Exception) else RuntimeError
