"""Counting the tensor-parallel collectives of the model's plan in the ledger (opt-in).

With ``tensor_parallel_size`` t > 1 the model's own plan (``parallelize_module`` on ``device_mesh["tensor_parallel"]``)
moves activations and their gradients between the t ranks of a group: DTensor's redistributions, in forward and
backward, as torch's native functional collectives. The strategy does not issue them, so its collectives never see
them; :class:`TensorParallelCounter` watches the dispatcher for them (:class:`~lightning_zeropp.compat.funcol.
CollectiveWatch`, as torch's ``CommDebugMode`` does), keeps those among this rank's tensor-parallel ranks and records
each as one of the ledger's :data:`~lightning_zeropp.ledger.TENSOR_PARALLEL_KINDS`, per peer with the ledger's
convention (:func:`peer_bytes`).

Off by default: a dispatch mode puts a Python call in front of every operator, which nobody should pay for unless
they read the numbers. The strategy enters the watch around the training step and its backward only while counting
is switched on (``ZeroPPStrategy.count_tensor_parallel_bytes()``; ``CommVolumeMonitor`` switches it on for its run).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from .compat.funcol import Collective, CollectiveWatch, group_ranks
from .ledger import CommLedger, all_reduce_chunks


def peer_bytes(collective: Collective, group_size: int, index: int) -> list[int]:
    """Bytes ``collective`` sends to each member of its group (``index``: this rank's position in it), with the
    ledger's convention: an all-gather, each input to every member; a reduce-scatter, each input's ``1 / group_size``
    chunk to its member; an all-to-all, each member's rows; an all-reduce, as HSDP's ``gradient_all_reduce`` is
    recorded (:func:`~lightning_zeropp.ledger.all_reduce_chunks`: a reduce-scatter in near-equal pieces, then this
    rank's piece to every member). Summed over the inputs of a coalesced call."""
    out = [0] * group_size
    for numel, size in collective.tensors:
        if collective.op == "all_reduce":
            chunks = all_reduce_chunks(numel, size, group_size, index)
        elif collective.op == "all_gather":
            chunks = [numel * size] * group_size
        elif collective.op == "reduce_scatter":  # the functional reduce-scatter takes equal chunks only
            chunks = [numel // group_size * size] * group_size
        elif collective.op == "all_to_all" and collective.splits:
            row = numel // max(sum(collective.splits), 1) * size
            chunks = [rows * row for rows in collective.splits]
        elif collective.op == "all_to_all":
            chunks = [numel // group_size * size] * group_size
        else:
            raise ValueError(f"peer_bytes: unknown collective {collective.op!r}")
        out = [a + b for a, b in zip(out, chunks, strict=True)]
    return out


class TensorParallelCounter:
    """Records the model's collectives on one tensor-parallel group in a ledger while :meth:`counting` is entered
    and :attr:`enabled` is set.

    Args:
        ledger: where the bytes go (as :data:`~lightning_zeropp.ledger.TENSOR_PARALLEL_KINDS`).
        group: this rank's tensor-parallel process group (``device_mesh["tensor_parallel"].get_group()``).
    """

    def __init__(self, ledger: CommLedger, group: dist.ProcessGroup) -> None:
        self.ledger = ledger
        self.ranks = dist.get_process_group_ranks(group)
        # group name -> whether it is a group of the tensor-parallel ranks: the mesh's own, and any other of the same
        # ranks the model's DTensors may use instead (see compat.funcol.group_ranks)
        self.groups = {group.group_name: True}
        self.index = self.ranks.index(ledger.topology.global_rank)
        self.watch = CollectiveWatch(self.record)
        self.enabled = False
        self.active = False

    def enable(self, enabled: bool) -> None:
        self.enabled = enabled
        self.ledger.counts_tensor_parallel = enabled

    def record(self, collective: Collective) -> None:
        """One collective the watch saw: recorded if it ran among this rank's tensor-parallel ranks."""
        ours = self.groups.get(collective.group_name)
        if ours is None:
            ours = self.groups[collective.group_name] = group_ranks(collective.group_name) == self.ranks
        if not ours:
            return
        chunks = peer_bytes(collective, len(self.ranks), self.index)
        self.ledger.record_tensor_parallel(f"tensor_parallel_{collective.op}", self.ranks, chunks)

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Watches the collectives run inside, if counting is enabled. Re-entered (a manual backward inside the
        training step) it watches once: a second watch on the mode stack would see every collective twice. Left on
        the way out whatever happens inside (an exception included)."""
        if not self.enabled or self.active:
            yield
            return
        self.active = True
        try:
            with self.watch:
                yield
        finally:
            self.active = False
