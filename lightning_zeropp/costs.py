"""What one training step costs a rank, from the model's shapes alone: bytes per collective kind, as the ledger
counts them, and the memory the strategy keeps.

A model is described by its FSDP units (:class:`Unit`: the parameters' shapes, in the order FSDP lays them out) and
nothing else, so a 70B model on 32 nodes is as cheap to cost as the example GPT on two. The arithmetic follows the
strategy's own: FSDP2 pads each parameter's dim 0 to a multiple of the shard group's size; the quantized buffers are
the wire format's (:mod:`lightning_zeropp.kernels.layout`: parameter-aligned blocks, scales, padding); qgZ's pieces
are :func:`lightning_zeropp.qgz.stages`, quantized HSDP's rail pieces :func:`lightning_zeropp.rail.pieces` (their
wire, :meth:`~lightning_zeropp.rail.Piece.wire`); weight deltas go to one holder per hpZ group.
``tests/test_costs.py`` and ``benchmarks/plan_check.py`` check every kind against the ledger of real steps, byte for
byte.

Steady state: a step after the first (weight deltas fill the node copies exactly in the first), one forward and one
backward per optimizer step, every parameter trained.

Tensor parallelism (``config.tensor_parallel_size`` t > 1): ``world`` and ``ranks_per_node`` stay the job's, ``rank``
the job's number; the arithmetic runs on the data-parallel topology the strategy builds
(:func:`~lightning_zeropp.commplan.job_topology`: W / t ranks, N / t per node) and on the units as FSDP sees them, the
tensor-parallel pieces (:func:`tensor_parallel_units`). The activations' all-reduces inside the node are not a ledger
kind: :func:`activation_all_reduce_bytes`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from . import kernels as tk
from .commplan import CommPlan, job_topology, resolve
from .config import ZeroPPConfig
from .ledger import CommLedger, all_reduce_chunks
from .qgz import stages
from .rail import GATHER_KIND, REDUCE_KIND, Piece, pieces
from .sharding import default_wrap_targets
from .vectors import KIND as VECTORS_KIND
from .vectors import RAIL_KIND as RAIL_VECTORS_KIND

Shape = tuple[int, ...]
ELEMENT_BYTES = {"32-true": (4, 4, 4), "bf16-mixed": (4, 2, 2), "bf16-true": (2, 2, 2), "16-true": (2, 2, 2)}
"""Per precision: bytes of a parameter as stored (the sharded master), as gathered and computed, as reduced."""


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its name and its parameters' shapes, in the order FSDP lays them out (module order, a shared
    parameter once)."""

    name: str
    shapes: tuple[Shape, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def shards(self, ranks: int) -> list[int]:
        """Per parameter, the elements of one rank's shard (dim 0 padded to a multiple of ``ranks``)."""
        return [-(-s[0] // ranks) * math.prod(s[1:]) if s else 1 for s in self.shapes]

    def vector_shard(self, ranks: int) -> int:
        """The elements of one rank's shard that belong to parameters of fewer than two dimensions (norm gains,
        biases: what ``gradient_quantization_scope="matrices"`` reduces exactly)."""
        return sum(n for s, n in zip(self.shapes, self.shards(ranks)) if len(s) < 2)


def units_of(model: nn.Module) -> list[Unit]:
    """The units the strategy makes of ``model`` by default (each element of the outermost ``nn.ModuleList``s, then
    the root with what is left), from its parameters' shapes: build it on the meta device, nothing is allocated."""
    targets = default_wrap_targets(model)
    taken: set[int] = set()
    units = []
    for module in targets:
        params = [p for p in module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in params)
        units.append(params)
    root = [p for p in model.parameters() if id(p) not in taken]
    names = [n for n, m in model.named_modules() if any(m is t for t in targets)]
    return [Unit(n, tuple(tuple(p.shape) for p in ps)) for n, ps in zip([*names, "<root>"], [*units, root])]


def gpt_units(vocab: int, block_size: int, n_layer: int, n_embd: int) -> list[Unit]:
    """The example GPT's units (``examples/gpt/model.py``: pre-norm blocks with biases, learned positions, a head tied
    to the token embedding) from its sizes."""
    d = n_embd
    block = ((d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,))
    return [Unit(f"blocks.{i}", block) for i in range(n_layer)] + [
        Unit("<root>", ((vocab, d), (block_size, d), (d,), (d,)))
    ]


def parameters(units: Iterable[Unit]) -> int:
    return sum(u.numel for u in units)


def tensor_parallel_units(units: list[Unit], tensor_parallel_size: int) -> list[Unit]:
    """The units as FSDP sees them on one rank of a tensor-parallel group of ``tensor_parallel_size`` (t): each
    parameter's local piece under a Megatron-style plan read from the shapes alone, the rank with the largest pieces
    (a dimension that t does not divide leaves the first ranks one row more, as DTensor does).

    In a block: a matrix ``(out, in)`` that widens (``out > in``: attention's input projection, the MLP's first) is
    split over its rows (column-parallel), and so is the bias right after it; one that does not (the projections back
    to the width) over its columns (row-parallel), its bias replicated; norms replicated. In the root (the last unit):
    the vocabulary-sized matrices (the token embedding, the head) split over their rows, the rest (positions, the
    final norm) replicated. Exact for :func:`gpt_units`; for other models the rule of thumb their shapes allow. Every
    GPU of a group holds the replicated parameters whole."""
    t = tensor_parallel_size
    if t == 1:
        return list(units)

    def split(n: int) -> int:
        return -(-n // t)

    out = []
    for i, unit in enumerate(units):
        root = i == len(units) - 1 and len(units) > 1
        vocab = max((s[0] for s in unit.shapes if len(s) == 2), default=None)  # the root's largest rows
        shapes: list[Shape] = []
        column = None  # the rows of the column-parallel matrix just before: its bias is split with it
        for s in unit.shapes:
            if len(s) == 2 and (s[0] == vocab if root else s[0] > s[1]):
                shapes.append((split(s[0]), s[1]))
                column = s[0]
            elif len(s) == 2 and not root:
                shapes.append((s[0], split(s[1])))
                column = None
            elif len(s) == 1 and s[0] == column:
                shapes.append((split(s[0]),))
                column = None
            else:
                shapes.append(s)
                column = None
        out.append(Unit(unit.name, tuple(shapes)))
    return out


def activation_all_reduce_bytes(
    layers: int, tokens: int, width: int, tensor_parallel_size: int, precision: str, activation_checkpointing: bool
) -> tuple[int, int]:
    """``(bytes, all-reduces)`` one GPU sends per step for tensor parallelism's activations, inside its node, never
    across nodes: per layer (Megatron-style), the forward all-reduces the attention's and the MLP's outputs and the
    backward the gradients of their inputs, each ``tokens x tensor_parallel_size x width`` values in the compute dtype
    (the group computes on the tokens of all its GPUs); with activation checkpointing the forward runs again in the
    backward, with its two. A ring all-reduce of ``S`` bytes over t GPUs sends ``2 (t - 1) S / t`` from each (a
    reduce-scatter and an all-gather, counted per peer as the ledger counts). (0, 0) without tensor parallelism or
    without a width."""
    t = tensor_parallel_size
    if t == 1 or not width:
        return 0, 0
    _, e, _ = ELEMENT_BYTES[precision]
    calls = layers * (6 if activation_checkpointing else 4)
    return calls * 2 * (t - 1) * tokens * width * e, calls


def _plan(config: ZeroPPConfig, world: int, ranks_per_node: int, precision: str | None = None) -> CommPlan:
    """The job's plan (the same for every rank: rank 0's), on its data-parallel topology."""
    return resolve(config, job_topology(config, world, ranks_per_node, 0), precision)


# ------------------------------------------------------------------------------------------------ bytes
@functools.lru_cache(maxsize=4096)
def _wire(segments: tuple[int, ...], bits: int, block_size: int, aligned: bool) -> int:
    """Bytes of one quantized row of a unit's shard (a model's blocks repeat: each distinct one is costed once)."""
    if aligned:
        return tk.Blocks.of_segments(segments, block_size).wire_size(bits)
    return tk.wire_size(sum(segments), bits, block_size)


@functools.lru_cache(maxsize=4096)
def _qgz_rows(segments: tuple[int, ...], config: _GradientFormat) -> tuple[tuple[int, int, int, int], ...]:
    """Per qgZ pipeline piece of a unit's chunk: its elements, blocks, and one row's bytes on the intra-node and on
    the inter-node hop."""
    c = config
    blocks = tk.Blocks.of_segments(segments, c.block_size) if c.aligned else None
    rows = []
    for _, size, piece in stages(sum(segments), c.pieces, c.block_size, blocks):
        if piece is not None:
            rows.append((size, piece.count, piece.wire_size(c.intra_bits), piece.wire_size(c.inter_bits)))
        else:
            bs = c.block_size
            rows.append(
                (size, -(-size // bs), tk.wire_size(size, c.intra_bits, bs), tk.wire_size(size, c.inter_bits, bs))
            )
    return tuple(rows)


@dataclass(frozen=True)
class _GradientFormat:
    """What qgZ's pieces and rows depend on (hashable, and nothing else, so equal formats share the cache)."""

    pieces: int
    block_size: int
    intra_bits: int
    inter_bits: int
    aligned: bool

    @classmethod
    def of(cls, plan: CommPlan) -> _GradientFormat:
        g = plan.gradients
        return cls(g.pieces, g.block_size, g.intra_bits, g.inter_bits, plan.aligned)


@functools.lru_cache(maxsize=4096)
def _rail_pieces(segments: tuple[int, ...], nodes: int, block_size: int, aligned: bool) -> tuple[Piece, ...]:
    """Quantized HSDP: the K rail pieces of a unit's node shard, as :func:`lightning_zeropp.rail.pieces` cuts them
    (piece k reduced by the rank on node k; the blocks follow the parameters, every one trained, where ``aligned``)."""
    blocks = tk.Blocks.of_segments(segments, block_size) if aligned else None
    return pieces(sum(segments), nodes, block_size, blocks)


def step_bytes(
    units: list[Unit], config: ZeroPPConfig, world: int, ranks_per_node: int, rank: int, precision: str = "bf16-mixed"
) -> dict[str, tuple[int, int, int]]:
    """Per ledger kind, ``(intra-node bytes, inter-node bytes, calls)`` that ``rank`` sends in one steady-state step
    of a job of ``world`` ranks, ``ranks_per_node`` per node (with tensor parallelism, on the data-parallel topology:
    module docstring)."""
    _, e, er = ELEMENT_BYTES[precision]
    topo = job_topology(config, world, ranks_per_node, rank)
    plan = resolve(config, topo)
    ledger = CommLedger(topo)
    K, N, W, R = topo.num_nodes, topo.ranks_per_node, topo.world_size, topo.hpz_partition_size
    rank = topo.rank  # from here on, the data-parallel rank
    hybrid = plan.shard_group == "node"
    shard_group = topo.intra_node_ranks() if hybrid else list(range(W))
    S = len(shard_group)
    world_ranks = list(range(W))
    aligned, forward = plan.aligned, plan.forward
    deltas = forward.kind == "node_copy"
    gradients = plan.gradients
    quantized_gradients = gradients.kind == "two_hop"
    if deltas:  # one byte per unit per forward: every rank agrees which node copies to update
        ledger.record_small_all_reduce("weight_delta_all_reduce", world_ranks, len(units))
    for unit in units:
        segments = unit.shards(S)
        C = sum(segments)
        # forward all-gather
        if deltas:
            G = W // R
            holders = [g * R + rank // G for g in range(G)]
            wire = _wire(tuple(segments), forward.bits, forward.block_size, aligned)
            ledger.record_to_peers(
                "weight_delta_all_to_all", world_ranks, [wire if r in holders else 0 for r in world_ranks]
            )
            ledger.record_all_gather("weight_all_gather_node_copy", topo.hpz_ranks(), G * C * e)
        elif forward.kind == "quantized":
            wire = _wire(tuple(segments), forward.bits, forward.block_size, aligned)
            ledger.record_all_gather("weight_all_gather", world_ranks, wire)
        else:
            ledger.record_all_gather("weight_all_gather", shard_group, C * e)
        # backward all-gather
        if plan.backward.kind == "secondary":
            ledger.record_all_gather("weight_all_gather_secondary", topo.hpz_ranks(), C * (W // R) * e)
        elif forward.kind == "quantized":
            wire = _wire(tuple(segments), forward.bits, forward.block_size, aligned)
            ledger.record_all_gather("weight_all_gather_backward", world_ranks, wire)
        else:
            ledger.record_all_gather("weight_all_gather_backward", shard_group, C * e)
        # gradient reduction
        if quantized_gradients:
            for size, _, row_in, row_out in _qgz_rows(tuple(segments), _GradientFormat.of(plan)):
                if not size:
                    continue
                if N > 1:
                    ledger.record_to_peers("gradient_all_to_all_intra", topo.intra_node_ranks(), K * row_in)
                ledger.record_to_peers("gradient_all_to_all_inter", topo.rail_ranks(), row_out)
            if gradients.exact_vectors and (V := unit.vector_shard(S)):  # carried by qgZ's two hops
                if N > 1:
                    ledger.record_carried(VECTORS_KIND, topo.intra_node_ranks(), K * V * er)
                ledger.record_carried(VECTORS_KIND, topo.rail_ranks(), V * er)
        else:
            ledger.record_to_peers("gradient_reduce_scatter", shard_group, C * er)
            if hybrid and gradients.quantized_rail:  # each piece (INT4) to its owner; the owner's (INT8, bf16) to all
                cut = _rail_pieces(tuple(segments), K, gradients.block_size, aligned)
                rail, bs = topo.rail_ranks(), gradients.block_size
                ledger.record_to_peers(REDUCE_KIND, rail, [p.wire(gradients.inter_bits, bs) for p in cut])
                ledger.record_to_peers(GATHER_KIND, rail, cut[topo.node].wire(gradients.gather_bits, bs))
                if gradients.exact_vectors and (V := unit.vector_shard(S)):
                    ledger.record_carried(RAIL_VECTORS_KIND, rail, all_reduce_chunks(V, er, K, rail.index(rank)))
            elif hybrid:
                rail = topo.rail_ranks()
                ledger.record_to_peers("gradient_all_reduce", rail, all_reduce_chunks(C, er, K, rail.index(rank)))
    return {k: (t.intra_node_bytes, t.inter_node_bytes, t.calls) for k, t in ledger.by_kind().items()}


def kernel_bytes(
    units: list[Unit], config: ZeroPPConfig, world: int, ranks_per_node: int, precision: str = "bf16-mixed"
) -> int:
    """Device-memory bytes the quantization kernels read and write on a rank in one steady-state step (each buffer
    once per pass, as the fused kernels move it): qwZ's quantize of the own shard and dequantize of every gathered
    row (twice without hpZ); qgZ's swizzle-quantize of the whole reduce-scatter input, the intra-node
    dequantize-reduce-requantize and the final dequantize-reduce; the error feedback residual, read and written; the
    weight deltas' quantize (the weights and their tracked copy read) and the holders' dequantize-add; quantized
    HSDP's (:func:`_rail_kernel_bytes`). Exact collectives (ZeRO-3, HSDP) move no bytes through kernels of ours: 0."""
    _, e, er = ELEMENT_BYTES[precision]
    plan = _plan(config, world, ranks_per_node)
    K, N, W, R = plan.num_nodes, plan.ranks_per_node, plan.world_size, plan.hpz_partition_size
    aligned, forward, feedback = plan.aligned, plan.forward, plan.gradients.feedback
    total = 0
    for unit in units:
        segments = tuple(unit.shards(W))
        C = sum(segments)
        if forward.kind == "node_copy":
            wire = _wire(segments, forward.bits, forward.block_size, aligned)
            G = W // R
            total += 2 * C * e + wire + G * (wire + 2 * C * e)  # quantize w - tracked; holders add G deltas in place
        elif forward.kind == "quantized":
            wire = _wire(segments, forward.bits, forward.block_size, aligned)
            gathers = 1 if plan.backward.kind == "secondary" else 2  # the backward re-gathers (and dequantizes)
            total += gathers * (C * e + wire + W * (wire + C * e))
        if plan.gradients.kind == "two_hop":
            rows = _qgz_rows(segments, _GradientFormat.of(plan))
            row_in, row_out = sum(r[2] for r in rows), sum(r[3] for r in rows)
            total += W * C * er + W * row_in  # swizzle-quantize: the whole input in, W rows out
            total += N * K * row_in + K * row_out  # in the node: N copies of K rows in, K rows out
            total += K * row_out + C * er  # across nodes: K rows in, this rank's chunk out
            if feedback is not None:
                total += 2 * K * C * feedback.bits // 8
        elif plan.gradients.quantized_rail:
            total += _rail_kernel_bytes(plan, tuple(unit.shards(N)), er)
    return total


def correction_bytes(
    units: list[Unit], config: ZeroPPConfig, world: int, ranks_per_node: int, precision: str = "bf16-mixed"
) -> int:
    """Device-memory bytes the second-moment correction reads and writes on a rank in one step, where it is on (qgZ
    across nodes): per element of the rank's shard, the gradient read three times (its norm after the backward and
    before the update, and the lowering) and 44 bytes of the fp32 ``exp_avg_sq`` and its transients (the blocks
    written out 4; ``v + shift g^2`` 8, ``v`` read, the room written; its share 8; the cap 12; the subtraction 12), as
    GPUs lower a unit at once (:func:`lightning_zeropp.moments._lower_unit`). An optimizer outside torch's Adam family
    is left alone by "auto" (no estimate, no pass): the planner leaves this out for a workload with fewer than Adam's
    two states per element (``Workload.optimizer_states`` < 2)."""
    stored = ELEMENT_BYTES[precision][0]
    plan = _plan(config, world, ranks_per_node, precision)
    g = plan.gradients
    if not (g.kind == "two_hop" and g.second_moment and plan.num_nodes > 1):
        return 0
    return sum(sum(unit.shards(plan.world_size)) for unit in units) * (3 * stored + 44)


def _rail_kernel_bytes(plan: CommPlan, segments: tuple[int, ...], er: int) -> int:
    """Quantized HSDP's kernels on one unit's node shard of ``C`` elements (``er`` bytes each), on rank 0 (the rail
    owner of piece 0): every piece quantized to INT4 (the shard in, K rows out); the K received rows of its piece
    dequantized and summed into fp32; that piece rounded for the all-gather (INT8: quantized; bf16: cast) and the K
    gathered pieces written into the shard (INT8: dequantized; bf16: cast into the shard's dtype); the error feedback
    residual (one row per piece: the whole shard) read and written."""
    g = plan.gradients
    cut = _rail_pieces(segments, plan.num_nodes, g.block_size, plan.aligned)
    mine, C, K = cut[0], sum(segments), plan.num_nodes
    sent = sum(p.wire(g.inter_bits, g.block_size) for p in cut)
    gathered = sum(p.wire(g.gather_bits, g.block_size) for p in cut)
    total = C * er + sent  # quantize: the shard in, every piece's INT4 row out
    total += K * mine.wire(g.inter_bits, g.block_size) + 4 * mine.size  # dequantize-reduce: K rows in, fp32 out
    total += 4 * mine.size + mine.wire(g.gather_bits, g.block_size)  # the reduced piece rounded (INT8) or cast (bf16)
    total += gathered + C * er  # the K gathered pieces into the shard
    if g.feedback is not None:
        total += 2 * C * g.feedback.bits // 8
        if g.gather_bits != 16:  # the owner's gather residual
            total += 2 * mine.size * g.feedback.bits // 8
    return total


def collective_buffers(units: list[Unit], config: ZeroPPConfig, world: int, ranks_per_node: int) -> int:
    """Bytes the quantized collectives hold at their peak, for the unit that needs most: qwZ's packed shard and the
    gathered rows (forward); weight deltas' packed delta, sent and received rows; qgZ's intra-node rows sent and
    received and its rail rows, with the copies that carry norm gains and biases where those are reduced exactly
    (``gradient_quantization_scope="matrices"``; counted in fp32, a bound) (backward: the two never
    overlap for one unit); quantized HSDP's INT4 pieces sent and its K copies of one piece received, then that piece
    sent to every rail rank and every piece received (for the rank whose piece is largest). Exact collectives use
    FSDP's own buffers (the unsharded units): 0."""
    plan = _plan(config, world, ranks_per_node)
    K, N, W, R = plan.num_nodes, plan.ranks_per_node, plan.world_size, plan.hpz_partition_size
    aligned, gather, g = plan.aligned, plan.forward, plan.gradients
    peak = 0
    for unit in units:
        segments = tuple(unit.shards(W))
        forward = backward = 0
        if gather.kind == "node_copy":
            wire = _wire(segments, gather.bits, gather.block_size, aligned)
            forward = wire + 2 * (W // R) * wire
        elif gather.kind == "quantized":
            wire = _wire(segments, gather.bits, gather.block_size, aligned)
            forward = wire + W * wire
        if plan.gradients.kind == "two_hop":
            rows = _qgz_rows(segments, _GradientFormat.of(plan))
            backward = 2 * W * sum(r[2] for r in rows) + 2 * K * sum(r[3] for r in rows)
            if g.exact_vectors:  # the last stage's rows copied once more on each side of both hops to carry the
                # vectors; their columns of the W chunks, regrouped, sent and received, the node's sums, fp32 at most
                *_, (_, _, row_in, row_out) = [r for r in rows if r[0]] or [(0, 0, 0, 0)]
                backward += 2 * W * row_in + 2 * K * row_out + (4 * W + 3 * K + 1) * unit.vector_shard(W) * 4
        elif g.quantized_rail:
            cut = _rail_pieces(tuple(unit.shards(N)), K, g.block_size, aligned)
            sent = sum(p.wire(g.inter_bits, g.block_size) for p in cut)
            gathered = sum(p.wire(g.gather_bits, g.block_size) for p in cut)
            largest = max(K * (p.wire(g.inter_bits, g.block_size) + p.wire(g.gather_bits, g.block_size)) for p in cut)
            backward = sent + largest + gathered
            if g.exact_vectors:  # every row copied once more to carry the vectors' parts; the parts, fp32 at most
                backward = 2 * backward + 6 * unit.vector_shard(N) * 4
        peak = max(peak, forward, backward)
    return peak


# ------------------------------------------------------------------------------------------------ memory
def persistent_memory(
    units: list[Unit],
    config: ZeroPPConfig,
    world: int,
    ranks_per_node: int,
    precision: str = "bf16-mixed",
    rank: int | None = None,
) -> dict[str, int]:
    """What ``strategy.persistent_memory`` reports on ``rank`` after a step (None: the rank that keeps most): the
    error feedback residuals, the second-moment correction's noise estimates, and the weight deltas' node copy and
    tracked copy, in bytes. Only quantized HSDP's
    gather residual (the owner's piece) differs between ranks."""
    _, e, _ = ELEMENT_BYTES[precision]
    plan = _plan(config, world, ranks_per_node, precision)
    K, N, W, R = plan.num_nodes, plan.ranks_per_node, plan.world_size, plan.hpz_partition_size
    g = plan.gradients
    feedback = g.feedback
    out = {"error_feedback": 0, "second_moment_noise": 0, "weight_deltas_node_copy": 0, "weight_deltas_tracked_copy": 0}
    for unit in units:
        segments = unit.shards(W)
        C = sum(segments)
        if g.kind == "two_hop" and g.second_moment and K > 1:  # one fp32 per block of the gradient chunk
            blocks = sum(-(-n // g.block_size) for n in segments) if plan.aligned else -(-C // g.block_size)
            out["second_moment_noise"] += 4 * blocks
        if feedback is not None:
            if g.quantized_rail:  # one row per rail piece: the node shard once; and the owner's gathered piece
                cut = _rail_pieces(tuple(unit.shards(N)), K, g.block_size, plan.aligned)
                rows, pieces = 1, [(p.size, p.block_count(g.block_size)) for p in cut]
                if g.gather_bits != 16:
                    owned = [
                        _residual_bytes([(p.size, p.block_count(g.block_size))], feedback.bits) if p.size else 0
                        for p in cut
                    ]
                    node = None if rank is None else rank // (N * plan.tensor_parallel_size)  # rank: the job's
                    out["error_feedback"] += max(owned) if node is None else owned[node]
            else:  # K rows (one per node) of each qgZ pipeline piece
                rows, pieces = (
                    K,
                    [(size, count) for size, count, _, _ in _qgz_rows(tuple(segments), _GradientFormat.of(plan))],
                )
            out["error_feedback"] += rows * _residual_bytes(pieces, feedback.bits)
        if plan.forward.kind == "node_copy":
            out["weight_deltas_node_copy"] += (W // R) * C * e
            out["weight_deltas_tracked_copy"] += C * e
    return out


def _residual_bytes(pieces: list[tuple[int, int]], bits: int) -> int:
    """One row of an error feedback residual over ``(size, blocks)`` pieces (:class:`~lightning_zeropp.feedback.
    ErrorFeedback`): INT8 codes with each piece's row padded to 16 bytes and one fp32 scale per block, or bf16 / fp32
    values."""
    if bits == 8:
        return sum(-(-size // 16) * 16 + 4 * count for size, count in pieces)
    return sum(size for size, _ in pieces) * bits // 8
