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

Error feedback (``residuals``, one fp32 ``(K, piece)`` tensor per stage) sits on the INT4 inter-node hop, where the
error is: step 3 quantizes ``sum + decay * residual`` and keeps what that lost in ``residual`` for the next call.
A residual there covers the K pieces this rank sends, M / N elements per rank; one on the intra-node hop would cover
the W pieces it sends (M per rank) to correct an INT8 error 16x smaller.

Stage s + 1's intra-node hop is started before stage s's inter-node hop is waited on, so the two links work at once.
Nothing is divided before the last step: AVG divides the fp32 sum by W exactly once. The sizes are free: any chunk
length (tails are partial blocks), 1-D or not, any N and K. With N = 1 the intra hop is skipped (nothing to send);
with K = 1 the inter hop is skipped and the N copies are reduced straight into the output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import kernels as tk
from .config import ZeroPPConfig
from .ledger import CommLedger
from .topology import ProcessGroups


def _seed(call: int | None, rank: int, hop: int, stage: int) -> int | None:
    """A seed per (call, rank, hop, stage) for stochastic rounding: independent noise everywhere, reproducible.
    Without a call number the kernels draw a fresh seed."""
    if call is None:
        return None
    return hash((call, rank, hop, stage)) & 0x7FFFFFFF  # ints hash to themselves: the same in every process


def quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    base_op,
    premul: float | None,
    groups: ProcessGroups,
    ledger: CommLedger,
    config: ZeroPPConfig,
    *,
    call: int | None = None,
    blocks: tk.Blocks | None = None,
    residuals: list[torch.Tensor] | None = None,
) -> None:
    """Reduces ``input`` (W chunks) into ``output`` (this rank's chunk). ``call`` numbers the reductions of a job
    (:class:`~lightning_zeropp.comm.ZeroPPComms` counts them): with stochastic rounding, the noise of call ``c`` on
    rank ``r`` is fixed by ``(c, r)``, so a run is reproducible and no two calls or ranks share noise. ``blocks``: the
    chunk's parameter-aligned blocks (None: flat blocks). ``residuals``: error feedback state, per stage of
    :func:`stages` a float32 ``(K, size)`` tensor, updated in place."""
    topo = groups.topology
    N, K, W = topo.ranks_per_node, topo.num_nodes, topo.world_size
    chunk = output.numel()
    if input.numel() != W * chunk:
        raise RuntimeError(f"qgZ: reduce-scatter input has {input.numel()} elements, expected {W} x {chunk}.")
    if chunk == 0:
        return
    multiplier = premul if premul is not None else 1.0
    if base_op == dist.ReduceOp.AVG:
        multiplier /= W
    stochastic = config.gradient_rounding == "stochastic"
    intra_bits, inter_bits, block = config.intra_node_gradient_bits, config.gradient_bits, config.gradient_block_size
    backend = config.kernel_backend
    call = call if stochastic else None
    flat_out = output.view(-1)
    intra_ranks, rail_ranks = topo.intra_node_ranks(), topo.rail_ranks()

    # Streams (CUDA): FSDP calls this on its reduce-scatter stream, and every buffer below is made, sent, received and
    # read on it (``work.wait()`` makes the current stream wait for the collective); the output is complete in stream
    # order when this returns, which is what FSDP's reduce-scatter event records.
    pieces = stages(chunk, config, blocks)
    stages_ = [(s, start, size, piece) for s, (start, size, piece) in enumerate(pieces) if size]
    decay = config.error_feedback_decay

    def start_intra(s: int):
        if N == 1:
            return None, None
        send = tk.swizzle_quantize(
            input, N, K, config.gradient_pieces, s, intra_bits, block,
            stochastic=stochastic, seed=_seed(call, topo.rank, 0, s), blocks=blocks, backend=backend,
        )  # fmt: skip
        recv = torch.empty_like(send)
        ledger.record_to_peers("gradient_all_to_all_intra", intra_ranks, K * send.shape[1])
        return dist.all_to_all_single(recv, send, group=groups.intra_node, async_op=True), recv

    def reduce_in_node(s: int, start: int, size: int, piece, work, recv) -> torch.Tensor | None:
        """Steps 3 (K > 1: returns the buffer for the rail) or 3 + 5 (K == 1: writes the output)."""
        if work is not None:
            work.wait()
        if K == 1:
            tk.dequantize_reduce(
                recv, size, intra_bits, block, multiplier=multiplier, out=flat_out[start : start + size],
                blocks=piece, backend=backend,
            )  # fmt: skip
            return None
        feedback = {} if residuals is None else {"residual": residuals[s], "decay": decay}
        if N == 1:  # nothing arrived from local peers: this rank's own K pieces go straight to the rail
            own = input.view(W, chunk)[:, start : start + size]
            return tk.quantize(own, inter_bits, block, stochastic=stochastic, seed=_seed(call, topo.rank, 1, s),
                               blocks=piece, backend=backend, **feedback)  # fmt: skip
        return tk.dequantize_reduce_quantize(
            recv.view(N, K, -1), size, intra_bits, inter_bits, block,
            stochastic=stochastic, seed=_seed(call, topo.rank, 1, s), blocks=piece, backend=backend, **feedback,
        )  # fmt: skip

    def start_inter(send: torch.Tensor):
        recv = torch.empty_like(send)
        ledger.record_to_peers("gradient_all_to_all_inter", rail_ranks, send.shape[1])
        return dist.all_to_all_single(recv, send, group=groups.inter_node, async_op=True), recv

    def finish(start: int, size: int, piece, work, recv) -> None:
        work.wait()
        tk.dequantize_reduce(
            recv, size, inter_bits, block, multiplier=multiplier, out=flat_out[start : start + size], blocks=piece,
            backend=backend,
        )  # fmt: skip

    intra = start_intra(stages_[0][0])
    in_flight = None
    for i, (s, start, size, piece) in enumerate(stages_):
        to_rail = reduce_in_node(s, start, size, piece, *intra)
        inter = start_inter(to_rail) if to_rail is not None else None
        if i + 1 < len(stages_):  # the next stage's intra-node hop overlaps this stage's inter-node hop
            intra = start_intra(stages_[i + 1][0])
        if in_flight is not None:
            finish(*in_flight)
        in_flight = (start, size, piece, *inter) if inter is not None else None
    if in_flight is not None:
        finish(*in_flight)


def stages(chunk: int, config: ZeroPPConfig, blocks: tk.Blocks | None) -> list[tuple[int, int, tk.Blocks | None]]:
    """``(start, size, piece blocks)`` of each pipeline stage's piece of a chunk (sizes may be 0)."""
    if blocks is None:
        bounds = (tk.stage_bounds(chunk, config.gradient_pieces, s, config.gradient_block_size)
                  for s in range(config.gradient_pieces))  # fmt: skip
        return [(start, size, None) for start, size in bounds]
    return [(start, piece.numel, piece) for start, piece in blocks.stages(config.gradient_pieces)]
