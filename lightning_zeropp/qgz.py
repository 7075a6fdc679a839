"""qgZ: the gradient reduce-scatter as a 2-hop all-to-all of quantized blocks, reduced in fp32.

FSDP's input is W = N x K equal chunks in rank order (chunk j -> rank j = node k * N + local l); the output is this
rank's reduced chunk. For each pipeline stage s (piece s of every chunk)::

    1. swizzle + quantize     chunk k*N + l -> slot l*K + k; INT8 (intra_node_gradient_bits)   [fused kernel]
    2. all-to-all in the node slots [l*K, (l+1)*K) go to local peer l
    3. dequantize N copies, sum in fp32, re-quantize to INT4 (gradient_bits)               [fused kernel]
    4. all-to-all on the rail piece for node k goes to the rank with my local rank on node k
    5. dequantize K pieces, sum in fp32, apply AVG / SUM / PREMUL_SUM, write the output    [fused kernel]

Blocks: with parameter-aligned blocks (``blocks``, the chunk's :class:`~lightning_zeropp.kernels.layout.Blocks`),
no block holds two parameters on either hop, and the pieces are cut at block boundaries (``Blocks.stages``).

Error feedback (``residuals``, per stage the kernels' error feedback keywords for ``(K, piece)``: an fp32 or bf16
residual, or INT8 codes with a scale per block of the piece; see :mod:`~lightning_zeropp.feedback`) sits on the INT4
inter-node hop, where the error is: step 3 quantizes ``sum + decay * residual`` and keeps what that lost in
``residual`` for the next call, in the same pass.
A residual there covers the K pieces this rank sends, M / N elements per rank; one on the intra-node hop would cover
the W pieces it sends (M per rank) to correct an INT8 error 16x smaller.

Rotation (``gradient_rotation="hadamard"``): step 3 rotates each block of the node's sum before quantizing it for
the rail (signs from a seed of the call and stage, the same on every rank), and step 5 un-rotates the sum of the K
pieces once; a residual is kept in the unrotated coordinates, since the next call's rotation differs.

Second-moment correction (``noise``, one fp32 per block of the chunk): step 5 adds, for each block, the noise
variance its K pieces' rounding left in the reduced sum, ``multiplier^2 * noise_factor * sum_k scale_k^2``, read from
the received scales (no byte more on the wire; see :mod:`~lightning_zeropp.moments`).

Norm gains and biases (``vectors``, ``gradient_quantization_scope="matrices"``): their spans are taken out of the
input before step 1 and ride the last stage's two all-to-alls as raw bytes after its quantized rows, summed exactly
(see :mod:`~lightning_zeropp.vectors`).

Stage s + 1's intra-node hop is started before stage s's inter-node hop is waited on, so the two links work at once.
Nothing is divided before the last step: AVG divides the fp32 sum by W exactly once. The sizes are free: any chunk
length (tails are partial blocks), 1-D or not, any N and K. With N = 1 the intra hop is skipped (nothing to send);
with K = 1 the inter hop is skipped and the N copies are reduced straight into the output.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import kernels as tk
from . import vectors as vec
from .commplan import GradientReduction
from .ledger import CommLedger
from .topology import ProcessGroups, Topology


class Stage(NamedTuple):
    """One pipeline stage: piece ``index`` of every chunk, ``size`` elements from ``start``, in ``blocks`` (the
    piece's own aligned blocks; None: flat)."""

    index: int
    start: int
    size: int
    blocks: tk.Blocks | None

    def block_count(self, block_size: int) -> int:
        """The quantization blocks of the piece: its aligned blocks, or uniform blocks of ``block_size``."""
        return self.blocks.count if self.blocks is not None else -(-self.size // block_size)


class _Hop(NamedTuple):
    """An all-to-all in flight: its work handle (None where nothing was sent), the buffer it receives into, and the
    bytes of a row's quantized piece (the rest of a row, if any, is the vectors' carried values)."""

    work: dist.Work | None
    recv: torch.Tensor | None
    wire: int = 0


@dataclass(frozen=True)
class Reduction:
    """One reduction's shapes, computed once from the topology, the chunk length and the job's two-hop reduction:
    what every hop of every stage sends and how it rounds; :func:`quantized_reduce_scatter` runs it.

    Args:
        topology: the job's ranks (N per node, K nodes).
        chunk: elements of this rank's output (one of the W chunks of the input).
        stages: every pipeline stage's piece of a chunk (:func:`stages`; sizes may be 0).
        blocks: the whole chunk's parameter-aligned blocks (None: flat blocks).
        multiplier: what the fp32 sum is scaled by at the end (AVG's 1 / W, PREMUL_SUM's factor).
        call: the reduction's number in the job, for stochastic rounding's and rotation's seeds; None: the kernels
            draw fresh rounding seeds (and blocks are not rotated).
        gradients: the bits per hop, block size, pieces, rounding and rotation (the job's
            :class:`~lightning_zeropp.commplan.GradientReduction`).
        backend: the kernels' backend.
    """

    topology: Topology
    chunk: int
    stages: tuple[Stage, ...]
    blocks: tk.Blocks | None
    multiplier: float
    call: int | None
    gradients: GradientReduction
    backend: str

    @classmethod
    def of(cls, topology: Topology, gradients: GradientReduction, chunk: int, base_op, premul: float | None, *,
           call: int | None = None, blocks: tk.Blocks | None = None, backend: str = "auto") -> Reduction:  # fmt: skip
        """The reduction of W chunks of ``chunk`` elements with FSDP's ``base_op`` (AVG or SUM) and ``premul``
        (PREMUL_SUM's factor, or None), as ``gradients`` (the job plan's two-hop reduction) sets it. ``call`` numbers
        the reductions of a job (see :func:`quantized_reduce_scatter`); ``blocks``: the chunk's parameter-aligned
        blocks (None: flat blocks); ``backend``: the kernels'."""
        g = gradients
        multiplier = premul if premul is not None else 1.0
        if base_op == dist.ReduceOp.AVG:
            multiplier /= topology.world_size
        pieces = tuple(Stage(s, *piece) for s, piece in enumerate(stages(chunk, g.pieces, g.block_size, blocks)))
        if not g.stochastic and g.rotation == "none":
            call = None
        return cls(topology, chunk, pieces, blocks, multiplier, call, g, backend)

    @property
    def busy(self) -> tuple[Stage, ...]:
        """The stages with elements to reduce, in order."""
        return tuple(stage for stage in self.stages if stage.size)

    @property
    def stochastic(self) -> bool:
        return self.gradients.stochastic

    def seed(self, hop: int, stage: Stage) -> int | None:
        """The seed of hop ``hop``'s quantization (0: intra-node, 1: inter-node) in ``stage``: one per (call, rank,
        hop, stage) for stochastic rounding, so the noise is independent everywhere and reproducible. Without a call
        number the kernels draw a fresh seed."""
        if self.call is None or not self.stochastic:
            return None
        # ints hash to themselves: the same in every process
        return hash((self.call, self.topology.rank, hop, stage.index)) & 0x7FFFFFFF

    def first_block(self, stage: Stage) -> int:
        """The index, among the chunk's blocks, of ``stage``'s first block (pieces are cut at block boundaries)."""
        if self.blocks is None:
            return stage.start // self.gradients.block_size
        return bisect.bisect_left(self.blocks.starts, stage.start)

    def rotation_seed(self, stage: Stage) -> int | None:
        """The seed of the inter-node hop's block rotation in ``stage`` (``gradient_rotation="hadamard"``), or None:
        one per (call, stage), the same on every rank (the K pieces summed on a rail must share their rotation), and
        new at every reduction, so no block keeps an unlucky rotation."""
        if self.call is None or self.gradients.rotation == "none":
            return None
        return hash((self.call, stage.index, 3)) & 0x7FFFFFFF


def quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    reduction: Reduction,
    groups: ProcessGroups,
    ledger: CommLedger,
    residuals: list[dict[str, Any]] | None = None,
    noise: torch.Tensor | None = None,
    noise_factor: float = 1 / 12,
    vectors: vec.Spans = (),
) -> None:
    """Reduces ``input`` (W chunks) into ``output`` (this rank's chunk) as ``reduction`` says. With stochastic rounding,
    the noise of call ``c`` on rank ``r`` is fixed by ``(c, r)`` (``reduction.call``), so a run is reproducible and no
    two calls or ranks share noise. ``residuals``: error feedback state, per stage of ``reduction.stages`` the kernels'
    keywords ``residual`` (``(K, size)``), ``residual_scales`` (INT8 codes only) and ``decay``; updated in place.
    ``noise``: the second-moment correction's accumulator, one fp32 per block of the chunk, into which each block's
    noise variance (``noise_factor`` times its K pieces' squared scales, times the multiplier squared) is added.
    ``vectors``: spans of a chunk reduced exactly (zeroed in ``input``), carried by the last stage's hops."""
    W, chunk = reduction.topology.world_size, output.numel()
    if chunk != reduction.chunk:
        raise RuntimeError(
            f"qgZ: reduce-scatter output has {chunk} elements, but the reduction is for {reduction.chunk}."
        )
    if input.numel() != W * chunk:
        raise RuntimeError(f"qgZ: reduce-scatter input has {input.numel()} elements, expected {W} x {chunk}.")
    if reduction.chunk == 0:
        return
    out = output.view(-1)
    # Streams (CUDA): FSDP calls this on its reduce-scatter stream, and every buffer below is made, sent, received and
    # read on it (``work.wait()`` makes the current stream wait for the collective); the output is complete in stream
    # order when this returns, which is what FSDP's reduce-scatter event records.
    busy = reduction.busy
    carried = vec.take(input.view(W, chunk), vectors) if vectors else None

    def riding(i: int) -> vec.Carried | None:
        """The last stage's hops carry the vectors: its output is written last, so no stage's zeros overwrite them."""
        return carried if i == len(busy) - 1 else None

    intra = _start_intra(reduction, busy[0], input, groups, ledger, riding(0))
    in_flight: tuple[Stage, _Hop, vec.Carried | None] | None = None
    for i, stage in enumerate(busy):
        feedback = residuals[stage.index] if residuals is not None else None
        to_rail = _reduce_in_node(reduction, stage, input, intra, feedback, out, riding(i))
        inter = _start_inter(*to_rail, groups, ledger) if to_rail is not None else None
        if i + 1 < len(busy):  # the next stage's intra-node hop overlaps this stage's inter-node hop
            intra = _start_intra(reduction, busy[i + 1], input, groups, ledger, riding(i + 1))
        if in_flight is not None:
            _finish(reduction, *in_flight, out, noise, noise_factor)
        in_flight = (stage, inter, riding(i)) if inter is not None else None
    if in_flight is not None:
        _finish(reduction, *in_flight, out, noise, noise_factor)


def _start_intra(reduction: Reduction, stage: Stage, input: torch.Tensor, groups: ProcessGroups, ledger: CommLedger,
                 carried: vec.Carried | None = None) -> _Hop:  # fmt: skip
    """Steps 1 and 2: swizzle and quantize the stage's pieces (each slot's row followed by its chunk's ``carried``
    values), start the all-to-all inside the node."""
    topo, g = reduction.topology, reduction.gradients
    N, K = topo.ranks_per_node, topo.num_nodes
    if N == 1:
        return _Hop(None, None)
    send = tk.swizzle_quantize(
        input, N, K, g.pieces, stage.index, g.intra_bits, g.block_size,
        blocks=reduction.blocks, backend=reduction.backend, stochastic=reduction.stochastic,
        seed=reduction.seed(0, stage),
    )  # fmt: skip
    wire = send.shape[1]
    ledger.record_to_peers("gradient_all_to_all_intra", topo.intra_node_ranks(), K * wire)
    if carried is not None:  # chunk k*N + l's values to slot l*K + k, as the swizzle does
        values = carried.values.view(K, N, -1).transpose(0, 1).reshape(N * K, -1)
        ledger.record_carried(vec.KIND, topo.intra_node_ranks(), K * values[0].numel() * values.element_size())
        send = vec.attach(send, values)
    recv = torch.empty_like(send)
    return _Hop(dist.all_to_all_single(recv, send, group=groups.intra_node, async_op=True), recv, wire)


def _reduce_in_node(reduction: Reduction, stage: Stage, input: torch.Tensor, intra: _Hop,
                    feedback: dict[str, Any] | None, out: torch.Tensor,
                    carried: vec.Carried | None) -> tuple[torch.Tensor, int] | None:  # fmt: skip
    """Steps 3 (K > 1: returns the rows for the rail and their quantized bytes, the node's sums of the ``carried``
    values after them) or 3 + 5 (K == 1: writes the output)."""
    topo, g = reduction.topology, reduction.gradients
    N, K = topo.ranks_per_node, topo.num_nodes
    start, size, backend = stage.start, stage.size, reduction.backend
    if intra.work is not None:
        intra.work.wait()
    received, node = intra.recv, None  # node: (K, V), this node's fp32 sums of the values of the K chunks I forward
    if carried is not None and N == 1:  # my own rows: chunk k (of W = K) goes to node k
        node = carried.values.float()
    elif carried is not None:
        received, values = vec.detach(received, intra.wire, carried.values.dtype)
        node = torch.sum(values.view(N, K, -1), 0, dtype=torch.float32)
    if K == 1:
        tk.dequantize_reduce(
            received, size, g.intra_bits, g.block_size, multiplier=reduction.multiplier,
            out=out[start : start + size], blocks=stage.blocks, backend=backend,
        )  # fmt: skip
        if node is not None:
            vec.write(out, carried.spans, node[0] * reduction.multiplier)
        return None
    feedback = feedback or {}
    if N == 1:  # nothing arrived from local peers: this rank's own K pieces go straight to the rail
        own = input.view(topo.world_size, reduction.chunk)[:, start : start + size]
        rows = tk.quantize(own, g.inter_bits, g.block_size, blocks=stage.blocks, backend=backend,
                           stochastic=reduction.stochastic, seed=reduction.seed(1, stage),
                           rotation_seed=reduction.rotation_seed(stage), **feedback)  # fmt: skip
    else:
        rows = tk.dequantize_reduce_quantize(
            received.view(N, K, -1), size, g.intra_bits, g.inter_bits, g.block_size,
            blocks=stage.blocks, backend=backend, stochastic=reduction.stochastic, seed=reduction.seed(1, stage),
            rotation_seed=reduction.rotation_seed(stage), **feedback,
        )  # fmt: skip
    wire = rows.shape[1]
    if node is not None:  # rounded once to the reduce dtype for the wire
        rows = vec.attach(rows, node.to(carried.values.dtype))
    return rows, wire


def _start_inter(send: torch.Tensor, wire: int, groups: ProcessGroups, ledger: CommLedger) -> _Hop:
    """Step 4: the all-to-all on the rail (rows of ``wire`` quantized bytes, and any carried values after them)."""
    recv = torch.empty_like(send)
    rail = groups.topology.rail_ranks()
    ledger.record_to_peers("gradient_all_to_all_inter", rail, wire)
    if send.shape[1] > wire:
        ledger.record_carried(vec.KIND, rail, send.shape[1] - wire)
    return _Hop(dist.all_to_all_single(recv, send, group=groups.inter_node, async_op=True), recv, wire)


def _finish(reduction: Reduction, stage: Stage, inter: _Hop, carried: vec.Carried | None, out: torch.Tensor,
            noise: torch.Tensor | None = None, noise_factor: float = 1 / 12) -> None:  # fmt: skip
    """Step 5: sum the K pieces from the rail into the output (and, with ``noise``, their blocks' noise variance);
    with ``carried``, the K node sums of this rank's vectors, over their spans."""
    g = reduction.gradients
    inter.work.wait()
    received, values = inter.recv, None
    if carried is not None:
        received, values = vec.detach(received, inter.wire, carried.values.dtype)
    if noise is not None:
        count = stage.block_count(g.block_size)
        bits = g.inter_bits
        offset = stage.blocks.scale_offset(bits) if stage.blocks is not None else tk.scale_offset(stage.size, bits)
        scales = received[:, offset : offset + 4 * count].view(torch.float32)  # (K, count)
        first = reduction.first_block(stage)
        variance = scales.square().sum(0)
        if reduction.rotation_seed(stage) is not None:
            variance = variance * _unrotated_share(stage, g.block_size, variance.device)
        noise[first : first + count] += variance * (noise_factor * reduction.multiplier**2)
    tk.dequantize_reduce(
        received, stage.size, g.inter_bits, g.block_size, multiplier=reduction.multiplier,
        out=out[stage.start : stage.start + stage.size], blocks=stage.blocks, backend=reduction.backend,
        rotation_seed=reduction.rotation_seed(stage),
    )  # fmt: skip
    if values is not None:
        vec.write(out, carried.spans, torch.sum(values, 0, dtype=torch.float32).mul_(reduction.multiplier))


def _unrotated_share(stage: Stage, block_size: int, device: torch.device) -> torch.Tensor:
    """Per block of ``stage``, the share of a rotated block's rounding variance that reaches an element after the
    inverse rotation: a block is rotated in power-of-two pieces (its length in binary), whose unnormalized inverse
    divides by the piece's size, so an element of a piece of ``P`` keeps ``1 / P``; the block's mean, ``pieces /
    length``, is what its one value holds (``1 / block_size`` for a whole power-of-two block)."""
    if stage.blocks is not None:
        lengths = [b - a for a, b in zip(stage.blocks.starts, stage.blocks.starts[1:])]
    else:
        tail = [stage.size % block_size] if stage.size % block_size else []
        lengths = [block_size] * (stage.size // block_size) + tail
    return torch.tensor([bin(n).count("1") / n for n in lengths], device=device)


def stages(
    chunk: int, pieces: int, block_size: int, blocks: tk.Blocks | None
) -> list[tuple[int, int, tk.Blocks | None]]:
    """``(start, size, piece blocks)`` of each of the ``pieces`` pipeline stages' piece of a chunk (sizes may be 0)."""
    return tk.cut_pieces(chunk, pieces, block_size, blocks)
