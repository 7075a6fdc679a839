"""Quantized HSDP: the cross-node all-reduce of HSDP's gradients as a quantized reduce-scatter and an all-gather on
the rail.

HSDP (``sharding_strategy="HYBRID_SHARD"``) shards every unit over the N ranks of a node and keeps one replica per
node. After the exact reduce-scatter inside the node, local rank ``l`` of every node holds its node's reduced shard
of the same L elements; the K ranks of that rail (local rank ``l`` on every node) must all end with the mean over the
K nodes, bit for bit the same (replicas that drift apart are not replicas). FSDP all-reduces that shard exactly, in
full precision: ``L x element`` bytes out of every rank, half of them twice (reduce-scatter, all-gather). Here::

    1. cut the shard into K pieces at block boundaries       (kernels.cut_pieces, as qgZ's pieces)
    2. quantize piece k to INT4 (gradient_bits), send it       (error feedback, rotation, rounding: as qgZ's rail hop)
       to rail rank k                                           one all-to-all of uneven pieces
    3. dequantize the K copies of my piece, sum in fp32, scale (AVG: 1 / K; the node's mean is already taken)
    4. round my reduced piece to INT4, INT8 or bf16 (hsdp_gather_bits) and send it to every rail rank, myself included
       (error feedback: the owner keeps what the rounding lost and adds it to the next step's piece)
    5. every rank writes the K dequantized pieces into its shard

Step 5 is the same for the piece's owner, which reads back what it sent rather than its fp32 sum, so every replica
holds the same bits. Bytes out of a rank per unit: ``K - 1`` INT4 pieces (about L / 2 / K bytes each plus scales) and
``K - 1`` copies of its INT8 piece (about L / K bytes each): ~1.5 L (K - 1) / K against FSDP's 2 L (K - 1) / K x 4
bytes in fp32 (1.5 / 8 of its bytes) or x 2 in bf16 (1.5 / 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import kernels as tk
from . import vectors as vec
from .commplan import GradientReduction
from .ledger import CommLedger, all_reduce_chunks
from .topology import Topology

REDUCE_KIND = "gradient_rail_reduce_scatter"
GATHER_KIND = "gradient_rail_all_gather"
EXACT_KIND = "gradient_all_reduce"
GATHER_RESIDUAL = "/rail_gather"  # a unit's gather residual is kept under the unit's name and this suffix


class Piece(NamedTuple):
    """Piece ``index`` of a shard: ``size`` elements from ``start``, in ``blocks`` (None: flat blocks)."""

    index: int
    start: int
    size: int
    blocks: tk.Blocks | None

    def block_count(self, block_size: int) -> int:
        return self.blocks.count if self.blocks is not None else -(-self.size // block_size)

    def wire(self, bits: int, block_size: int) -> int:
        """Bytes of the piece on the wire: a quantized row (8 or 4 bits), or bf16 (16); 0 when empty."""
        if not self.size:
            return 0
        if bits == 16:
            return 2 * self.size
        return self.blocks.wire_size(bits) if self.blocks is not None else tk.wire_size(self.size, bits, block_size)


def pieces(shard: int, parts: int, block_size: int, blocks: tk.Blocks | None) -> tuple[Piece, ...]:
    """The ``parts`` pieces of a shard of ``shard`` elements (``blocks``: its parameter-aligned blocks)."""
    return tuple(Piece(k, *cut) for k, cut in enumerate(tk.cut_pieces(shard, parts, block_size, blocks)))


@dataclass(frozen=True)
class RailReduction:
    """One unit's rail all-reduce: its pieces, formats and seeds; :func:`all_reduce` runs it.

    Args:
        topology: the job's ranks (the rail: this rank's local rank on each of the K nodes).
        pieces: the shard's K pieces (:func:`pieces`), piece k reduced by rail rank k (the rank on node k).
        gradients: the job's rail reduction (bits, gather bits, block size, rounding, rotation).
        multiplier: what the fp32 sum of the K pieces is scaled by (AVG: 1 / K).
        call: the reduction's number in the job, for stochastic rounding's and rotation's seeds (None: fresh
            rounding seeds, no rotation).
        backend: the kernels' backend.
    """

    topology: Topology
    pieces: tuple[Piece, ...]
    gradients: GradientReduction
    multiplier: float
    call: int | None
    backend: str

    @classmethod
    def of(cls, topology: Topology, gradients: GradientReduction, shard: int, blocks: tk.Blocks | None,
           multiplier: float, call: int | None, backend: str) -> RailReduction:  # fmt: skip
        cut = pieces(shard, topology.num_nodes, gradients.block_size, blocks)
        if not gradients.stochastic and gradients.rotation == "none":
            call = None
        return cls(topology, cut, gradients, multiplier, call, backend)

    @property
    def mine(self) -> Piece:
        """The piece this rank reduces (its node's index on the rail)."""
        return self.pieces[self.topology.node]

    def seed(self, piece: Piece) -> int | None:
        """Stochastic rounding's seed for quantizing ``piece`` on this rank at this call (None: fresh, or nearest)."""
        if self.call is None or not self.gradients.stochastic:
            return None
        return hash((self.call, self.topology.rank, 1, piece.index)) & 0x7FFFFFFF

    def rotation_seed(self, piece: Piece) -> int | None:
        """The rotation of ``piece``'s blocks at this call: the same on every rail rank (their K copies are summed
        in one rotated basis), new at every call."""
        if self.call is None or self.gradients.rotation == "none":
            return None
        return hash((self.call, piece.index, 5)) & 0x7FFFFFFF

    def feedback_shape(self) -> list[tuple[int, int]]:
        """``(size, blocks)`` per piece: the residual rows error feedback keeps (one row per piece this rank sends)."""
        return [(p.size, p.block_count(self.gradients.block_size)) for p in self.pieces]

    def gather_feedback_shape(self) -> list[tuple[int, int]]:
        """``(size, blocks)`` of the gather's residual (the owner's piece; none for a bf16 gather or an empty piece)."""
        mine = self.mine
        if self.gradients.gather_bits == 16 or not mine.size:
            return []
        return [(mine.size, mine.block_count(self.gradients.block_size))]


def all_reduce(
    shard: torch.Tensor,
    reduction: RailReduction,
    rail: dist.ProcessGroup,
    ledger: CommLedger,
    residuals: list[dict[str, Any]] | None = None,
    gather_residual: dict[str, Any] | None = None,
    vectors: vec.Spans = (),
) -> None:
    """Replaces ``shard`` (this rank's node-reduced shard) by the mean (sum, as ``reduction.multiplier`` says) over the
    rail, in place, identical on every rail rank. ``residuals``: error feedback keywords per piece (``residual``
    ``(1, size)`` and so on; updated in place); ``gather_residual``: the same for the reduced piece this rank sends to
    every rail rank (INT4 / INT8 gather: the owner keeps what its rounding lost). ``vectors``: spans of the shard
    all-reduced exactly, their values cut in K near-equal parts that ride the two all-to-alls after the pieces."""
    g, topo = reduction.gradients, reduction.topology
    flat = shard.view(-1)
    expected = sum(p.size for p in reduction.pieces)
    if flat.numel() != expected:
        raise RuntimeError(
            f"quantized HSDP: the shard has {flat.numel()} elements, but the reduction is for {expected}."
        )
    rail_ranks, block, bits = topo.rail_ranks(), g.block_size, g.inter_bits
    K, mine = len(rail_ranks), reduction.mine
    carried = vec.take(flat.view(1, -1), vectors) if vectors else None
    # the vectors' part k (of K near-equal parts) is reduced by rail rank k, as an exact all-reduce cuts its buffer
    V, element = (carried.width, carried.values.element_size()) if carried is not None else (0, 0)
    cuts = [V * k // K for k in range(K + 1)]
    part_bytes = [(b - a) * element for a, b in zip(cuts, cuts[1:])]  # all 0 without vectors
    if carried is not None:
        ledger.record_carried(vec.RAIL_KIND, rail_ranks, [n + part_bytes[topo.node] for n in part_bytes])
    # 2. quantize every piece for its owner (the vectors' part for that owner after it); one all-to-all
    rows = []
    for p in reduction.pieces:
        row = torch.empty(0, dtype=torch.uint8, device=flat.device)
        if p.size:
            feedback = residuals[p.index] if residuals is not None else {}
            row = tk.quantize(
                flat[p.start : p.start + p.size].view(1, -1), bits, block, blocks=p.blocks, backend=reduction.backend,
                stochastic=g.stochastic, seed=reduction.seed(p), rotation_seed=reduction.rotation_seed(p), **feedback,
            ).view(-1)  # fmt: skip
        if carried is not None:
            part = carried.values[:, cuts[p.index] : cuts[p.index + 1]]
            row = vec.attach(row.view(1, -1), part).view(-1)
        rows.append(row)
    sent = [row.numel() for row in rows]
    wire = mine.wire(bits, block)
    width = wire + part_bytes[topo.node]
    received = torch.empty(K * width, dtype=torch.uint8, device=flat.device)
    ledger.record_to_peers(REDUCE_KIND, rail_ranks, [n - extra for n, extra in zip(sent, part_bytes)])
    dist.all_to_all_single(received, torch.cat(rows), [width] * K, sent, group=rail)
    received = received.view(K, width)
    own_part = None  # my part of the vectors: the fp32 sum of its K copies, scaled, in the shard's dtype
    if carried is not None:
        received, values = vec.detach(received, wire, carried.values.dtype)
        own_part = (values.float().sum(0) * reduction.multiplier).to(carried.values.dtype)
    # 3. my piece: the fp32 sum of K copies, scaled
    reduced = None
    if mine.size:
        reduced = tk.dequantize_reduce(
            received, mine.size, bits, block, multiplier=reduction.multiplier,
            dtype=torch.float32, blocks=mine.blocks, backend=reduction.backend,
            rotation_seed=reduction.rotation_seed(mine),
        )  # fmt: skip
    # 4. the reduced piece, rounded for the wire, to every rail rank (myself included: replicas match bit for bit)
    gather_bits = g.gather_bits
    if reduced is None:
        own = torch.empty(0, dtype=torch.uint8, device=flat.device)
    elif gather_bits == 16:
        own = reduced.to(torch.bfloat16).view(torch.uint8)
    else:
        own = tk.quantize(reduced.view(1, -1), gather_bits, block, blocks=mine.blocks, backend=reduction.backend,
                          **(gather_residual or {})).view(-1)  # fmt: skip
    ledger.record_to_peers(GATHER_KIND, rail_ranks, own.numel())
    if own_part is not None:
        own = vec.attach(own.view(1, -1), own_part.view(1, -1)).view(-1)
    wires = [p.wire(gather_bits, block) for p in reduction.pieces]
    gathered_sizes = [n + extra for n, extra in zip(wires, part_bytes)]
    gathered = torch.empty(sum(gathered_sizes), dtype=torch.uint8, device=flat.device)
    dist.all_to_all_single(gathered, own.repeat(K), gathered_sizes, [own.numel()] * K, group=rail)
    # 5. every piece into the shard (and every part of the vectors, the owner's included, as it was sent)
    at, landed = 0, []
    for p, size, n in zip(reduction.pieces, gathered_sizes, wires):
        row, at = gathered[at : at + size], at + size
        if carried is not None:
            row, part = vec.detach(row.view(1, -1), n, carried.values.dtype)
            row = row.view(-1)
            landed.append(part.view(-1))
        if not p.size:
            continue
        target = flat[p.start : p.start + p.size]
        if gather_bits == 16:
            target.copy_(row.view(torch.bfloat16))
        else:
            tk.dequantize(row, p.size, gather_bits, block, target.dtype, out=target, blocks=p.blocks,
                          backend=reduction.backend)  # fmt: skip
    if carried is not None:
        vec.write(flat, carried.spans, torch.cat(landed))


def exact_all_reduce(shard: torch.Tensor, multiplier: float, rail: dist.ProcessGroup, topology: Topology,
                     ledger: CommLedger) -> None:  # fmt: skip
    """The rail's all-reduce in full precision (quantized HSDP after ``quantize_gradients_steps``): recorded as any
    all-reduce algorithm must move it, a reduce-scatter of the shard in one piece per rail rank and an all-gather of
    this rank's piece."""
    record_exact(shard, topology, ledger)
    dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=rail)
    if multiplier != 1.0:
        shard.mul_(multiplier)


def record_exact(reduced: torch.Tensor, topology: Topology, ledger: CommLedger) -> None:
    """The ledger entry of an exact all-reduce of ``reduced`` on this rank's rail."""
    ranks = topology.rail_ranks()
    chunks = all_reduce_chunks(reduced.numel(), reduced.element_size(), len(ranks), ranks.index(topology.rank))
    ledger.record_to_peers(EXACT_KIND, ranks, chunks)
