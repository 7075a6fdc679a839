"""Dequantization in Triton, alone or summed over rows (qgZ's step 5); bit-identical to ``reference.dequantize`` /
``reference.dequantize_reduce``.

One kernel serves both: output row ``r`` is the fp32 sum of input rows ``r * ROWS .. r * ROWS + ROWS - 1`` (times the
op's multiplier), rounded once into the output dtype. Plain dequantization is ROWS = 1.

``ALIGNED`` compiles the variant for parameter-aligned blocks (``layout.Blocks``): each of a tile's G blocks reads
its start and length from a device table (``_launch.block_table``), so its loads and stores are masked and, at
arbitrary starts, not vectorized. Without it, the kernel is the uniform one, unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (
    INT4_DECODE,
    LAUNCH_OPTIONS,
    ShapeLaunch,
    bf16_by_hand,
    needs_int64,
    once_per_shape,
    output_view,
    rotation,
    row_format,
    tiling,
)
from ._rotated import (
    load_block_scales,
    load_dequantized_rot,
    masked_blocks,
    masked_kind,
    masked_lanes,
    payload_limit,
    signs,
    store_values_rot,
    tile_blocks,
    unrotate,
)
from ._tiles import (
    aligned_index,
    is_full_tile,
    padded_blocks,
    program_ids,
    store_values,
    store_values_aligned,
    sum_dequantized,
    sum_dequantized_aligned,
    tile_index,
    wire_row_bytes,
)
from .layout import Blocks
from .specs import DequantizeReduceSpec, DequantizeSpec


@triton.jit
def _output_row(out_ptr, r, n, ROWS: tl.constexpr):
    """Where output row ``r`` starts. A sum over rows (ROWS > 1) has one output row: its start is ``out_ptr`` itself,
    whose alignment the compiler knows, so a row of any length stores in vectors (``r * n`` with an odd ``n`` would
    make every output store scalar)."""
    if ROWS == 1:
        out_ptr += r * n
    return out_ptr


@triton.jit
def _dequantize_tile(pid, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, nib, ROWS: tl.constexpr,
                     BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, SCALED: tl.constexpr,
                     BF16_BY_HAND: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    blk, e, t = tile_index(pid, BS, G, HALF)
    ve, vo = sum_dequantized(buf_ptr, scale_ptr, r * ROWS, 1, wire, e, blk, t, n, so, padded_blocks(n, BS), nib,
                             ROWS, BITS, MASKED, BS, G, HALF)  # fmt: skip
    if SCALED:
        ve *= multiplier
        vo *= multiplier
    store_values(_output_row(out_ptr, r, n, ROWS), e, t, n, ve, vo, MASKED, BF16_BY_HAND, BS, G, HALF)


@triton.jit
def _dequantize_aligned_tile(base, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk, nib,
                             ROWS: tl.constexpr, BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
                             HALF: tl.constexpr, SCALED: tl.constexpr, BF16_BY_HAND: tl.constexpr,
                             MODE: tl.constexpr):  # fmt: skip
    blk, valid, length, e, inside = aligned_index(table_ptr, nblk, base, MODE, BS, G, HALF)
    ve, vo = sum_dequantized_aligned(buf_ptr, scale_ptr, table_ptr, nblk, r * ROWS, 1, wire, so, blk, valid, length,
                                     nib, ROWS, BITS, MODE, BS, G, HALF)  # fmt: skip
    if SCALED:
        ve *= multiplier
        vo *= multiplier
    store_values_aligned(_output_row(out_ptr, r, n, ROWS), e, inside, ve, vo, BF16_BY_HAND, MODE, BS, G, HALF)


@triton.jit
def _dequantize_rotated_tile(base, r, buf_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk, sign_ptr,
                             ROWS: tl.constexpr, BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
                             HALF: tl.constexpr, SCALED: tl.constexpr, BF16_BY_HAND: tl.constexpr, KIND: tl.constexpr,
                             L: tl.constexpr):  # fmt: skip
    """G blocks from ``base``: the fp32 sum of the ROWS rows (rotated alike), un-rotated once (``_rotated.unrotate``),
    times the multiplier, rounded once to the output's dtype; as ``reference.dequantize_reduce``."""
    MASKED: tl.constexpr = masked_kind(KIND, BS, HALF)
    blk, valid, first, length, pay8, pay4 = tile_blocks(base, n, table_ptr, nblk, KIND, BS, G)
    pay = pay8 if BITS == 8 else pay4
    limit = payload_limit(pay, length, so, BITS, KIND, BS)
    payload, scales = wire_row_bytes(buf_ptr, r * ROWS, wire, so)
    ve, vo = load_dequantized_rot(payload, pay, limit, load_block_scales(scales, blk, valid, KIND), length, BITS,
                                  MASKED, G, HALF, L)  # fmt: skip
    for i in tl.static_range(1, ROWS):
        payload, scales = wire_row_bytes(buf_ptr, r * ROWS + i, wire, so)
        we, wo = load_dequantized_rot(payload, pay, limit, load_block_scales(scales, blk, valid, KIND), length, BITS,
                                      MASKED, G, HALF, L)  # fmt: skip
        ve += we
        vo += wo
    # the inverse's factor: the sign over its piece's length (the table's second row), or with pieces, the signs
    ie, io = signs(sign_ptr, G, HALF, L, BS, not MASKED)
    ve, vo = unrotate(ve, vo, ie, io, length, MASKED, G, HALF, L)
    if SCALED:
        ve *= multiplier
        vo *= multiplier
    store_values_rot(_output_row(out_ptr, r, n, ROWS), first, length, ve, vo, BF16_BY_HAND, MASKED, G, HALF, L)


@triton.jit
def _dequantize_rotated(pid, r, buf_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk, nvt, sign_ptr,
                        ROWS: tl.constexpr, BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                        SCALED: tl.constexpr, BF16_BY_HAND: tl.constexpr, ALIGNED: tl.constexpr, PADDED: tl.constexpr,
                        GE: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """A program's tile of rotated blocks, as ``quantize_kernel._quantize_rotated`` takes it."""
    LM: tl.constexpr = masked_lanes(G, GE, L, HALF, False)  # parameter-aligned blocks' masked tiles
    GM: tl.constexpr = masked_blocks(G, GE, L, HALF, False)
    LU: tl.constexpr = masked_lanes(G, GE, L, HALF, True)  # a row's last tile of uniform blocks
    GU: tl.constexpr = masked_blocks(G, GE, L, HALF, True)
    if ALIGNED:
        if PADDED:
            if pid < nvt:
                _dequantize_rotated_tile(pid * G, r, buf_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk,
                                         sign_ptr, ROWS, BITS, BS, G, HALF, SCALED, BF16_BY_HAND, 2, L)  # fmt: skip
            else:
                for sub in range(0, G, GM):
                    _dequantize_rotated_tile(pid * G + sub, r, buf_ptr, out_ptr, n, wire, so, multiplier, table_ptr,
                                             nblk, sign_ptr, ROWS, BITS, BS, GM, HALF, SCALED, BF16_BY_HAND, 1,
                                             LM)  # fmt: skip
        else:
            for sub in range(0, G, GM):
                _dequantize_rotated_tile(pid * G + sub, r, buf_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk,
                                         sign_ptr, ROWS, BITS, BS, GM, HALF, SCALED, BF16_BY_HAND, 0, LM)  # fmt: skip
    elif is_full_tile(pid, n, BS, G):
        _dequantize_rotated_tile(pid * G, r, buf_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk, sign_ptr,
                                 ROWS, BITS, BS, G, HALF, SCALED, BF16_BY_HAND, 3, L)  # fmt: skip
    else:
        for sub in range(0, G, GU):
            _dequantize_rotated_tile(pid * G + sub, r, buf_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk,
                                     sign_ptr, ROWS, BITS, BS, GU, HALF, SCALED, BF16_BY_HAND, 4, LU)  # fmt: skip


@triton.jit
def _dequantize_kernel(buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk, nvt, nib, sign_ptr,
                       ROWS: tl.constexpr, BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                       SCALED: tl.constexpr, BF16_BY_HAND: tl.constexpr, ALIGNED: tl.constexpr, PADDED: tl.constexpr,
                       GE: tl.constexpr, IDX64: tl.constexpr, ROTATE: tl.constexpr = False,
                       L: tl.constexpr = 1):  # fmt: skip
    pid, r = program_ids(IDX64)
    if ROTATE:  # rotated blocks (``_rotated``): a thread's registers hold whole blocks
        _dequantize_rotated(pid, r, buf_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk, nvt, sign_ptr, ROWS,
                            BITS, BS, G, HALF, SCALED, BF16_BY_HAND, ALIGNED, PADDED, GE, L)  # fmt: skip
    elif ALIGNED:  # parameter-aligned blocks: the tiles of whole aligned blocks first (vector), then the others
        if PADDED:
            if pid < nvt:
                _dequantize_aligned_tile(pid * G, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, table_ptr,
                                         nblk, nib, ROWS, BITS, BS, G, HALF, SCALED, BF16_BY_HAND, 2)  # fmt: skip
            else:  # a quarter of the tile at a time: the masked accesses need an address each
                for sub in range(0, G, GE):
                    _dequantize_aligned_tile(pid * G + sub, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier,
                                             table_ptr, nblk, nib, ROWS, BITS, BS, GE, HALF, SCALED,
                                             BF16_BY_HAND, 1)  # fmt: skip
        else:
            _dequantize_aligned_tile(pid * G, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk,
                                     nib, ROWS, BITS, BS, G, HALF, SCALED, BF16_BY_HAND, 0)  # fmt: skip
    elif is_full_tile(pid, n, BS, G):  # every tile but a row's last: no masks, vector loads and stores
        _dequantize_tile(pid, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, nib, ROWS, BITS, BS, G,
                         HALF, SCALED, BF16_BY_HAND, False)  # fmt: skip
    else:
        _dequantize_tile(pid, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, nib, ROWS, BITS, BS, G,
                         HALF, SCALED, BF16_BY_HAND, True)  # fmt: skip


def _shape(numel: int, rows: int, wire: int, bits: int, block_size: int, summed: int, scaled: bool, by_hand: bool,
           rotation_seed: int | None, device: torch.device, out_numel: int,
           blocks: Blocks | None) -> ShapeLaunch:  # fmt: skip
    expected, so = row_format(numel, bits, block_size, blocks)
    # the kernel indexes both buffers by these sizes: a mismatch would read or write outside them
    assert wire == expected and out_numel == rows // summed * numel
    assert summed == 1 or rows == summed  # a sum has one output row (the kernel's _output_row)
    if not numel or not rows:
        return ShapeLaunch(None)
    t = tiling(numel, rows // summed, block_size, blocks, device)
    # a thread holds a block, or half of it where more than 4 rows' loads are in flight (ptxas spills otherwise)
    rot = rotation(rotation_seed, block_size, t, device, 128 if summed <= 4 else 64)
    kwargs = dict(
        ROWS=summed, BITS=bits, BS=block_size, G=t.G, HALF=t.HALF, SCALED=scaled, BF16_BY_HAND=by_hand,
        ALIGNED=blocks is not None, PADDED=t.padded, IDX64=needs_int64(rows * wire + t.tile, out_numel + t.tile),
        **(rot.options or {"GE": t.GE}), **LAUNCH_OPTIONS,
    )  # fmt: skip
    return ShapeLaunch(t.grid, (numel, wire, so), (t.table, t.nblk, t.nvt, INT4_DECODE, rot.table), kwargs)


def _launch(rows: torch.Tensor, out: torch.Tensor, numel: int, bits: int, block_size: int, summed: int,
            multiplier: float, blocks: Blocks | None = None, rotation_seed: int | None = None) -> None:  # fmt: skip
    """Writes ``out`` (``rows.shape[0] // summed`` rows of ``numel``) from the wire ``rows`` (uniform blocks, or
    ``blocks``; rotated with ``rotation_seed``: the sum un-rotated). Everything but the tensors and the multiplier is
    worked out once per shape."""
    assert rows.is_contiguous() and out.is_contiguous()  # the kernel indexes them as dense rows
    R, wire = (1, rows.shape[0]) if rows.dim() == 1 else rows.shape
    key = ("dequantize", numel, R, wire, bits, block_size, summed, multiplier != 1.0, bf16_by_hand(out),
           rotation_seed, rows.device, out.numel())  # fmt: skip
    shape = once_per_shape(blocks, key, lambda: _shape(*key[1:], blocks))
    if shape.grid is not None:
        _dequantize_kernel[shape.grid](
            rows.view(torch.int8), rows.view(torch.float32), output_view(out), *shape.head, float(multiplier),
            *shape.tail, **shape.kwargs
        )  # fmt: skip


def dequantize(buf: torch.Tensor, spec: DequantizeSpec) -> torch.Tensor:
    rows = buf.contiguous()  # one row (1-D) or rows (2-D): the kernel reads them as dense rows either way
    out = spec.out
    if out is None:
        out = torch.empty(buf.shape[:-1] + (spec.numel,), dtype=spec.dtype, device=buf.device)
    _launch(rows, out, spec.numel, spec.bits, spec.block_size, 1, 1.0, spec.blocks)
    return out


def dequantize_reduce(buf: torch.Tensor, spec: DequantizeReduceSpec) -> torch.Tensor:
    out = spec.out
    if out is None:
        out = torch.empty(spec.numel, dtype=spec.dtype or torch.float32, device=buf.device)
    multiplier = float(spec.multiplier)
    _launch(buf.contiguous(), out, spec.numel, spec.bits, spec.block_size, buf.shape[0], multiplier, spec.blocks,
            spec.rotation_seed)  # fmt: skip
    return out
