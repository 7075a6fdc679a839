"""qgZ's step 3 in Triton: K pieces from each of N peers -> dequantize, sum over N in fp32, re-quantize (to another
bit width if asked). Each input is read once and each output written once; bit-identical to
``reference.dequantize_reduce_quantize``.

``ALIGNED`` compiles the variant for parameter-aligned blocks (``layout.Blocks``, the same blocks in and out): each of
a tile's G blocks reads its start and length from a device table, so its accesses are masked and, at arbitrary
starts, not vectorized. ``FEEDBACK`` (the residual's width: 32, 16 or 8; 0 for none) adds error feedback to the
re-quantization: ``sum + decay * residual[k]`` is quantized and ``residual[k]`` overwritten with ``v - q * scale``
(fp32, bf16, or INT8 codes with a scale per block, in the same pass). Without either, the kernel is the uniform one,
unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (
    INT4_DECODE,
    LAUNCH_OPTIONS,
    ShapeLaunch,
    feedback_arguments,
    needs_int64,
    once_per_shape,
    rotation,
    row_format,
    stochastic_seed,
    tiling,
)
from ._rotated import (
    load_block_scales,
    load_dequantized_rot,
    masked_blocks,
    masked_kind,
    masked_lanes,
    payload_limit,
    quantize_rotated,
    tile_blocks,
)
from ._tiles import (
    aligned_index,
    is_full_tile,
    load_residual,
    load_residual_aligned,
    lost_pairs,
    padded_blocks,
    program_ids,
    quantize_to_row,
    quantize_to_row_aligned,
    store_residual,
    store_residual_aligned,
    sum_dequantized,
    sum_dequantized_aligned,
    tile_index,
    wire_row_bytes,
    with_feedback,
)
from .layout import QMAX, Blocks
from .specs import DequantizeReduceQuantizeSpec


@triton.jit
def _requantize_tile(pid, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, K, in_wire, in_so, out_wire, out_so,
                     seed, res_ptr, rscale_ptr, rs, decay, nib, N: tl.constexpr, IN_BITS: tl.constexpr,
                     OUT_BITS: tl.constexpr, QMAX: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                     STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    blk, e, t = tile_index(pid, BS, G, HALF)
    nb4 = padded_blocks(n, BS)
    xe, xo = sum_dequantized(buf_ptr, in_scale_ptr, k, K, in_wire, e, blk, t, n, in_so, nb4, nib, N, IN_BITS, MASKED,
                             BS, G, HALF)  # fmt: skip
    if FEEDBACK:
        re, ro = load_residual(res_ptr, rscale_ptr, k, e, blk, t, n, rs, decay, FEEDBACK, MASKED, BS, G, HALF)
        xe, xo = with_feedback(xe, xo, re, ro)
    ye, yo, scale = quantize_to_row(out_ptr, out_scale_ptr, k, pid, out_wire, out_so, nb4, xe, xo, seed, e, blk, t,
                                    OUT_BITS, QMAX, STOCHASTIC, MASKED, BS, G, HALF)  # fmt: skip
    if FEEDBACK:
        re, ro = lost_pairs(xe, xo, ye, yo, scale)
        store_residual(res_ptr, rscale_ptr, k, e, blk, t, n, rs, re, ro, FEEDBACK, MASKED, BS, G, HALF)


@triton.jit
def _requantize_aligned_tile(base, edge0, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, K, in_wire, in_so,
                             out_wire, out_so, seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, nib,
                             N: tl.constexpr,
                             IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr, QMAX: tl.constexpr, BS: tl.constexpr,
                             G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr,
                             MODE: tl.constexpr):  # fmt: skip
    blk, valid, length, e, inside = aligned_index(table_ptr, nblk, base, MODE, BS, G, HALF)
    xe, xo = sum_dequantized_aligned(buf_ptr, in_scale_ptr, table_ptr, nblk, k, K, in_wire, in_so, blk, valid, length,
                                     nib, N, IN_BITS, MODE, BS, G, HALF)  # fmt: skip
    if FEEDBACK:
        re, ro = load_residual_aligned(res_ptr, rscale_ptr, k, rs, nblk, blk, valid, e, inside, decay, FEEDBACK,
                                       MODE, BS, G, HALF)  # fmt: skip
        xe, xo = with_feedback(xe, xo, re, ro)
    ye, yo, scale = quantize_to_row_aligned(out_ptr, out_scale_ptr, table_ptr, nblk, k, base, edge0, out_wire, out_so,
                                            xe, xo, seed, blk, valid, length, OUT_BITS, QMAX, STOCHASTIC, MODE, BS, G,
                                            HALF)  # fmt: skip
    if FEEDBACK:
        re, ro = lost_pairs(xe, xo, ye, yo, scale)
        store_residual_aligned(res_ptr, rscale_ptr, k, rs, nblk, blk, valid, e, inside, re, ro, FEEDBACK, MODE, BS, G,
                               HALF)  # fmt: skip


@triton.jit
def _requantize_rotated_tile(base, edge0, k, buf_ptr, out_ptr, n, K, in_wire, in_so, out_wire, out_so, seed, res_ptr,
                             rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, N: tl.constexpr, IN_BITS: tl.constexpr,
                             OUT_BITS: tl.constexpr, QMAX: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
                             HALF: tl.constexpr, STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr, KIND: tl.constexpr,
                             GT: tl.constexpr, GE: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """G blocks from ``base`` of piece ``k``: the fp32 sum of its N received copies (in index order, as
    ``reference._sum_dequantized``), rotated and quantized (``_rotated.quantize_rotated``)."""
    MASKED: tl.constexpr = masked_kind(KIND, BS, HALF)
    blk, valid, first, length, pay8, pay4 = tile_blocks(base, n, table_ptr, nblk, KIND, BS, G)
    pay = pay8 if IN_BITS == 8 else pay4
    limit = payload_limit(pay, length, in_so, IN_BITS, KIND, BS)
    payload, scales = wire_row_bytes(buf_ptr, k, in_wire, in_so)
    xe, xo = load_dequantized_rot(payload, pay, limit, load_block_scales(scales, blk, valid, KIND), length, IN_BITS,
                                  MASKED, G, HALF, L)  # fmt: skip
    for i in tl.static_range(1, N):
        payload, scales = wire_row_bytes(buf_ptr, k + i * K, in_wire, in_so)
        ve, vo = load_dequantized_rot(payload, pay, limit, load_block_scales(scales, blk, valid, KIND), length,
                                      IN_BITS, MASKED, G, HALF, L)  # fmt: skip
        xe += ve
        xo += vo
    quantize_rotated(xe, xo, k, base, edge0, n, out_ptr, out_wire, out_so, seed, res_ptr, rscale_ptr, rs, decay,
                     table_ptr, nblk, sign_ptr, blk, valid, first, length, pay8, pay4, OUT_BITS, QMAX, BS, G, HALF,
                     STOCHASTIC, FEEDBACK, KIND, GT, GE, L)  # fmt: skip


@triton.jit
def _requantize_rotated(pid, k, buf_ptr, out_ptr, n, K, in_wire, in_so, out_wire, out_so, seed, res_ptr, rscale_ptr,
                        rs, decay, table_ptr, nblk, nvt, sign_ptr, N: tl.constexpr, IN_BITS: tl.constexpr,
                        OUT_BITS: tl.constexpr, QMAX: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
                        HALF: tl.constexpr, STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr, ALIGNED: tl.constexpr,
                        PADDED: tl.constexpr, GE: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """A program's tile of rotated blocks, as ``quantize_kernel._quantize_rotated`` takes it."""
    LM: tl.constexpr = masked_lanes(G, GE, L, HALF, False)  # parameter-aligned blocks' masked tiles
    GM: tl.constexpr = masked_blocks(G, GE, L, HALF, False)
    LU: tl.constexpr = masked_lanes(G, GE, L, HALF, True)  # a row's last tile of uniform blocks
    GU: tl.constexpr = masked_blocks(G, GE, L, HALF, True)
    if ALIGNED:
        if PADDED:
            if pid < nvt:
                _requantize_rotated_tile(pid * G, nvt * G, k, buf_ptr, out_ptr, n, K, in_wire, in_so, out_wire, out_so,
                                         seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, N, IN_BITS,
                                         OUT_BITS, QMAX, BS, G, HALF, STOCHASTIC, FEEDBACK, 2, G, GE, L)  # fmt: skip
            else:
                for sub in range(0, G, GM):
                    _requantize_rotated_tile(pid * G + sub, nvt * G, k, buf_ptr, out_ptr, n, K, in_wire, in_so,
                                             out_wire, out_so, seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk,
                                             sign_ptr, N, IN_BITS, OUT_BITS, QMAX, BS, GM, HALF, STOCHASTIC, FEEDBACK,
                                             1, G, GE, LM)  # fmt: skip
        else:
            for sub in range(0, G, GM):
                _requantize_rotated_tile(pid * G + sub, 0, k, buf_ptr, out_ptr, n, K, in_wire, in_so, out_wire, out_so,
                                         seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, N, IN_BITS,
                                         OUT_BITS, QMAX, BS, GM, HALF, STOCHASTIC, FEEDBACK, 0, G, GE, LM)  # fmt: skip
    elif is_full_tile(pid, n, BS, G):
        _requantize_rotated_tile(pid * G, 0, k, buf_ptr, out_ptr, n, K, in_wire, in_so, out_wire, out_so, seed,
                                 res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, N, IN_BITS, OUT_BITS, QMAX,
                                 BS, G, HALF, STOCHASTIC, FEEDBACK, 3, G, GE, L)  # fmt: skip
    else:
        for sub in range(0, G, GU):
            _requantize_rotated_tile(pid * G + sub, 0, k, buf_ptr, out_ptr, n, K, in_wire, in_so, out_wire, out_so,
                                     seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, sign_ptr, N, IN_BITS,
                                     OUT_BITS, QMAX, BS, GU, HALF, STOCHASTIC, FEEDBACK, 4, G, GE, LU)  # fmt: skip


@triton.jit(do_not_specialize=["seed"])  # a fresh random seed per call must not recompile
def _requantize_kernel(buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, K, in_wire, in_so, out_wire, out_so, seed,
                       res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, nvt, nib, sign_ptr, N: tl.constexpr,
                       IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr, QMAX: tl.constexpr, BS: tl.constexpr,
                       G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr,
                       ALIGNED: tl.constexpr, PADDED: tl.constexpr, GE: tl.constexpr, IDX64: tl.constexpr,
                       ROTATE: tl.constexpr = False, L: tl.constexpr = 1):  # fmt: skip
    pid, k = program_ids(IDX64)
    if ROTATE:  # rotated blocks (``_rotated``): a thread's registers hold whole blocks
        _requantize_rotated(pid, k, buf_ptr, out_ptr, n, K, in_wire, in_so, out_wire, out_so, seed, res_ptr, rscale_ptr,
                            rs, decay, table_ptr, nblk, nvt, sign_ptr, N, IN_BITS, OUT_BITS, QMAX, BS, G, HALF,
                            STOCHASTIC, FEEDBACK, ALIGNED, PADDED, GE, L)  # fmt: skip
    elif ALIGNED:  # parameter-aligned blocks: the tiles of whole aligned blocks first (vector), then the others
        if PADDED:
            if pid < nvt:
                _requantize_aligned_tile(pid * G, nvt * G, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, K, in_wire,
                                         in_so, out_wire, out_so, seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk,
                                         nib, N, IN_BITS, OUT_BITS, QMAX, BS, G, HALF, STOCHASTIC, FEEDBACK,
                                         2)  # fmt: skip
            else:  # a quarter of the tile at a time: the masked accesses need an address each
                for sub in range(0, G, GE):
                    _requantize_aligned_tile(pid * G + sub, nvt * G, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr,
                                             K, in_wire, in_so, out_wire, out_so, seed, res_ptr, rscale_ptr, rs, decay,
                                             table_ptr, nblk, nib, N, IN_BITS, OUT_BITS, QMAX, BS, GE, HALF, STOCHASTIC,
                                             FEEDBACK, 1)  # fmt: skip
        else:
            _requantize_aligned_tile(pid * G, 0, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, K, in_wire, in_so,
                                     out_wire, out_so, seed, res_ptr, rscale_ptr, rs, decay, table_ptr, nblk, nib, N,
                                     IN_BITS, OUT_BITS, QMAX, BS, G, HALF, STOCHASTIC, FEEDBACK, 0)  # fmt: skip
    elif is_full_tile(pid, n, BS, G):  # every tile but a row's last: no masks, vector loads and stores
        _requantize_tile(pid, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, K, in_wire, in_so, out_wire,
                         out_so, seed, res_ptr, rscale_ptr, rs, decay, nib, N, IN_BITS, OUT_BITS, QMAX, BS, G, HALF,
                         STOCHASTIC, FEEDBACK, False)  # fmt: skip
    else:
        _requantize_tile(pid, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, K, in_wire, in_so, out_wire,
                         out_so, seed, res_ptr, rscale_ptr, rs, decay, nib, N, IN_BITS, OUT_BITS, QMAX, BS, G, HALF,
                         STOCHASTIC, FEEDBACK, True)  # fmt: skip


def _rotated_share(N: int, feedback: int) -> int:
    """The elements of a rotated block a thread holds: 128, half as many where more than 2 rows' loads are in flight
    or a residual keeps the block beside its rotation, a quarter with an INT8 residual (its own quantization) or a
    residual and more than 4 rows. Fewer, and ptxas spills (sm_100: 8-16 bytes of stack at 255 registers)."""
    if feedback == 8 or (feedback and N > 4):
        return 32
    return 64 if feedback or N > 2 else 128


def _shape(N: int, K: int, in_wire: int, numel: int, in_bits: int, out_bits: int, block_size: int, stochastic: bool,
           fb_bits: int, fb_extent: int, rotation_seed: int | None, device: torch.device,
           blocks: Blocks | None) -> ShapeLaunch:  # fmt: skip
    expected, in_so = row_format(numel, in_bits, block_size, blocks)
    out_wire, out_so = row_format(numel, out_bits, block_size, blocks)
    assert N >= 1 and in_wire == expected  # the kernel reads N rows of this size
    if not (numel and K):
        return ShapeLaunch(None, wire=out_wire)
    t = tiling(numel, K, block_size, blocks, device, wire_bits=out_bits)
    rot = rotation(rotation_seed, block_size, t, device, _rotated_share(N, fb_bits))
    options = rot.options or {
        "GE": t.GE,
        # packed aligned blocks: N rows of scalar loads in flight, and 4 warps would need a stack; a padded
        # layout's tiles are the uniform ones, and 4 warps keep 16 INT4 payload bytes per thread
        "num_warps": 4 if blocks is None or blocks.padded else 8,
        # packed, ptxas for sm_80 otherwise keeps an INT8 residual's variant at 48 registers and an 8-byte stack;
        # padded, a cap of 128 spills the widest variants (N = 8, feedback, stochastic): ptxas chooses
        "maxnreg": 128 if blocks is not None and not blocks.padded else None,
    }
    kwargs = dict(
        N=N, IN_BITS=in_bits, OUT_BITS=out_bits, QMAX=QMAX[out_bits], BS=block_size, G=t.G, HALF=t.HALF,
        STOCHASTIC=stochastic, FEEDBACK=fb_bits, ALIGNED=blocks is not None, PADDED=t.padded,
        IDX64=needs_int64(N * K * in_wire + t.tile, K * out_wire + t.tile, t.grid[0] * K * t.G * t.HALF,
                          fb_extent + t.tile),
        **options,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    head = (numel, K, in_wire, in_so, out_wire, out_so)
    return ShapeLaunch(t.grid, head, (t.table, t.nblk, t.nvt, INT4_DECODE, rot.table), kwargs, out_wire)


def dequantize_reduce_quantize(buf: torch.Tensor, spec: DequantizeReduceQuantizeSpec) -> torch.Tensor:
    """Everything but the tensors and the seed is worked out once per shape."""
    N, K, in_wire = buf.shape
    buf = buf.contiguous()
    fb = feedback_arguments(spec, K, spec.numel)
    key = ("dequantize_reduce_quantize", N, K, in_wire, spec.numel, spec.in_bits, spec.out_bits, spec.block_size,
           spec.stochastic, fb.bits, fb.extent, spec.rotation_seed, buf.device)  # fmt: skip
    shape = once_per_shape(spec.blocks, key, lambda: _shape(*key[1:], spec.blocks))
    out = torch.empty(K, shape.wire, dtype=torch.uint8, device=buf.device)
    if shape.grid is not None:
        seed = stochastic_seed(spec.seed) if spec.stochastic else 0
        _requantize_kernel[shape.grid](
            buf.view(torch.int8), buf.view(torch.float32), out.view(torch.int8), out.view(torch.float32),
            *shape.head, seed, *fb.arguments, *shape.tail, **shape.kwargs
        )  # fmt: skip
    return out
