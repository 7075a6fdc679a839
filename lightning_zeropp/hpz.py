"""hpZ: a secondary weight partition inside each node, so the backward all-gather stays inside the node.

FSDP2 already has the mechanism: ``fully_shard(reshard_after_forward=R)`` keeps, after a module's forward, a 1/R
slice of the *unsharded* weights on each rank, and the backward all-gather then runs among R consecutive ranks
instead of the whole world. With R = ranks per node (or a divisor of it) those R ranks share a node; other R are
allowed, with a warning. Because the slice is cut from the forward's all-gather output, it holds exactly the
(dequantized, under qwZ) weights the forward used, so the secondary all-gather stays exact in the compute dtype:
re-quantizing it would cost accuracy and save no inter-node bytes.

The slice is dropped by FSDP at the end of every backward (root post-backward callback), before the optimizer
step changes the primary shards, so it can never go stale across steps.

With tensor parallelism FSDP2 cannot do this (its post-forward reshard refuses DTensor parameters, and it would build
the smaller mesh's groups on the ranks of one tensor-parallel position only), so the strategy keeps the slice itself
(:class:`SecondaryCopies`): modules reshard fully after forward, as ModelParallelStrategy's ``configure_model`` shards
them; the forward all-gather's hook keeps this rank's 1/R of its output, and the backward all-gather's hook, which
FSDP issues on the whole data-parallel group, gathers the R slices inside the hpZ group instead. Same bytes, same
memory, same values as FSDP's int ``reshard_after_forward``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .compat.torch import call_after_backward
from .ledger import CommLedger


def secondary_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    ranks: list[int],
    ledger: CommLedger,
    async_op: bool,
) -> dist.Work | None:
    ledger.record_all_gather("weight_all_gather_secondary", ranks, input.numel() * input.element_size())
    return all_gather_flat(output, input, group, async_op)


class _KeepOnWait(dist.Work):
    """A Work that, once the forward all-gather finished, keeps this rank's slice of its output."""

    def __init__(self, inner: dist.Work, keep: Callable[[], None]) -> None:
        super().__init__()
        self._inner, self._keep = inner, keep

    def wait(self, timeout=None) -> bool:
        if self._keep is not None:
            self._inner.wait()
            self._keep()
            self._keep = None
        return True


class SecondaryCopies:
    """hpZ's secondary partition kept by the all-gather hooks (tensor parallelism: see the module's docstring).

    ``R`` consecutive data-parallel ranks form an hpZ group; FSDP's all-gather output holds the ``W`` ranks' padded
    shards in rank order, so the rank at index ``i`` of its group keeps the ``i``-th of ``R`` equal pieces of it, and
    the group's all-gather of those pieces, in group order, is the whole output again."""

    def __init__(self, partition_size: int, rank: int) -> None:
        self.partition_size, self.index = partition_size, rank % partition_size
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.Stream | None]] = {}
        self._drop_queued = False
        self.keeping = True

    def begin_forward(self, grad_enabled: bool) -> None:
        """A forward pass of the model begins: what was kept goes (the weights may have changed since), and pieces
        are kept only if a backward can follow (``grad_enabled``, read outside FSDP's gathers, which run under
        ``no_grad``)."""
        self.clear()
        self.keeping = grad_enabled

    def keep_after(self, work: dist.Work | None, output: torch.Tensor, key: object) -> dist.Work | None:
        """After the forward all-gather into ``output`` (``work``: its pending Work, None if done), keeps this
        rank's piece for ``key``'s (the unit's) backward all-gather; nothing in a forward without autograd."""
        if not self.keeping:
            return work
        piece = output.numel() // self.partition_size

        def keep() -> None:
            # on the stream current at ``wait()`` (FSDP orders its use of ``output`` after it); remembered, so that the
            # backward gather, on FSDP's all-gather stream, waits for the copy and the allocator keeps it till then
            made_on = torch.cuda.current_stream() if output.is_cuda else None
            mine = output.view(-1)[self.index * piece : (self.index + 1) * piece].clone()
            self._kept[(id(key), output.numel())] = (mine, made_on)

        if work is None:
            keep()
            return None
        return _KeepOnWait(work, keep)

    def take(self, output: torch.Tensor, key: object) -> torch.Tensor | None:
        """In backward: the piece kept for ``key``'s all-gather into ``output``, forgotten here (None if none was
        kept: a module gathered again in backward without a forward since, e.g. recomputed under activation
        checkpointing). Every piece left is dropped when this backward ends."""
        if not self._drop_queued:  # what no backward gather takes (a root that kept its weights) goes at its end too
            self._drop_queued = True
            call_after_backward(self.clear)
        found = self._kept.pop((id(key), output.numel()), None)
        if found is None:
            return None
        piece, made_on = found
        if made_on is not None and torch.cuda.current_stream() != made_on:
            torch.cuda.current_stream().wait_stream(made_on)
            piece.record_stream(torch.cuda.current_stream())
        return piece

    def clear(self) -> None:
        """Forgets every piece (a backward ended)."""
        self._kept.clear()
        self._drop_queued = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._kept.values())
