"""Norm gains and biases reduced exactly beside qgZ (``gradient_quantization_scope="matrices"``).

A norm's gain sums its gradient over every token, so one block of it holds a few large coordinates and many that INT4
rounds to noise; Adam's second moment then grows with that noise and the gain's steps shorten. Parameters of fewer
than two dimensions are a small share of a model's elements (a few per mille in a transformer), so their gradients
can travel exactly at a few bytes more per step.

Every rank's chunk of FSDP's reduce-scatter input lays the parameters out the same way, so the vectors' spans
(:meth:`~lightning_zeropp.blocks.UnitBlocks.vector_spans`) are the same columns of every chunk::

    1. copy those columns of the W chunks into one (W, V) buffer, and zero them in the input
    2. start the exact reduce-scatter of that buffer on the data-parallel group (FSDP's op, in its reduce dtype)
    3. qgZ reduces the input: the zeroed spans are whole blocks of zeros (blocks follow the parameters), which
       quantize to zero, leave no error feedback residual and add no noise to the second-moment estimate
    4. wait, and write this rank's V reduced elements over the spans of the output

Bytes: V elements in the reduce dtype to each of the W - 1 peers (a reduce-scatter of W x V), recorded as
``gradient_reduce_scatter_vectors``; the zeroed blocks still cross qgZ's hops as INT4 zeros and their scales.

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
from .topology import Topology

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
    group: dist.ProcessGroup,
    ranks: list[int],
    ledger: CommLedger,
) -> VectorReduction:
    """Steps 1 and 2: takes the ``spans`` columns out of the W chunks of ``input`` (zeroing them there) and starts
    their reduce-scatter with ``base_op`` (AVG or SUM; ``premul``: PREMUL_SUM's factor) on ``group``."""
    taken = _take(input.view(-1, chunk), spans)
    if premul is not None:
        taken.mul_(premul)
    reduced = taken.new_empty(taken.shape[1])
    ledger.record_to_peers(KIND, ranks, reduced.numel() * reduced.element_size())
    work = reduce_scatter_flat(reduced, taken.view(-1), group, base_op, async_op=True)
    return VectorReduction(spans, work, reduced)


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
    """Step 4: waits for the exact reduction and writes this rank's reduced vectors over their spans of ``output``
    (the reduce-scatter's output chunk, or the rail's shard)."""
    if reduction.work is not None:
        reduction.work.wait()
    if reduction.multiplier != 1.0:
        reduction.reduced.mul_(reduction.multiplier)
    out, offset = output.view(-1), 0
    for a, b in reduction.spans:
        out[a:b].copy_(reduction.reduced[offset : offset + b - a])
        offset += b - a


def elements(spans: Spans | None) -> int:
    """The elements of a chunk the spans cover (0 for None: a chunk whose layout is not known is quantized whole)."""
    return sum(b - a for a, b in spans) if spans else 0
