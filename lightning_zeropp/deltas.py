"""Weight deltas: the node's copy of the weights kept across steps, updated by INT4 deltas of what the step changed.

hpZ already holds a full copy of each unit's weights per hpZ group (one per node), split over its R ranks, between
a unit's forward and its backward. With ``weight_deltas`` that copy stays alive across steps, outside FSDP's
buffers, in the compute dtype, and the forward all-gather is built from it inside the hpZ group (exact, intra-node)::

    FSDP's forward all-gather output: W primary shards         [ s0 | s1 | s2 | s3 | s4 | s5 | s6 | s7 ]   W = 8
    node copy, R = 4 slices of G = W / R = 2 shards each        [ rank 0  | rank 1  | rank 2  | rank 3  ]  node 0
                                                                [ rank 4  | rank 5  | rank 6  | rank 7  ]  node 1

Shard ``s`` (owned by rank ``s``) lives in slice ``s // G`` of every hpZ group: one holder per node. After an
optimizer step its owner quantizes ``w - tracked`` to INT4 per parameter-aligned block and sends it to those G
holders only (one all-to-all over the world, empty for every other pair of ranks); the holders and the owner add the
dequantized delta to their copy (``tracked``: the owner's record of what the holders hold, so rounding errors never
accumulate: each step sends what is still missing). Every holder applies the same bytes with the same arithmetic,
so every node's copy is bit-identical, and the forward's intra-node all-gather gives every rank of a node the same
weights.

When the copy is rebuilt exactly (a refresh: each owner sends its shard itself, in the compute dtype):

- the first forward, and every ``weight_delta_refresh`` optimizer steps (0: never);
- whenever a unit's parameters changed other than by an optimizer step run through the strategy: a checkpoint load,
  a callback swapping EMA weights in or out, ``load_state_dict``, an optimizer stepped behind the strategy's back.
  Each parameter's version counter (bumped by every in-place write) tells; writes through ``param.data`` bypass it
  and are not seen (call :meth:`WeightDeltas.invalidate`, ``strategy.refresh_weight_copies()``, after those).

Which of skip (nothing changed: the copy serves as is), delta or refresh a unit takes must be the same on every rank
(their collectives must match): the root's forward pre-hook agrees on it for all units in one small ``all_reduce``
(MAX) per forward pass. The backward all-gather is hpZ's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import kernels as tk
from .blocks import UnitBlocks
from .collectives import all_gather_flat
from .commplan import ForwardGather
from .compat.torch import unit_versions
from .ledger import CommLedger
from .topology import ProcessGroups, Topology

SKIP, DELTA, REFRESH = 0, 1, 2
_NAMES = {SKIP: "skip", DELTA: "delta", REFRESH: "refresh"}


@dataclass(slots=True)
class _UnitCopy:
    """One unit's part of the node copy on this rank, and what is known about how it relates to the weights."""

    slice: torch.Tensor | None = None  # this rank's slice: G primary shards, compute dtype
    tracked: torch.Tensor | None = None  # what the holders hold of this rank's own shard (sender side)
    synced: tuple | None = None  # parameter versions the copy was last brought up to date with
    stepped: tuple | None = None  # versions after optimizer steps that started from a known state
    stale: bool = False  # the weights changed outside an optimizer step since the last update
    period: int = 0  # refresh period of the last refresh
    agreed: int | None = None  # what every rank agreed this unit does at its next forward all-gather
    error: tuple[torch.Tensor, torch.Tensor] | None = None  # |w - tracked|^2, |w|^2 (fp32) at the last update


class WeightDeltas:
    """The node copies of one model's units on this rank, and the exchange that keeps them up to date.

    Args:
        forward: the job plan's forward gather from the node copy (``node_copy``): the deltas' bits per element, their
            block size and the refresh period.
        topology: the job's ranks (W, and R per hpZ group).
        ledger: where the exchanges are recorded.
        backend: the kernels'.
    """

    def __init__(self, forward: ForwardGather, topology: Topology, ledger: CommLedger, backend: str = "auto") -> None:
        self.forward = forward
        self.backend = backend
        self.topology = topology
        self.ledger = ledger
        self.refresh_every = forward.refresh
        self._copies: dict[str, _UnitCopy] = {}
        W, R = topology.world_size, topology.hpz_partition_size
        self.groups_of_holders = G = W // R
        me = topology.rank
        self.holders = [g * R + me // G for g in range(G)]  # who keeps my shard: one per hpZ group, ascending
        position = me % R
        self.owners = [position * G + k for k in range(G)]  # whose shards my slice holds, in slice order
        self.counts: dict[str, int] = {"skip": 0, "delta": 0, "refresh": 0}  # forward all-gathers by what they did

    # ----------------------------------------------------------------- what changed
    def _copy(self, unit: UnitBlocks) -> _UnitCopy:
        return self._copies.setdefault(unit.name, _UnitCopy())

    def _period(self, step: int) -> int:
        return step // self.refresh_every if self.refresh_every else 0

    def local_code(self, unit: UnitBlocks, step: int) -> int:
        """What this rank would do at ``unit``'s next forward all-gather, from what it knows alone (``step``: the
        optimizer steps taken so far, which set the refresh period)."""
        copy = self._copy(unit)
        if copy.slice is None or copy.stale or copy.period != self._period(step):
            return REFRESH
        versions = unit_versions(unit.module)
        if versions == copy.synced:
            return SKIP
        if versions == copy.stepped:
            return DELTA
        return REFRESH

    def agree(self, units: list[UnitBlocks], group: dist.ProcessGroup, device: torch.device, step: int) -> None:
        """Collective: every rank takes, per unit, the largest of the ranks' codes (refresh > delta > skip), so all
        run the same collectives; any code is correct for a unit whose weights did not change, skip only for one
        whose weights changed on no rank."""
        if not units:
            return
        codes = torch.tensor([self.local_code(u, step) for u in units], dtype=torch.uint8, device=device)
        ranks = list(range(self.topology.world_size))
        self.ledger.record_small_all_reduce("weight_delta_all_reduce", ranks, codes.numel())
        dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=group)
        for unit, code in zip(units, codes.tolist(), strict=True):
            self._copy(unit).agreed = int(code)

    def before_update(self, units: list[UnitBlocks]) -> None:
        """Right before an optimizer step changes the weights: a unit changed since the copy was synced (or since
        the last optimizer step) by anything else gets refreshed."""
        for unit in units:
            copy = self._copy(unit)
            copy.agreed = None
            if copy.slice is not None and unit_versions(unit.module) not in (copy.synced, copy.stepped):
                copy.stale = True

    def after_update(self, units: list[UnitBlocks]) -> None:
        """Right after an optimizer step: the units' weights now differ from the copy by what the step did."""
        for unit in units:
            copy = self._copy(unit)
            if not copy.stale:
                copy.stepped = unit_versions(unit.module)

    def invalidate(self) -> None:
        """Every unit's next forward all-gather refreshes the copy exactly (after a change the version counters
        cannot see, such as an in-place write through ``param.data``)."""
        for copy in self._copies.values():
            copy.stale = True
            copy.agreed = None

    # ----------------------------------------------------------------- the forward all-gather
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, unit: UnitBlocks, groups: ProcessGroups, step: int
    ) -> None:
        """FSDP's forward all-gather of ``unit``: brings this rank's slice of the node copy up to date (skip, delta or
        refresh, as agreed), then gathers the slices of the hpZ group into ``output``."""
        copy = self._copy(unit)
        code = copy.agreed if copy.agreed is not None else self.local_code(unit, step)
        copy.agreed = None
        if copy.slice is not None and copy.slice.device != input.device:  # restored from a checkpoint on the CPU
            copy.slice, copy.tracked = copy.slice.to(input.device), _to(copy.tracked, input.device)
        S, G = input.numel(), self.groups_of_holders
        if copy.slice is None or copy.slice.numel() != G * S or copy.slice.dtype != input.dtype:
            code = REFRESH  # the shapes and dtype are the same on every rank: so is this
        versions = unit_versions(unit.module)
        if code == REFRESH:
            self._refresh(copy, input, groups)
            copy.period = self._period(step)
        elif code == DELTA:
            self._send_delta(copy, input, unit, groups)
        copy.synced, copy.stepped, copy.stale = versions, None, False
        self.counts[_NAMES[code]] += 1
        assert copy.slice is not None
        # ``input`` aliases this rank's slot of ``output``: everything above read it before this overwrites it.
        hpz_ranks = groups.ranks("hpz")
        self.ledger.record_all_gather(
            "weight_all_gather_node_copy", hpz_ranks, copy.slice.numel() * copy.slice.element_size()
        )
        all_gather_flat(output, copy.slice, groups.group("hpz"))

    def _splits(self, nbytes: int) -> tuple[list[int], list[int]]:
        W = self.topology.world_size
        holders, owners = set(self.holders), set(self.owners)
        send = [nbytes if r in holders else 0 for r in range(W)]
        recv = [nbytes if r in owners else 0 for r in range(W)]
        return send, recv

    def _exchange(self, kind: str, payload: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
        """Sends the uint8 ``payload`` to each holder of this rank's shard; returns the G payloads this rank's slice
        is made of, as ``(G, payload bytes)`` in slice order."""
        G, nbytes = self.groups_of_holders, payload.numel()
        send_splits, recv_splits = self._splits(nbytes)
        send = payload.repeat(G)
        recv = torch.empty(G * nbytes, dtype=torch.uint8, device=payload.device)
        self.ledger.record_to_peers(kind, list(range(self.topology.world_size)), send_splits)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=groups.world)
        return recv.view(G, nbytes)

    def _refresh(self, copy: _UnitCopy, input: torch.Tensor, groups: ProcessGroups) -> None:
        S, G = input.numel(), self.groups_of_holders
        received = self._exchange("weight_delta_refresh", input.contiguous().view(torch.uint8), groups)
        if copy.slice is None or copy.slice.numel() != G * S or copy.slice.dtype != input.dtype:
            copy.slice = torch.empty(G * S, dtype=input.dtype, device=input.device)
            copy.tracked = torch.empty(S, dtype=input.dtype, device=input.device)
        copy.slice.view(torch.uint8).copy_(received.view(-1))
        assert copy.tracked is not None
        copy.tracked.copy_(input)
        norm = input.float().square().sum()
        copy.error = (torch.zeros_like(norm), norm)

    def _send_delta(self, copy: _UnitCopy, input: torch.Tensor, unit: UnitBlocks, groups: ProcessGroups) -> None:
        assert copy.slice is not None and copy.tracked is not None
        S, G = input.numel(), self.groups_of_holders
        blocks = unit.weights(S)
        bits, block, backend = self.forward.bits, self.forward.block_size, self.backend
        packed = tk.quantize(input.float() - copy.tracked.float(), bits, block, blocks=blocks, backend=backend)
        received = self._exchange("weight_delta_all_to_all", packed, groups).view(G, -1)
        # Holders and owner do the same arithmetic on the same bytes: fp32 sum, rounded once to the compute dtype; one
        # shard at a time, so the fp32 temporaries are a shard's, not the node copy's.
        mine = tk.dequantize(packed.view(1, -1), S, bits, block, torch.float32, blocks=blocks, backend=backend)
        _add_into(copy.tracked.view(1, S), mine)
        del mine
        for g, row in enumerate(received):
            theirs = tk.dequantize(row.view(1, -1), S, bits, block, torch.float32, blocks=blocks, backend=backend)
            _add_into(copy.slice.view(G, S)[g : g + 1], theirs)
        exact = input.float()
        copy.error = ((exact - copy.tracked.float()).square().sum(), exact.square().sum())

    # ----------------------------------------------------------------- reporting
    def nbytes(self) -> dict[str, int]:
        """Persistent memory on this rank: the node copy's slices (M / R elements over the model) and the tracked
        copies of this rank's own shards (M / W)."""
        copies = self._copies.values()
        node = sum(c.slice.numel() * c.slice.element_size() for c in copies if c.slice is not None)
        tracked = sum(c.tracked.numel() * c.tracked.element_size() for c in copies if c.tracked is not None)
        return {"node_copy": node, "tracked_copy": tracked}

    def error(self) -> tuple[float, float]:
        """``(|w - w_fwd|^2, |w|^2)`` summed over this rank's shards of every unit at its last update: ``w`` the
        weights, ``w_fwd`` what every forward pass uses of them since (the node copy holds exactly ``tracked``).
        The relative error over the model is the square root of the ratio of the two sums over all ranks."""
        pairs = [c.error for c in self._copies.values() if c.error is not None]
        if not pairs:
            return 0.0, 0.0
        return float(sum(e for e, _ in pairs)), float(sum(n for _, n in pairs))

    def node_copy(self, unit_name: str) -> torch.Tensor | None:
        """This rank's slice of a unit's node copy (for tests and inspection)."""
        copy = self._copies.get(unit_name)
        return None if copy is None else copy.slice

    def clear(self) -> None:
        self._copies.clear()

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self, units: list[UnitBlocks]) -> dict[str, Any]:
        """This rank's part of the node copies, by unit: its ``slice`` of the copy, the ``tracked`` copy of its own
        shard, the refresh ``period``, and how the copy relates to the weights now (``relation``: ``"synced"``, equal
        to them; ``"stepped"``, behind them by the last optimizer step, whose delta the next forward sends;
        ``"stale"``, to be refreshed); and the forward all-gathers' ``counts``."""
        saved: dict[str, Any] = {}
        for unit in units:
            copy = self._copies.get(unit.name)
            if copy is None or copy.slice is None or copy.tracked is None:
                continue
            versions = unit_versions(unit.module)
            relation = "stale"
            if not copy.stale and versions == copy.synced:
                relation = "synced"
            elif not copy.stale and versions == copy.stepped:
                relation = "stepped"
            saved[unit.name] = {
                "slice": copy.slice, "tracked": copy.tracked, "period": copy.period, "relation": relation,
            }  # fmt: skip
        return {"units": saved, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any], units: list[UnitBlocks]) -> None:
        """What :meth:`state_dict` returned, once the weights it was saved with are loaded into ``units``: a
        ``"synced"`` or ``"stepped"`` copy relates so to the weights as they are now; a unit without one is
        refreshed by its next forward."""
        self._copies.clear()
        saved = state["units"]
        for unit in units:
            if unit.name not in saved:
                continue
            entry = saved[unit.name]
            versions = unit_versions(unit.module)
            self._copies[unit.name] = _UnitCopy(
                slice=entry["slice"].clone(),
                tracked=entry["tracked"].clone(),
                synced=versions if entry["relation"] == "synced" else None,
                stepped=versions if entry["relation"] == "stepped" else None,
                stale=entry["relation"] == "stale",
                period=int(entry["period"]),
            )
        self.counts = {name: int(state["counts"].get(name, 0)) for name in self.counts}


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _add_into(copy: torch.Tensor, delta: torch.Tensor) -> None:
    """``copy += delta`` computed in fp32 and rounded once to ``copy``'s dtype (``delta`` is fp32)."""
    if copy.dtype == torch.float32:
        copy.add_(delta)
    else:
        copy.copy_(copy.float().add_(delta))
