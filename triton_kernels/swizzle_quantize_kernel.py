"""qgZ step 1 in one pass: read piece ``stage`` of every chunk in swizzled order and quantize it.

The slot -> chunk map (``layout.swizzle_order``: slot ``l*K + k`` <- chunk ``k*N + l``) and the piece offset are
computed per program from its row index, so no reordered copy of the gradient is ever written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import load_pairs, quantize_tile, store_tile, tile_offsets, uniform_pairs
from .layout import QMAX, check_format, num_blocks, scale_offset, stage_bounds, wire_size
from .quantize_kernel import check_input, stochastic_seed, tile_shape


@triton.jit
def _swizzle_quantize_kernel(x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, scale_row0, bs, nb, seed,
                             BITS: tl.constexpr, QMAX: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                             STOCHASTIC: tl.constexpr):  # fmt: skip
    pid, slot = tl.program_id(0), tl.program_id(1).to(tl.int64)
    src = (slot % K) * N + slot // K  # the chunk that travels in this slot
    e, m, blk, blk_ok = tile_offsets(pid, bs, n, nb, G, HALF)
    xe, xo = load_pairs(x_ptr + src * chunk + start, e, m, G, HALF)
    ue = xe
    uo = xo
    if STOCHASTIC:
        ue, uo = uniform_pairs(seed, slot * n + e, G, HALF)
    qe, qo, scale = quantize_tile(xe, xo, ue, uo, QMAX, STOCHASTIC)
    store_tile(out_ptr, scale_ptr, slot * wire, slot * (wire // 4) + scale_row0, e, m, blk, blk_ok, bs, n, qe, qo,
               scale, BITS, G, HALF)  # fmt: skip


def swizzle_quantize(
    x: torch.Tensor,
    ranks_per_node: int,
    num_nodes: int,
    stages: int,
    stage: int,
    bits: int,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int | None = None,
) -> torch.Tensor:
    check_format(bits, block_size)
    x = check_input(x, "swizzle_quantize")
    W = ranks_per_node * num_nodes
    if x.dim() != 1 or x.numel() % W:
        raise ValueError(f"swizzle_quantize: expected a flat buffer of {W} equal chunks, got shape {tuple(x.shape)}.")
    chunk = x.numel() // W
    start, n = stage_bounds(chunk, stages, stage)
    wire = wire_size(n, bits, block_size)
    out = torch.zeros(W, wire, dtype=torch.uint8, device=x.device)
    if n:
        nb = num_blocks(n, block_size)
        G, HALF = tile_shape(block_size)
        _swizzle_quantize_kernel[(triton.cdiv(nb, G), W)](
            x, out, out.view(torch.float32), n, chunk, start, ranks_per_node, num_nodes, wire,
            scale_offset(n, bits) // 4, block_size, nb, stochastic_seed(seed) if stochastic else 0,
            BITS=bits, QMAX=QMAX[bits], G=G, HALF=HALF, STOCHASTIC=stochastic,
        )  # fmt: skip
    return out
