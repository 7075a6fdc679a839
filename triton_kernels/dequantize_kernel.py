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

from ._launch import INT4_DECODE, LAUNCH_OPTIONS, bf16_by_hand, needs_int64, output_view, row_format, tiling
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
def _dequantize_kernel(buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, table_ptr, nblk, nvt, nib,
                       ROWS: tl.constexpr, BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                       SCALED: tl.constexpr, BF16_BY_HAND: tl.constexpr, ALIGNED: tl.constexpr, PADDED: tl.constexpr,
                       GE: tl.constexpr, IDX64: tl.constexpr):  # fmt: skip
    pid, r = program_ids(IDX64)
    if ALIGNED:  # parameter-aligned blocks: the tiles of whole aligned blocks first (vector), then the others
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


def _launch(rows: torch.Tensor, out: torch.Tensor, numel: int, bits: int, block_size: int, summed: int,
            multiplier: float, blocks: Blocks | None = None) -> None:  # fmt: skip
    """Writes ``out`` (``rows.shape[0] // summed`` rows of ``numel``) from the wire ``rows`` (uniform blocks, or
    ``blocks``)."""
    wire, so = row_format(numel, bits, block_size, blocks)
    # the kernel indexes both buffers by these sizes: a mismatch would read or write outside them
    assert rows.is_contiguous() and rows.shape[1] == wire
    assert out.is_contiguous() and out.numel() == rows.shape[0] // summed * numel
    assert summed == 1 or rows.shape[0] == summed  # a sum has one output row (the kernel's _output_row)
    if not numel or not rows.shape[0]:
        return
    t = tiling(numel, rows.shape[0] // summed, block_size, blocks, rows.device)
    _dequantize_kernel[t.grid](
        rows.view(torch.int8), rows.view(torch.float32), output_view(out), numel, rows.shape[1], so,
        float(multiplier), t.table, t.nblk, t.nvt, INT4_DECODE, ROWS=summed, BITS=bits, BS=block_size, G=t.G,
        HALF=t.HALF, SCALED=multiplier != 1.0, BF16_BY_HAND=bf16_by_hand(out), ALIGNED=blocks is not None,
        PADDED=t.padded, GE=t.GE,
        IDX64=needs_int64(rows.numel() + t.tile, out.numel() + t.tile), **LAUNCH_OPTIONS,
    )  # fmt: skip


def dequantize(buf: torch.Tensor, spec: DequantizeSpec) -> torch.Tensor:
    rows = (buf if buf.dim() == 2 else buf.view(1, -1)).contiguous()
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
    _launch(buf.contiguous(), out, spec.numel, spec.bits, spec.block_size, buf.shape[0], multiplier, spec.blocks)
    return out
