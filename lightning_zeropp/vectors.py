"""Norm gains and biases reduced exactly beside qgZ (``gradient_quantization_scope="matrices"``).

A norm's gain sums its gradient over every token, so one block of it holds a few large coordinates and many that INT4
rounds to noise; Adam's second moment then grows with that noise and the gain's steps shorten. Parameters of fewer
than two dimensions are a small share of a model's elements (a few per mille in a transformer), so their gradients
can travel exactly at a few bytes more per step.

Every rank's chunk of FSDP's reduce-scatter input lays the parameters out the same way, so the vectors' spans
(:meth:`~lightning_zeropp.blocks.UnitBlocks.vector_spans`) are the same columns of every chunk. As qgZ's, their
reduction takes two hops, so that each vector element crosses nodes once per node, not once per rank::

    1. copy those columns of the W chunks into one (W, V) buffer, and zero them in the input
    2. reduce-scatter inside the node (N ranks): local rank l receives the node's sum of the K rows of the ranks
       with local rank l (rank k * N + l on node k), a (K, V) buffer
    3. start the reduce-scatter on the rail (K ranks, one per node): the rank on node k receives the sum of row k,
       its own chunk's vectors (exact, in FSDP's reduce dtype; AVG's 1 / W and PREMUL_SUM's factor applied once)
    4. qgZ reduces the input: the zeroed spans are whole blocks of zeros (blocks follow the parameters), which
       quantize to zero, leave no error feedback residual and add no noise to the second-moment estimate
    5. wait, and write this rank's V reduced elements over the spans of the output

Bytes (``gradient_reduce_scatter_vectors``): K x V elements in the reduce dtype to each of the N - 1 node peers,
and V to each of the K - 1 rail peers; the zeroed blocks still cross qgZ's hops as INT4 zeros and their scales.

Quantized HSDP does the same on its rail (:func:`start_on_rail`): after the exact reduce-scatter inside the node, the
vectors' spans of the node's shard are all-reduced exactly across the K nodes (``gradient_all_reduce_vectors``),
while the rail's INT4 / INT8 all-reduce carries the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .collectives import reduce_scatter_flat
from .ledger import CommLedger, all_reduce_chunks
from .topology import ProcessGroups, Topology

KIND = "gradient_reduce_scatter_vectors"
RAIL_KIND = "gradient_all_reduce_vectors"

Spans = tuple[tuple[int, int], ...]


class VectorReduction(NamedTuple):
    """An exact reduction of the vectors' columns in flight: the spans, its work handle, its output (this rank's
    reduced vectors, in span order) and what the output is scaled by once it arrives."""

    spans: Spans
    work: dist.Work | None
    reduced: torch.Tensor
    multiplier: float = 1.0


def _take(rows: torch.Tensor, spans: Spans) -> torch.Tensor:
    """The ``spans`` columns of ``rows`` (R, chunk) as one (R, V) tensor; zeroed in ``rows``."""
    taken = torch.cat([rows[:, a:b] for a, b in spans], dim=1)
    for a, b in spans:
        rows[:, a:b].zero_()
    return taken


def start(
    input: torch.Tensor,
    chunk: int,
    spans: Spans,
    base_op,
    premul: float | None,
    groups: ProcessGroups,
    ledger: CommLedger,
) -> VectorReduction:
    """Steps 1 to 3: takes the ``spans`` columns out of the W chunks of ``input`` (zeroing them there), reduces them
    inside the node and starts their reduction on the rail, for FSDP's ``base_op`` (AVG or SUM; ``premul``:
    PREMUL_SUM's factor)."""
    topology = groups.topology
    N, K = topology.ranks_per_node, topology.num_nodes
    taken = _take(input.view(-1, chunk), spans)  # (W, V), row k * N + l for the rank on node k with local rank l
    V = taken.shape[1]
    multiplier = (premul if premul is not None else 1.0) / (topology.world_size if base_op == dist.ReduceOp.AVG else 1)
    node = taken
    if N > 1:  # rows regrouped by local rank: block l (K rows) goes to local peer l
        send = taken.view(K, N, V).transpose(0, 1).contiguous()
        node = send.new_empty(K, V)
        ledger.record_to_peers(KIND, topology.intra_node_ranks(), K * V * taken.element_size())
        reduce_scatter_flat(node.view(-1), send.view(-1), groups.intra_node, dist.ReduceOp.SUM)
    if K == 1:
        return VectorReduction(spans, None, node.view(-1), multiplier)
    reduced = node.new_empty(V)
    ledger.record_to_peers(KIND, topology.rail_ranks(), V * taken.element_size())
    work = reduce_scatter_flat(reduced, node.view(-1), groups.inter_node, dist.ReduceOp.SUM, async_op=True)
    return VectorReduction(spans, work, reduced, multiplier)


def start_on_rail(
    shard: torch.Tensor,
    spans: Spans,
    multiplier: float,
    rail: dist.ProcessGroup,
    topology: Topology,
    ledger: CommLedger,
) -> VectorReduction:
    """Quantized HSDP: takes the ``spans`` of this rank's node-reduced ``shard`` out (zeroing them there) and starts
    their exact all-reduce on the ``rail`` (the K nodes' sum, scaled by ``multiplier`` when it arrives)."""
    taken = _take(shard.view(1, -1), spans).view(-1)
    ranks = topology.rail_ranks()
    chunks = all_reduce_chunks(taken.numel(), taken.element_size(), len(ranks), ranks.index(topology.rank))
    ledger.record_to_peers(RAIL_KIND, ranks, chunks)
    work = dist.all_reduce(taken, op=dist.ReduceOp.SUM, group=rail, async_op=True)
    return VectorReduction(spans, work, taken, multiplier)


def finish(reduction: VectorReduction, output: torch.Tensor) -> None:
    """Step 5: waits for the exact reduction and writes this rank's reduced vectors over their spans of ``output``
    (the reduce-scatter's output chunk, or the rail's shard)."""
    if reduction.work is not None:
        reduction.work.wait()
    if reduction.multiplier != 1.0:
        reduction.reduced.mul_(reduction.multiplier)
    out, offset = output.view(-1), 0
    for a, b in reduction.spans:
        out[a:b].copy_(reduction.reduced[offset : offset + b - a])
        offset += b - a
