"""Block quantization in Triton (INT8, INT4), plain or fused with qgZ's swizzle; bit-identical to the twins'
``reference.quantize`` / ``reference.swizzle_quantize``.

One kernel serves both: output row ``r`` reads input row ``layout.swizzle_source(r, N, K)`` (at ``start`` within a
row of ``chunk`` elements). Plain quantization of R rows is N = 1, K = R (row r reads row r); qgZ's step 1 is the
swizzle (slot ``l*K + k`` <- chunk ``k*N + l``) over piece ``start`` of each chunk, so no reordered copy is ever
written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import LAUNCH_OPTIONS, needs_int64, quantize_grid, stochastic_seed, tile_shape, unit_stride
from ._tiles import (
    is_full_tile,
    load_pairs,
    padded_blocks,
    program_ids,
    quantize_to_row,
    swizzle_source,
    tile_index,
)
from .layout import QMAX, scale_offset, stage_bounds, wire_size


@triton.jit
def _quantize_tile(pid, row, x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, so, seed, BITS: tl.constexpr,
                   QMAX: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                   STOCHASTIC: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    blk, e, t = tile_index(pid, BS, G, HALF)
    xe, xo = load_pairs(x_ptr + swizzle_source(row, N, K) * chunk + start, e, t, n, MASKED, BS, G, HALF)
    quantize_to_row(out_ptr, scale_ptr, row, pid, wire, so, padded_blocks(n, BS), xe, xo, seed, e, blk, t, BITS, QMAX,
                    STOCHASTIC, MASKED, BS, G, HALF)  # fmt: skip


@triton.jit(do_not_specialize=["seed"])  # a fresh random seed per call must not recompile
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, so, seed, BITS: tl.constexpr,
                     QMAX: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                     STOCHASTIC: tl.constexpr, IDX64: tl.constexpr):  # fmt: skip
    pid, row = program_ids(IDX64)
    if is_full_tile(pid, n, BS, G):  # every tile but a row's last: no masks, vector loads and stores
        _quantize_tile(pid, row, x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, so, seed, BITS, QMAX, BS, G,
                       HALF, STOCHASTIC, False)  # fmt: skip
    else:
        _quantize_tile(pid, row, x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, so, seed, BITS, QMAX, BS, G,
                       HALF, STOCHASTIC, True)  # fmt: skip


def _launch(src: torch.Tensor, rows: int, n: int, chunk: int, start: int, N: int, K: int, bits: int,
            block_size: int, stochastic: bool, seed: int | None) -> torch.Tensor:  # fmt: skip
    """Quantizes ``rows`` rows of ``n`` elements (row r from ``src`` as the kernel docstring says) into a fresh
    ``(rows, wire)`` buffer; the kernel writes every byte of it, padding included."""
    wire = wire_size(n, bits, block_size)
    out = torch.empty(rows, wire, dtype=torch.uint8, device=src.device)
    if n and rows:
        G, HALF = tile_shape(block_size)
        grid = (quantize_grid(n, bits, block_size, G), rows)
        _quantize_kernel[grid](
            src, out.view(torch.int8), out.view(torch.float32), n, chunk, start, N, K, wire, scale_offset(n, bits),
            stochastic_seed(seed) if stochastic else 0, BITS=bits, QMAX=QMAX[bits], BS=block_size, G=G, HALF=HALF,
            STOCHASTIC=stochastic, IDX64=needs_int64(src.numel() + 2 * G * HALF, out.numel() + 2 * G * HALF,
                                                     grid[0] * grid[1] * G * HALF),
            maxnreg=128,  # ptxas otherwise caps some INT4 variants at 80 registers and spills two
            **LAUNCH_OPTIONS,
        )  # fmt: skip
    return out


def quantize(
    x: torch.Tensor, bits: int, block_size: int, *, stochastic: bool = False, seed: int | None = None
) -> torch.Tensor:
    x = unit_stride(x)
    rows = x if x.dim() == 2 else x.view(1, -1)
    R, n = rows.shape
    out = _launch(rows, R, n, rows.stride(0), 0, 1, R, bits, block_size, stochastic, seed)
    return out if x.dim() == 2 else out.view(-1)


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
    x = unit_stride(x)
    W = ranks_per_node * num_nodes
    chunk = x.numel() // W
    start, n = stage_bounds(chunk, stages, stage, block_size)
    return _launch(x, W, n, chunk, start, ranks_per_node, num_nodes, bits, block_size, stochastic, seed)
