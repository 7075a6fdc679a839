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
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .collectives import reduce_scatter_flat
from .ledger import CommLedger

KIND = "gradient_reduce_scatter_vectors"

Spans = tuple[tuple[int, int], ...]


class VectorReduction(NamedTuple):
    """An exact reduce-scatter of the vectors' columns in flight: the spans, its work handle and its output."""

    spans: Spans
    work: dist.Work | None
    reduced: torch.Tensor


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
    rows = input.view(-1, chunk)
    taken = torch.cat([rows[:, a:b] for a, b in spans], dim=1)
    for a, b in spans:
        rows[:, a:b].zero_()
    if premul is not None:
        taken.mul_(premul)
    reduced = taken.new_empty(taken.shape[1])
    ledger.record_to_peers(KIND, ranks, reduced.numel() * reduced.element_size())
    work = reduce_scatter_flat(reduced, taken.view(-1), group, base_op, async_op=True)
    return VectorReduction(spans, work, reduced)


def finish(reduction: VectorReduction, output: torch.Tensor) -> None:
    """Steps 4: waits for the reduce-scatter and writes this rank's reduced vectors over their spans of ``output``."""
    if reduction.work is not None:
        reduction.work.wait()
    out, offset = output.view(-1), 0
    for a, b in reduction.spans:
        out[a:b].copy_(reduction.reduced[offset : offset + b - a])
        offset += b - a


def elements(spans: Spans | None) -> int:
    """The elements of a chunk the spans cover (0 for None: a chunk whose layout is not known is quantized whole)."""
    return sum(b - a for a, b in spans) if spans else 0
