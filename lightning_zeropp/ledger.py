"""Communication ledger: the payload bytes each collective of the strategy sends, split by where the peer lives.

Accounting is logical and per peer, independent of the algorithm the backend picks:

- all-gather: this rank's buffer is sent once to every other member of the group;
- all-to-all and reduce-scatter: the chunk addressed to each other member is sent to it;
- all-reduce (exact, of a large buffer): as any algorithm must move it, a reduce-scatter of the buffer in one piece
  per member and an all-gather of this rank's piece: member ``i`` gets piece ``i`` plus this rank's piece
  (:func:`all_reduce_chunks`; HSDP's ``gradient_all_reduce``). A few bytes (a flag, counters) count as the buffer
  to every peer once (:meth:`CommLedger.record_small_all_reduce`).

So a ZeRO-3 vs ZeRO++ ratio read off the ledger is exact and repeatable. What a ring or tree algorithm actually
puts on a wire differs by a constant factor per algorithm; ``benchmarks/cluster.py`` measures that separately.

Data-parallel and tensor-parallel bytes are kept apart. :data:`KINDS` are the strategy's own (data-parallel)
collectives: the totals (``total()``, ``comm/inter_node_MB``, ...) and ``by_kind()`` count them alone, so ratios and
the planner's predictions keep their meaning. :data:`TENSOR_PARALLEL_KINDS` are the collectives of the model's
tensor-parallel plan (DTensor's redistributions in forward and backward), counted only when asked
(``ZeroPPStrategy.count_tensor_parallel_bytes()``, or a ``CommVolumeMonitor`` with ``tensor_parallel_size`` > 1; see
:mod:`lightning_zeropp.tensor_parallel_comms`), read with ``tensor_parallel_total()``, ``tensor_parallel_by_kind()``
and reported as ``comm/tensor_parallel/inter_node_MB`` and ``comm/tensor_parallel/intra_node_MB``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from .topology import Topology

UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}

KINDS = (
    "weight_all_gather",  # forward, from the primary shards (whole world)
    "weight_all_gather_backward",  # backward without hpZ: from the primary shards again
    "weight_all_gather_secondary",  # backward, from the hpZ secondary partition (inside the node)
    "gradient_reduce_scatter",
    "gradient_all_to_all_intra",
    "gradient_all_to_all_inter",
    "gradient_reduce_scatter_vectors",  # gradient_quantization_scope="matrices": norm gains and biases, exact
    "gradient_all_reduce",  # HSDP: the node's reduce-scattered gradients, all-reduced across nodes
    "gradient_rail_reduce_scatter",  # quantized HSDP: INT4 pieces of the node's gradients, each to its rail owner
    "gradient_rail_all_gather",  # quantized HSDP: the owner's reduced piece (INT8 or bf16) to every rail rank
    "gradient_all_reduce_vectors",  # quantized HSDP, gradient_quantization_scope="matrices": norm gains, biases
    "weight_delta_all_to_all",  # weight_deltas: INT4 deltas, each shard to the one holder per node
    "weight_delta_refresh",  # weight_deltas: a shard itself, exact, to the same holders (first step, refreshes)
    "weight_all_gather_node_copy",  # weight_deltas: forward, the node copy's slices (inside the hpZ group)
    "weight_delta_all_reduce",  # weight_deltas: one byte per unit per forward, so every rank does the same
    "preemption_all_reduce",  # SLURM auto-requeue: 24 bytes per step boundary, so every rank saves at the same one
)
TENSOR_PARALLEL_KINDS = (  # the model's plan, on the tensor-parallel group (inside the node): kept out of the totals
    "tensor_parallel_all_reduce",
    "tensor_parallel_all_gather",
    "tensor_parallel_reduce_scatter",
    "tensor_parallel_all_to_all",
)
TENSOR_PARALLEL = "tensor_parallel"  # the metrics' name for the tensor-parallel totals: comm/tensor_parallel/..._MB


def all_reduce_chunks(numel: int, element_size: int, group_size: int, index: int) -> list[int]:
    """Bytes an exact all-reduce of ``numel`` elements sends to each member of its group, as the ledger counts it:
    the buffer cut in ``group_size`` near-equal pieces, piece ``i`` to member ``i`` (the reduce-scatter) and this
    member's piece (``index``) to every member (the all-gather)."""
    pieces = [(numel * (i + 1) // group_size - numel * i // group_size) * element_size for i in range(group_size)]
    mine = pieces[index]
    return [p + mine for p in pieces]


@dataclass(slots=True)
class Traffic:
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    calls: int = 0

    def add(self, other: Traffic) -> None:
        self.intra_node_bytes += other.intra_node_bytes
        self.inter_node_bytes += other.inter_node_bytes
        self.calls += other.calls

    @property
    def total_bytes(self) -> int:
        return self.intra_node_bytes + self.inter_node_bytes


class CommLedger:
    """Per-rank byte counts by collective kind, for the current step and since the start (or the last reset)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._total: dict[str, Traffic] = defaultdict(Traffic)
        self._step: dict[str, Traffic] = defaultdict(Traffic)
        self.counts_tensor_parallel = False
        """Whether the model's tensor-parallel collectives are being counted: then :meth:`step_metrics` reports
        their totals too (set by the strategy's switch, ``count_tensor_parallel_bytes``)."""

    # ----------------------------------------------------------------- recording
    def record_all_gather(self, kind: str, group_ranks: list[int], buffer_bytes: int) -> None:
        if len(group_ranks) <= 1:  # a group of this rank alone moves nothing (see record_to_peers)
            return
        intra, inter = self.topology.peers_split(group_ranks)
        self._record(kind, Traffic(intra * buffer_bytes, inter * buffer_bytes, 1))

    def record_small_all_reduce(self, kind: str, group_ranks: list[int], buffer_bytes: int) -> None:
        """An all-reduce of a few bytes (a flag per unit, three counters): latency-bound whatever the algorithm,
        recorded as the buffer sent to every peer once (what a one-round exchange moves)."""
        self.record_all_gather(kind, group_ranks, buffer_bytes)

    def record_to_peers(self, kind: str, group_ranks: list[int], chunk_bytes: list[int] | int) -> None:
        """A reduce-scatter or all-to-all: ``chunk_bytes[i]`` is sent to ``group_ranks[i]`` (one int: all equal).
        A group of this rank alone is not recorded: it moves nothing, and whether FSDP calls the hook for it at all
        depends on the torch version (2.9 does, 2.13 does not), so recording it would make the ledger differ by
        version and from the planner."""
        if len(group_ranks) <= 1:
            return
        if isinstance(chunk_bytes, int):
            chunk_bytes = [chunk_bytes] * len(group_ranks)
        self._record(kind, _to_peers(group_ranks, chunk_bytes, self.topology.rank, self.topology.node_of))

    def record_carried(self, kind: str, group_ranks: list[int], chunk_bytes: list[int] | int) -> None:
        """Bytes of ``kind`` that ride another kind's all-to-all (appended to its rows), as :meth:`record_to_peers`
        counts them but with no call of their own: they add bytes, not a collective's latency."""
        if len(group_ranks) <= 1:
            return
        if isinstance(chunk_bytes, int):
            chunk_bytes = [chunk_bytes] * len(group_ranks)
        traffic = _to_peers(group_ranks, chunk_bytes, self.topology.rank, self.topology.node_of)
        traffic.calls = 0
        self._record(kind, traffic)

    def record_tensor_parallel(self, kind: str, group_ranks: list[int], chunk_bytes: list[int]) -> None:
        """A collective of the model's tensor-parallel plan: ``chunk_bytes[i]`` sent to ``group_ranks[i]``, ranks as
        the job numbers them (global: the tensor-parallel group is not in the data-parallel index space the other
        records use); ``kind`` one of :data:`TENSOR_PARALLEL_KINDS`."""
        if kind not in TENSOR_PARALLEL_KINDS:
            raise KeyError(f"unknown tensor-parallel ledger kind {kind!r}; known: {TENSOR_PARALLEL_KINDS}")
        if len(group_ranks) <= 1:
            return
        topology = self.topology
        self._record(kind, _to_peers(group_ranks, chunk_bytes, topology.global_rank, topology.node_of_global))

    def _record(self, kind: str, traffic: Traffic) -> None:
        if kind not in KINDS and kind not in TENSOR_PARALLEL_KINDS:
            raise KeyError(f"unknown ledger kind {kind!r}; known: {KINDS + TENSOR_PARALLEL_KINDS}")
        self._total[kind].add(traffic)
        self._step[kind].add(traffic)

    # ----------------------------------------------------------------- reading
    def start_step(self) -> None:
        """Zeroes the per-step counters (the callback calls this when a training batch starts)."""
        self._step = defaultdict(Traffic)

    def step_metrics(self, unit: str = "MB", per_kind: bool = False, restart: bool = True) -> dict[str, float]:
        """This step's bytes as metrics, ``comm/inter_node_MB`` and ``comm/intra_node_MB`` (data-parallel: the
        strategy's own collectives), while tensor-parallel bytes are counted also ``comm/tensor_parallel/inter_node_MB``
        and ``comm/tensor_parallel/intra_node_MB``, and, with ``per_kind``, ``comm/<kind>/inter_node_MB``, ... for
        every kind of either; ``unit``: ``"B"``, ``"KB"``, ``"MB"`` or ``"GB"`` (decimal). With ``restart`` the next
        step starts here. In a Fabric loop, after each optimizer step:
        ``fabric.log_dict(fabric.strategy.comm_ledger.step_metrics())``."""
        if unit not in UNITS:
            raise ValueError(f"CommLedger.step_metrics: `unit={unit!r}` is not allowed; choose one of {list(UNITS)}.")
        scale = UNITS[unit]
        step = self.step()
        metrics = {
            f"comm/inter_node_{unit}": step.inter_node_bytes / scale,
            f"comm/intra_node_{unit}": step.intra_node_bytes / scale,
        }
        if self.counts_tensor_parallel:
            tensor = self.tensor_parallel_step()
            metrics[f"comm/{TENSOR_PARALLEL}/inter_node_{unit}"] = tensor.inter_node_bytes / scale
            metrics[f"comm/{TENSOR_PARALLEL}/intra_node_{unit}"] = tensor.intra_node_bytes / scale
        if per_kind:
            kinds = self.by_kind(step=True) | self.tensor_parallel_by_kind(step=True)
            for kind, traffic in kinds.items():
                metrics[f"comm/{kind}/inter_node_{unit}"] = traffic.inter_node_bytes / scale
                metrics[f"comm/{kind}/intra_node_{unit}"] = traffic.intra_node_bytes / scale
        if restart:
            self.start_step()
        return metrics

    def step(self, kind: str | None = None) -> Traffic:
        """This step's bytes of ``kind`` (either family), or of every data-parallel kind."""
        return _sum(self._step, kind, KINDS)

    def total(self, kind: str | None = None) -> Traffic:
        """The bytes since the start of ``kind`` (either family), or of every data-parallel kind."""
        return _sum(self._total, kind, KINDS)

    def tensor_parallel_step(self) -> Traffic:
        """This step's bytes of every tensor-parallel kind."""
        return _sum(self._step, None, TENSOR_PARALLEL_KINDS)

    def tensor_parallel_total(self) -> Traffic:
        """The bytes since the start of every tensor-parallel kind."""
        return _sum(self._total, None, TENSOR_PARALLEL_KINDS)

    def by_kind(self, *, step: bool = False) -> dict[str, Traffic]:
        """The data-parallel kinds that moved bytes (what the planner predicts)."""
        return _table(self._step if step else self._total, KINDS)

    def tensor_parallel_by_kind(self, *, step: bool = False) -> dict[str, Traffic]:
        """The tensor-parallel kinds that moved bytes."""
        return _table(self._step if step else self._total, TENSOR_PARALLEL_KINDS)

    @property
    def inter_node_bytes(self) -> int:
        return self.total().inter_node_bytes

    @property
    def intra_node_bytes(self) -> int:
        return self.total().intra_node_bytes


def _to_peers(group_ranks: list[int], chunk_bytes: list[int], me: int, node_of: Callable[[int], int]) -> Traffic:
    traffic = Traffic(calls=1)
    for peer, nbytes in zip(group_ranks, chunk_bytes, strict=True):
        if peer == me:
            continue
        if node_of(peer) == node_of(me):
            traffic.intra_node_bytes += nbytes
        else:
            traffic.inter_node_bytes += nbytes
    return traffic


def _table(table: dict[str, Traffic], kinds: tuple[str, ...]) -> dict[str, Traffic]:
    return {
        k: Traffic(t.intra_node_bytes, t.inter_node_bytes, t.calls)
        for k, t in table.items()
        if (t.calls or t.total_bytes) and k in kinds  # carried bytes: no call of their own
    }


def _sum(table: dict[str, Traffic], kind: str | None, family: tuple[str, ...]) -> Traffic:
    if kind is not None:
        if kind not in KINDS and kind not in TENSOR_PARALLEL_KINDS:
            raise KeyError(f"unknown ledger kind {kind!r}; known: {KINDS + TENSOR_PARALLEL_KINDS}")
        t = table.get(kind, Traffic())
        return Traffic(t.intra_node_bytes, t.inter_node_bytes, t.calls)
    out = Traffic()
    for k, t in table.items():
        if k in family:
            out.add(t)
    return out
