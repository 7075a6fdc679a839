"""Dequantization in Triton, alone or summed over rows (qgZ's step 5); bit-identical to ``reference.dequantize`` /
``reference.dequantize_reduce``.

One kernel serves both: output row ``r`` is the fp32 sum of input rows ``r * ROWS .. r * ROWS + ROWS - 1`` (times the
op's multiplier), rounded once into the output dtype. Plain dequantization is ROWS = 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import LAUNCH_OPTIONS, bf16_by_hand, needs_int64, output_view, tile_shape
from ._tiles import is_full_tile, padded_blocks, program_ids, store_values, sum_dequantized, tile_index
from .layout import num_blocks, scale_offset, wire_size


@triton.jit
def _dequantize_tile(pid, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, ROWS: tl.constexpr,
                     BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, SCALED: tl.constexpr,
                     BF16_BY_HAND: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    blk, e, t = tile_index(pid, BS, G, HALF)
    ve, vo = sum_dequantized(buf_ptr, scale_ptr, r * ROWS, 1, wire, e, blk, t, n, so, padded_blocks(n, BS), ROWS,
                             BITS, MASKED, BS, G, HALF)  # fmt: skip
    if SCALED:
        ve *= multiplier
        vo *= multiplier
    store_values(out_ptr + r * n, e, t, n, ve, vo, MASKED, BF16_BY_HAND, BS, G, HALF)


@triton.jit
def _dequantize_kernel(buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, ROWS: tl.constexpr, BITS: tl.constexpr,
                       BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, SCALED: tl.constexpr,
                       BF16_BY_HAND: tl.constexpr, IDX64: tl.constexpr):  # fmt: skip
    pid, r = program_ids(IDX64)
    if is_full_tile(pid, n, BS, G):  # every tile but a row's last: no masks, vector loads and stores
        _dequantize_tile(pid, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, ROWS, BITS, BS, G, HALF,
                         SCALED, BF16_BY_HAND, False)  # fmt: skip
    else:
        _dequantize_tile(pid, r, buf_ptr, scale_ptr, out_ptr, n, wire, so, multiplier, ROWS, BITS, BS, G, HALF,
                         SCALED, BF16_BY_HAND, True)  # fmt: skip


def _launch(rows: torch.Tensor, out: torch.Tensor, numel: int, bits: int, block_size: int, summed: int,
            multiplier: float) -> None:  # fmt: skip
    """Writes ``out`` (``rows.shape[0] // summed`` rows of ``numel``) from the wire ``rows``."""
    # the kernel indexes both buffers by these sizes: a mismatch would read or write outside them
    assert rows.is_contiguous() and rows.shape[1] == wire_size(numel, bits, block_size)
    assert out.is_contiguous() and out.numel() == rows.shape[0] // summed * numel
    if not numel or not rows.shape[0]:
        return
    G, HALF = tile_shape(block_size)
    grid = (triton.cdiv(num_blocks(numel, block_size), G), rows.shape[0] // summed)
    _dequantize_kernel[grid](
        rows.view(torch.int8), rows.view(torch.float32), output_view(out), numel, rows.shape[1],
        scale_offset(numel, bits), float(multiplier), ROWS=summed, BITS=bits, BS=block_size, G=G, HALF=HALF,
        SCALED=multiplier != 1.0, BF16_BY_HAND=bf16_by_hand(out),
        IDX64=needs_int64(rows.numel() + 2 * G * HALF, out.numel() + 2 * G * HALF), **LAUNCH_OPTIONS,
    )  # fmt: skip


def dequantize(
    buf: torch.Tensor, numel: int, bits: int, block_size: int, dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    rows = (buf if buf.dim() == 2 else buf.view(1, -1)).contiguous()
    if out is None:
        out = torch.empty(buf.shape[:-1] + (numel,), dtype=dtype, device=buf.device)
    _launch(rows, out, numel, bits, block_size, 1, 1.0)
    return out


def dequantize_reduce(
    buf: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    *,
    multiplier: float = 1.0,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if out is None:
        out = torch.empty(numel, dtype=dtype or torch.float32, device=buf.device)
    _launch(buf.contiguous(), out, numel, bits, block_size, buf.shape[0], multiplier)
    return out
