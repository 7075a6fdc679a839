"""Block quantization in Triton (INT8, INT4), plain or fused with qgZ's swizzle; bit-identical to the twins'
``reference.quantize`` / ``reference.swizzle_quantize``.

One kernel serves both: output row ``r`` reads input row ``layout.swizzle_source(r, N, K)`` (at ``start`` within a
row of ``chunk`` elements). Plain quantization of R rows is N = 1, K = R (row r reads row r); qgZ's step 1 is the
swizzle (slot ``l*K + k`` <- chunk ``k*N + l``) over piece ``start`` of each chunk, so no reordered copy is ever
written.

``ALIGNED`` compiles the variant for parameter-aligned blocks (``layout.Blocks``): each of a tile's G blocks reads
its start and length from a device table (``_launch.block_table``), so its accesses are masked and, at arbitrary
starts, not vectorized; program 0 of a row writes the row's padding. ``FEEDBACK`` (plain quantization only; the
residual's width: 32, 16 or 8, 0 for none) adds error feedback: ``x + decay * residual`` is quantized and ``residual``
overwritten with ``v - q * scale`` (fp32, bf16, or INT8 codes with a scale per block, in the same pass). Without
either, the kernel is the uniform one, unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (
    LAUNCH_OPTIONS,
    ShapeLaunch,
    feedback_arguments,
    needs_int64,
    once_per_shape,
    rotation,
    row_format,
    stochastic_seed,
    tiling,
    unit_stride,
)
from ._rotated import (
    load_pairs_rot,
    masked_blocks,
    masked_kind,
    masked_lanes,
    quantize_rotated,
    tile_blocks,
)
from ._tiles import (
    aligned_index,
    is_full_tile,
    load_pairs,
    load_pairs_aligned,
    load_residual,
    load_residual_aligned,
    lost_pairs,
    padded_blocks,
    program_ids,
    quantize_to_row,
    quantize_to_row_aligned,
    store_residual,
    store_residual_aligned,
    swizzle_source,
    tile_index,
    with_feedback,
)
from .layout import QMAX, Blocks
from .specs import QuantizeSpec, SwizzleQuantizeSpec


@triton.jit
def _quantize_tile(pid, row, x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, so, seed, res_ptr, rscale_ptr, rs,
                   decay, BITS: tl.constexpr, QMAX: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                   STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    blk, e, t = tile_index(pid, BS, G, HALF)
    STRIDED: tl.constexpr = BITS == 4 and FEEDBACK == 0  # with a residual, the uniform tiles keep one load (SASS)
    xe, xo = load_pairs(x_ptr + swizzle_source(row, N, K) * chunk + start, e, t, n, MASKED, BS, G, HALF, STRIDED)
    if FEEDBACK:  # plain quantization: row r of the residual is row r's
        re, ro = load_residual(res_ptr, rscale_ptr, row, e, blk, t, n, rs, decay, FEEDBACK, MASKED, BS, G, HALF)
        xe, xo = with_feedback(xe, xo, re, ro)
    ye, yo, scale = quantize_to_row(out_ptr, scale_ptr, row, pid, wire, so, padded_blocks(n, BS), xe, xo, seed, e,
                                    blk, t, BITS, QMAX, STOCHASTIC, MASKED, BS, G, HALF)  # fmt: skip
    if FEEDBACK:
        re, ro = lost_pairs(xe, xo, ye, yo, scale)
        store_residual(res_ptr, rscale_ptr, row, e, blk, t, n, rs, re, ro, FEEDBACK, MASKED, BS, G, HALF)


@triton.jit
def _quantize_aligned_tile(base, edge0, row, x_ptr, out_ptr, scale_ptr, chunk, start, N, K, wire, so, seed, res_ptr,
                           rscale_ptr, rs, decay, table_ptr, nblk, BITS: tl.constexpr, QMAX: tl.constexpr,
                           BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr,
                           FEEDBACK: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    blk, valid, length, e, inside = aligned_index(table_ptr, nblk, base, MODE, BS, G, HALF)
    # INT4 codes (16 pairs per thread) without an INT8 residual (whose codes are laid out as elements): strided loads
    STRIDED: tl.constexpr = BITS == 4 and FEEDBACK != 8
    xe, xo = load_pairs_aligned(x_ptr + swizzle_source(row, N, K) * chunk + start, e, inside, MODE, BS, G, HALF,
                                STRIDED)  # fmt: skip
    if FEEDBACK:
        re, ro = load_residual_aligned(res_ptr, rscale_ptr, row, rs, nblk, blk, valid, e, inside, decay, FEEDBACK,
                                       MODE, BS, G, HALF)  # fmt: skip
        xe, xo = with_feedback(xe, xo, re, ro)
    ye, yo, scale = quantize_to_row_aligned(out_ptr, scale_ptr, table_ptr, nblk, row, base, edge0, wire, so, xe, xo,
                                            seed, blk, valid, length, BITS, QMAX, STOCHASTIC, MODE, BS, G,
                                            HALF)  # fmt: skip
    if FEEDBACK:
        re, ro = lost_pairs(xe, xo, ye, yo, scale)
        store_residual_aligned(res_ptr, rscale_ptr, row, rs, nblk, blk, valid, e, inside, re, ro, FEEDBACK, MODE, BS,
                               G, HALF)  # fmt: skip


@triton.jit
def _quantize_rotated_tile(base, edge0, row, x_ptr, out_ptr, n, chunk, start, N, K, wire, so, seed, res_ptr, rscale_ptr,
                           rs, decay, table_ptr, nblk, sign_ptr, BITS: tl.constexpr, QMAX: tl.constexpr,
                           BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr,
                           FEEDBACK: tl.constexpr, KIND: tl.constexpr, GT: tl.constexpr, GE: tl.constexpr,
                           L: tl.constexpr):  # fmt: skip
    """G rotated blocks from ``base`` (``_rotated``; ``KIND``: which tile; GT, GE: the program's tile and the plain
    kernels' masked sub-tile, for the noise's counters)."""
    blk, valid, first, length, pay8, pay4 = tile_blocks(base, n, table_ptr, nblk, KIND, BS, G)
    xe, xo = load_pairs_rot(x_ptr + swizzle_source(row, N, K) * chunk + start, first, length, L,
                            masked_kind(KIND, BS, HALF), G, HALF)  # fmt: skip
    quantize_rotated(xe, xo, row, base, edge0, n, out_ptr, wire, so, seed, res_ptr, rscale_ptr, rs, decay, table_ptr,
                     nblk, sign_ptr, blk, valid, first, length, pay8, pay4, BITS, QMAX, BS, G, HALF, STOCHASTIC,
                     FEEDBACK, KIND, GT, GE, L)  # fmt: skip


@triton.jit
def _quantize_rotated(pid, row, x_ptr, out_ptr, n, chunk, start, N, K, wire, so, seed, res_ptr, rscale_ptr, rs, decay,
                      table_ptr, nblk, nvt, sign_ptr, BITS: tl.constexpr, QMAX: tl.constexpr, BS: tl.constexpr,
                      G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr,
                      ALIGNED: tl.constexpr, PADDED: tl.constexpr, GE: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """A program's tile of rotated blocks: a whole tile (L threads per block) where every block is whole, otherwise
    GM blocks at a time, each over more threads (``_rotated.masked_lanes``)."""
    LM: tl.constexpr = masked_lanes(G, GE, L, HALF, False)  # parameter-aligned blocks' masked tiles
    GM: tl.constexpr = masked_blocks(G, GE, L, HALF, False)
    LU: tl.constexpr = masked_lanes(G, GE, L, HALF, True)  # a row's last tile of uniform blocks
    GU: tl.constexpr = masked_blocks(G, GE, L, HALF, True)
    if ALIGNED:
        if PADDED:
            if pid < nvt:
                _quantize_rotated_tile(pid * G, nvt * G, row, x_ptr, out_ptr, n, chunk, start, N, K, wire, so, seed,
                                       res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, BITS, QMAX, BS, G,
                                       HALF, STOCHASTIC, FEEDBACK, 2, G, GE, L)  # fmt: skip
            else:
                for sub in range(0, G, GM):
                    _quantize_rotated_tile(pid * G + sub, nvt * G, row, x_ptr, out_ptr, n, chunk, start, N, K, wire,
                                           so, seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, BITS,
                                           QMAX, BS, GM, HALF, STOCHASTIC, FEEDBACK, 1, G, GE, LM)  # fmt: skip
        else:
            for sub in range(0, G, GM):
                _quantize_rotated_tile(pid * G + sub, 0, row, x_ptr, out_ptr, n, chunk, start, N, K, wire, so, seed,
                                       res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, BITS, QMAX, BS, GM,
                                       HALF, STOCHASTIC, FEEDBACK, 0, G, GE, LM)  # fmt: skip
    elif is_full_tile(pid, n, BS, G):
        _quantize_rotated_tile(pid * G, 0, row, x_ptr, out_ptr, n, chunk, start, N, K, wire, so, seed, res_ptr,
                               rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, BITS, QMAX, BS, G, HALF, STOCHASTIC,
                               FEEDBACK, 3, G, GE, L)  # fmt: skip
    else:
        for sub in range(0, G, GU):
            _quantize_rotated_tile(pid * G + sub, 0, row, x_ptr, out_ptr, n, chunk, start, N, K, wire, so, seed,
                                   res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, BITS, QMAX, BS, GU, HALF,
                                   STOCHASTIC, FEEDBACK, 4, G, GE, LU)  # fmt: skip


@triton.jit(do_not_specialize=["seed"])  # a fresh random seed per call must not recompile
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, so, seed, res_ptr, rscale_ptr, rs, decay,
                     table_ptr, nblk, nvt, sign_ptr, BITS: tl.constexpr, QMAX: tl.constexpr, BS: tl.constexpr,
                     G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr,
                     ALIGNED: tl.constexpr, PADDED: tl.constexpr, GE: tl.constexpr, IDX64: tl.constexpr,
                     ROTATE: tl.constexpr = False, L: tl.constexpr = 1):  # fmt: skip
    pid, row = program_ids(IDX64)
    if ROTATE:  # rotated blocks (``_rotated``): a thread's registers hold whole blocks
        _quantize_rotated(pid, row, x_ptr, out_ptr, n, chunk, start, N, K, wire, so, seed, res_ptr, rscale_ptr, rs,
                          decay, table_ptr, nblk, nvt, sign_ptr, BITS, QMAX, BS, G, HALF, STOCHASTIC, FEEDBACK,
                          ALIGNED, PADDED, GE, L)  # fmt: skip
    elif ALIGNED:  # parameter-aligned blocks: the tiles of whole aligned blocks first (vector), then the others
        if PADDED:
            if pid < nvt:
                _quantize_aligned_tile(pid * G, nvt * G, row, x_ptr, out_ptr, scale_ptr, chunk, start, N, K, wire, so,
                                       seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, BITS, QMAX, BS, G, HALF,
                                       STOCHASTIC, FEEDBACK, 2)  # fmt: skip
            else:  # a quarter of the tile at a time: the masked accesses need an address each
                for sub in range(0, G, GE):
                    _quantize_aligned_tile(pid * G + sub, nvt * G, row, x_ptr, out_ptr, scale_ptr, chunk, start, N, K,
                                           wire, so, seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, BITS,
                                           QMAX, BS, GE, HALF, STOCHASTIC, FEEDBACK, 1)  # fmt: skip
        else:
            _quantize_aligned_tile(pid * G, 0, row, x_ptr, out_ptr, scale_ptr, chunk, start, N, K, wire, so, seed,
                                   res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, BITS, QMAX, BS, G, HALF,
                                   STOCHASTIC, FEEDBACK, 0)  # fmt: skip
    elif is_full_tile(pid, n, BS, G):  # every tile but a row's last: no masks, vector loads and stores
        _quantize_tile(pid, row, x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, so, seed, res_ptr, rscale_ptr,
                       rs, decay, BITS, QMAX, BS, G, HALF, STOCHASTIC, FEEDBACK, False)  # fmt: skip
    else:
        _quantize_tile(pid, row, x_ptr, out_ptr, scale_ptr, n, chunk, start, N, K, wire, so, seed, res_ptr, rscale_ptr,
                       rs, decay, BITS, QMAX, BS, G, HALF, STOCHASTIC, FEEDBACK, True)  # fmt: skip


def _shape(rows: int, n: int, chunk: int, start: int, N: int, K: int, bits: int, block_size: int,
           blocks: Blocks | None, stochastic: bool, fb_bits: int, fb_extent: int, rotation_seed: int | None,
           device: torch.device, src_numel: int) -> ShapeLaunch:  # fmt: skip
    wire, so = row_format(n, bits, block_size, blocks)
    if not (n and rows):
        return ShapeLaunch(None, wire=wire)
    t = tiling(n, rows, block_size, blocks, device, wire_bits=bits)
    share = 32 if fb_bits == 8 else 64 if fb_bits else 128
    rot = rotation(rotation_seed, block_size, t, device, share)
    plain = {"GE": t.GE, "maxnreg": None if blocks is not None and blocks.padded and fb_bits else 128}
    kwargs = dict(
        BITS=bits, QMAX=QMAX[bits], BS=block_size, G=t.G, HALF=t.HALF, STOCHASTIC=stochastic, FEEDBACK=fb_bits,
        ALIGNED=blocks is not None, PADDED=t.padded,
        IDX64=needs_int64(src_numel + t.tile, rows * wire + t.tile, t.grid[0] * t.grid[1] * t.G * t.HALF,
                          fb_extent + t.tile),
        **(rot.options or plain),
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    head = (n, chunk, start, N, K, wire, so)
    return ShapeLaunch(t.grid, head, (t.table, t.nblk, t.nvt, rot.table), kwargs, wire)


def _launch(src: torch.Tensor, rows: int, n: int, chunk: int, start: int, N: int, K: int,
            spec: QuantizeSpec) -> torch.Tensor:  # fmt: skip
    """Quantizes ``rows`` rows of ``n`` elements (row r from ``src`` as the kernel docstring says) into a fresh
    ``(rows, wire)`` buffer, in uniform blocks or in ``spec.blocks``; with ``spec.residual`` (``(rows, n)``, only for
    N = 1), with error feedback. The kernel writes every byte of the buffer, padding included. Everything but the
    tensors and the seed is worked out once per shape."""
    assert spec.residual is None or N == 1  # row r's residual is row r's
    fb = feedback_arguments(spec, rows, n)
    bits, block_size, blocks, device = spec.bits, spec.block_size, spec.blocks, src.device
    rotation_seed = getattr(spec, "rotation_seed", None)
    key = ("quantize", rows, n, chunk, start, N, K, bits, block_size, spec.stochastic, fb.bits, fb.extent,
           rotation_seed, device, src.numel())  # fmt: skip
    shape = once_per_shape(blocks, key, lambda: _shape(*key[1:9], blocks, *key[9:]))
    out = torch.empty(rows, shape.wire, dtype=torch.uint8, device=device)
    if shape.grid is not None:
        seed = stochastic_seed(spec.seed) if spec.stochastic else 0
        _quantize_kernel[shape.grid](
            src, out.view(torch.int8), out.view(torch.float32), *shape.head, seed, *fb.arguments, *shape.tail,
            **shape.kwargs
        )  # fmt: skip
    return out


def quantize(x: torch.Tensor, spec: QuantizeSpec) -> torch.Tensor:
    x = unit_stride(x)
    # one row: the row stride is never used, and a 0 lets the compiler prove the row's start as aligned as the
    # buffer's (an odd stride makes every load of every tile scalar)
    if x.dim() == 1:
        return _launch(x, 1, x.shape[0], 0, 0, 1, 1, spec).view(-1)
    R, n = x.shape
    return _launch(x, R, n, x.stride(0) if R > 1 else 0, 0, 1, R, spec)


def swizzle_quantize(x: torch.Tensor, spec: SwizzleQuantizeSpec) -> torch.Tensor:
    x = unit_stride(x)
    N, K = spec.ranks_per_node, spec.num_nodes
    chunk, start, n, piece = spec.piece(x.numel())
    return _launch(x, N * K, n, chunk, start, N, K, piece)
