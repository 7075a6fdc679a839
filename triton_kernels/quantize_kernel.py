"""Block quantize / dequantize (INT8, INT4) in Triton; bit-identical to ``reference.quantize`` / ``dequantize``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import (
    load_dequantized_tile,
    load_pairs,
    quantize_tile,
    store_tile,
    store_values,
    tile_offsets,
    uniform_pairs,
)
from .layout import QMAX, check_format, check_wire, num_blocks, scale_offset, wire_size

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tile_shape(block_size: int) -> tuple[int, int]:
    """(G, HALF): blocks per program and the padded half-block; about 4096 elements per program."""
    half = triton.next_power_of_2(-(-block_size // 2))
    return max(1, 2048 // half), half


def check_input(x: torch.Tensor, op: str) -> torch.Tensor:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: expected float32, bfloat16 or float16 input, got {x.dtype}.")
    if x.dim() not in (1, 2):
        raise ValueError(f"{op}: expected a 1-D tensor or 2-D rows, got shape {tuple(x.shape)}.")
    return x if x.stride(-1) == 1 else x.contiguous()


def output_view(out: torch.Tensor) -> torch.Tensor:
    """What the kernels store into: bf16 outputs as their int16 bits (see ``_tiles.store_values``)."""
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out


def stochastic_seed(seed: int | None) -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed % (2**31 - 1)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, n, x_row_stride, wire, scale_row0, bs, nb, seed,
                     BITS: tl.constexpr, QMAX: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                     STOCHASTIC: tl.constexpr):  # fmt: skip
    pid, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    e, m, blk, blk_ok = tile_offsets(pid, bs, n, nb, G, HALF)
    xe, xo = load_pairs(x_ptr + row * x_row_stride, e, m, G, HALF)
    ue = xe
    uo = xo
    if STOCHASTIC:
        ue, uo = uniform_pairs(seed, row * n + e, G, HALF)
    qe, qo, scale = quantize_tile(xe, xo, ue, uo, QMAX, STOCHASTIC)
    store_tile(out_ptr, scale_ptr, row * wire, row * (wire // 4) + scale_row0, e, m, blk, blk_ok, bs, n, qe, qo,
               scale, BITS, G, HALF)  # fmt: skip


def quantize(
    x: torch.Tensor, bits: int, block_size: int, *, stochastic: bool = False, seed: int | None = None
) -> torch.Tensor:
    check_format(bits, block_size)
    x = check_input(x, "quantize")
    rows = x if x.dim() == 2 else x.view(1, -1)
    R, n = rows.shape
    wire = wire_size(n, bits, block_size)
    out = torch.zeros(R, wire, dtype=torch.uint8, device=x.device)
    nb = num_blocks(n, block_size)
    if n and R:
        G, HALF = tile_shape(block_size)
        _quantize_kernel[(triton.cdiv(nb, G), R)](
            rows, out, out.view(torch.float32), n, rows.stride(0), wire, scale_offset(n, bits) // 4, block_size, nb,
            stochastic_seed(seed) if stochastic else 0,
            BITS=bits, QMAX=QMAX[bits], G=G, HALF=HALF, STOCHASTIC=stochastic,
        )  # fmt: skip
    return out if x.dim() == 2 else out.view(-1)


@triton.jit
def _dequantize_kernel(buf_ptr, scale_ptr, out_ptr, n, wire, scale_row0, bs, nb,
                       BITS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, OUT_BF16: tl.constexpr):  # fmt: skip
    pid, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    e, m, blk, blk_ok = tile_offsets(pid, bs, n, nb, G, HALF)
    ve, vo = load_dequantized_tile(buf_ptr, scale_ptr, row * wire, row * (wire // 4) + scale_row0, e, m, blk, blk_ok,
                                   bs, n, BITS, G, HALF)  # fmt: skip
    store_values(out_ptr + row * n, e, m, ve, vo, OUT_BF16, G, HALF)


def contiguous_wire(buf: torch.Tensor, numel: int, bits: int, block_size: int, op: str) -> torch.Tensor:
    check_wire(buf, numel, bits, block_size, op)
    return buf.contiguous()


def dequantize(buf: torch.Tensor, numel: int, bits: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    check_format(bits, block_size)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dequantize: output dtype must be float32, bfloat16 or float16, got {dtype}.")
    rows = contiguous_wire(buf if buf.dim() == 2 else buf.view(1, -1), numel, bits, block_size, "dequantize")
    R = rows.shape[0]
    out = torch.empty(R, numel, dtype=dtype, device=buf.device)
    if numel and R:
        nb = num_blocks(numel, block_size)
        G, HALF = tile_shape(block_size)
        _dequantize_kernel[(triton.cdiv(nb, G), R)](
            rows, rows.view(torch.float32), output_view(out), numel, rows.shape[1], scale_offset(numel, bits) // 4,
            block_size, nb, BITS=bits, G=G, HALF=HALF, OUT_BF16=out.dtype == torch.bfloat16,
        )  # fmt: skip
    return out if buf.dim() == 2 else out.view(-1)
