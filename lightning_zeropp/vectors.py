"""Norm gains and biases reduced exactly inside qgZ's own collectives (``gradient_quantization_scope="matrices"``).

A norm's gain sums its gradient over every token, so one block of it holds a few large coordinates and many that INT4
rounds to noise; Adam's second moment then grows with that noise and the gain's steps shorten. Parameters of fewer
than two dimensions are a small share of a model's elements (a few per mille in a transformer), so their gradients
can travel exactly at a few bytes more per step, and they travel as raw bytes appended to the rows qgZ sends anyway:
no collective more (on a slow link every collective costs a latency, whatever its size).

Every rank's chunk of FSDP's reduce-scatter input lays the parameters out the same way, so the vectors' spans
(:meth:`~lightning_zeropp.blocks.UnitBlocks.vector_spans`) are the same columns of every chunk. In qgZ
(:func:`~lightning_zeropp.qgz.quantized_reduce_scatter`), the last pipeline stage carries them (its output is
written last)::

    1. copy those columns of the W chunks into one (W, V) buffer, and zero them in the input (:func:`take`): with
       parameter-aligned blocks they are whole blocks of zeros, which quantize to zero, leave no error feedback
       residual and add no noise to the second-moment estimate
    2. intra-node all-to-all: the row for slot l*K + k (chunk k*N + l) carries chunk k*N + l's V values after its
       quantized piece (:func:`attach`); local rank l sums the N copies of each of its K rows in fp32
    3. inter-node all-to-all: the row for node k carries the node's sum of chunk k*N + l's values, rounded to the
       reduce dtype; the K sums of this rank's chunk are summed in fp32, scaled once (AVG's 1 / W, PREMUL_SUM's
       factor) and written over the spans of the output (:func:`write`)

So a vector element crosses nodes once per node, not once per rank: K x V elements in the reduce dtype to each of the
N - 1 node peers, and V to each of the K - 1 rail peers (``gradient_reduce_scatter_vectors``, recorded as bytes
carried by qgZ's calls, with no call of their own).

Quantized HSDP (:func:`~lightning_zeropp.rail.all_reduce`) carries them on its rail the same way: after the exact
reduce-scatter inside the node, the V values of the node's shard are cut in K near-equal pieces, piece k rides the
reduce all-to-all to rail rank k, which sums the K copies in fp32 and sends the result with its gathered piece to
every rail rank (``gradient_all_reduce_vectors``: an exact all-reduce's bytes), so replicas stay bit-identical.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

KIND = "gradient_reduce_scatter_vectors"
RAIL_KIND = "gradient_all_reduce_vectors"

Spans = tuple[tuple[int, int], ...]


class Carried(NamedTuple):
    """The vectors' columns of a reduction's rows, taken out of its input: ``spans`` of a row, ``values`` ``(R, V)``
    in the input's dtype (qgZ: the W chunks in rank order; the rail: the one node-reduced shard)."""

    spans: Spans
    values: torch.Tensor

    @property
    def width(self) -> int:
        """V: the values of one row."""
        return self.values.shape[1]


@functools.lru_cache(maxsize=256)
def columns(spans: Spans, device: torch.device) -> torch.Tensor:
    """The columns of ``spans``, in span order, as one index (int64 on ``device``; made once per layout and device:
    a unit's spans repeat every step, and one indexed copy costs a host launch where a copy per span costs one each)."""
    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in spans]).to(device)


def take(rows: torch.Tensor, spans: Spans) -> Carried:
    """The ``spans`` columns of ``rows`` ``(R, row)`` as one ``(R, V)`` tensor; zeroed in ``rows``."""
    index = columns(spans, rows.device)
    values = rows.index_select(1, index)
    rows.index_fill_(1, index, 0)
    return Carried(spans, values)


def attach(wire: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``wire`` rows ``(R, B)`` (uint8) with ``values`` ``(R, V)`` appended as their raw bytes: ``(R, B + V x
    element)``."""
    return torch.cat([wire, values.contiguous().view(torch.uint8)], dim=1)


def detach(received: torch.Tensor, wire: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`attach` for received rows ``(R, wire + V x element)``: the wire rows ``(R, wire)``, a fresh
    contiguous copy (the kernels view the scales in a wire row as fp32, and a row cut from a buffer of such rows can
    start anywhere), and the values ``(R, V)`` of ``dtype``: a view where every row's values start at a multiple of
    their width (qgZ's rows: ``wire`` is whole 16-byte lines), else a copy."""
    values, width = received[:, wire:], dtype.itemsize
    if values.storage_offset() % width or values.stride(0) % width:
        values = values.clone(memory_format=torch.contiguous_format)
    return received[:, :wire].clone(memory_format=torch.contiguous_format), values.view(dtype)


def write(output: torch.Tensor, spans: Spans, reduced: torch.Tensor) -> None:
    """``reduced`` (V values, in span order) written over the ``spans`` of ``output`` (flat), rounded once to its
    dtype."""
    output.view(-1).index_copy_(0, columns(spans, output.device), reduced.to(output.dtype))
