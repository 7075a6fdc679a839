"""qgZ's step 3 in Triton: K pieces from each of N peers -> dequantize, sum over N in fp32, re-quantize (to another
bit width if asked). Each input is read once and each output written once; bit-identical to
``reference.dequantize_reduce_quantize``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import LAUNCH_OPTIONS, needs_int64, quantize_grid, stochastic_seed, tile_shape
from ._tiles import is_full_tile, padded_blocks, program_ids, quantize_to_row, sum_dequantized, tile_index
from .layout import QMAX, scale_offset, wire_size


@triton.jit
def _requantize_tile(pid, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, K, in_wire, in_so, out_wire, out_so,
                     seed, N: tl.constexpr, IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr, QMAX: tl.constexpr,
                     BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr,
                     MASKED: tl.constexpr):  # fmt: skip
    blk, e, t = tile_index(pid, BS, G, HALF)
    nb4 = padded_blocks(n, BS)
    xe, xo = sum_dequantized(buf_ptr, in_scale_ptr, k, K, in_wire, e, blk, t, n, in_so, nb4, N, IN_BITS, MASKED, BS,
                             G, HALF)  # fmt: skip
    quantize_to_row(out_ptr, out_scale_ptr, k, pid, out_wire, out_so, nb4, xe, xo, seed, e, blk, t, OUT_BITS, QMAX,
                    STOCHASTIC, MASKED, BS, G, HALF)  # fmt: skip


@triton.jit(do_not_specialize=["seed"])  # a fresh random seed per call must not recompile
def _requantize_kernel(buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, K, in_wire, in_so, out_wire, out_so, seed,
                       N: tl.constexpr, IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr, QMAX: tl.constexpr,
                       BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr,
                       IDX64: tl.constexpr):  # fmt: skip
    pid, k = program_ids(IDX64)
    if is_full_tile(pid, n, BS, G):  # every tile but a row's last: no masks, vector loads and stores
        _requantize_tile(pid, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, K, in_wire, in_so, out_wire,
                         out_so, seed, N, IN_BITS, OUT_BITS, QMAX, BS, G, HALF, STOCHASTIC, False)  # fmt: skip
    else:
        _requantize_tile(pid, k, buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, K, in_wire, in_so, out_wire,
                         out_so, seed, N, IN_BITS, OUT_BITS, QMAX, BS, G, HALF, STOCHASTIC, True)  # fmt: skip


def dequantize_reduce_quantize(
    buf: torch.Tensor,
    numel: int,
    in_bits: int,
    out_bits: int,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int | None = None,
) -> torch.Tensor:
    N, K, in_wire = buf.shape
    assert N >= 1 and in_wire == wire_size(numel, in_bits, block_size)  # the kernel reads N rows of this size
    buf = buf.contiguous()
    out_wire = wire_size(numel, out_bits, block_size)
    out = torch.empty(K, out_wire, dtype=torch.uint8, device=buf.device)
    if numel and K:
        G, HALF = tile_shape(block_size)
        grid = (quantize_grid(numel, out_bits, block_size, G), K)
        _requantize_kernel[grid](
            buf.view(torch.int8), buf.view(torch.float32), out.view(torch.int8), out.view(torch.float32), numel, K,
            in_wire, scale_offset(numel, in_bits), out_wire, scale_offset(numel, out_bits),
            stochastic_seed(seed) if stochastic else 0, N=N, IN_BITS=in_bits, OUT_BITS=out_bits, QMAX=QMAX[out_bits],
            BS=block_size, G=G, HALF=HALF, STOCHASTIC=stochastic,
            IDX64=needs_int64(buf.numel() + 2 * G * HALF, out.numel() + 2 * G * HALF, grid[0] * K * G * HALF),
            **LAUNCH_OPTIONS,
        )  # fmt: skip
    return out
