"""qgZ steps 3 and 5, fused: each input is read once and the result written once.

- ``dequantize_reduce_quantize``: K pieces from each of N peers -> dequantize, sum over N in fp32, re-quantize (to
  another bit width if asked). Separate kernels would write and re-read the N dequantized copies and the sum.
- ``dequantize_reduce``: M rows -> dequantize, sum in fp32, times the op's multiplier, cast into the output.

The sum runs over the inputs in index order, as the torch twins' does, so the fp32 results are identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import load_dequantized_tile, quantize_tile, store_tile, store_values, tile_offsets, uniform_pairs
from .layout import QMAX, check_format, num_blocks, scale_offset, wire_size
from .quantize_kernel import FLOAT_DTYPES, contiguous_wire, output_view, stochastic_seed, tile_shape


@triton.jit
def _dequantize_reduce_quantize_kernel(buf_ptr, in_scale_ptr, out_ptr, out_scale_ptr, n, N, K, in_wire, in_scale0,
                                       out_wire, out_scale0, bs, nb, seed, IN_BITS: tl.constexpr,
                                       OUT_BITS: tl.constexpr, QMAX: tl.constexpr, G: tl.constexpr,
                                       HALF: tl.constexpr, STOCHASTIC: tl.constexpr):  # fmt: skip
    pid, k = tl.program_id(0), tl.program_id(1).to(tl.int64)
    e, m, blk, blk_ok = tile_offsets(pid, bs, n, nb, G, HALF)
    acc_e = tl.zeros((G, HALF), tl.float32)
    acc_o = tl.zeros((G, HALF), tl.float32)
    for i in range(N):
        row = i * K + k
        ve, vo = load_dequantized_tile(buf_ptr, in_scale_ptr, row * in_wire, row * (in_wire // 4) + in_scale0,
                                       e, m, blk, blk_ok, bs, n, IN_BITS, G, HALF)  # fmt: skip
        acc_e += ve
        acc_o += vo
    ue = acc_e
    uo = acc_o
    if STOCHASTIC:
        ue, uo = uniform_pairs(seed, k * n + e, G, HALF)
    qe, qo, scale = quantize_tile(acc_e, acc_o, ue, uo, QMAX, STOCHASTIC)
    store_tile(out_ptr, out_scale_ptr, k * out_wire, k * (out_wire // 4) + out_scale0, e, m, blk, blk_ok, bs, n,
               qe, qo, scale, OUT_BITS, G, HALF)  # fmt: skip


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
    check_format(in_bits, block_size)
    check_format(out_bits, block_size)
    if buf.dim() != 3:
        raise ValueError(f"dequantize_reduce_quantize: expected (N, K, wire) rows, got shape {tuple(buf.shape)}.")
    N, K, _ = buf.shape
    buf = contiguous_wire(buf, numel, in_bits, block_size, "dequantize_reduce_quantize")
    out_wire = wire_size(numel, out_bits, block_size)
    out = torch.zeros(K, out_wire, dtype=torch.uint8, device=buf.device)
    if numel and K:
        nb = num_blocks(numel, block_size)
        G, HALF = tile_shape(block_size)
        _dequantize_reduce_quantize_kernel[(triton.cdiv(nb, G), K)](
            buf, buf.view(torch.float32), out, out.view(torch.float32), numel, N, K, buf.shape[2],
            scale_offset(numel, in_bits) // 4, out_wire, scale_offset(numel, out_bits) // 4, block_size, nb,
            stochastic_seed(seed) if stochastic else 0,
            IN_BITS=in_bits, OUT_BITS=out_bits, QMAX=QMAX[out_bits], G=G, HALF=HALF, STOCHASTIC=stochastic,
        )  # fmt: skip
    return out


@triton.jit
def _dequantize_reduce_kernel(buf_ptr, scale_ptr, out_ptr, n, M, wire, scale0, bs, nb, multiplier,
                              BITS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                              OUT_BF16: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    e, m, blk, blk_ok = tile_offsets(pid, bs, n, nb, G, HALF)
    acc_e = tl.zeros((G, HALF), tl.float32)
    acc_o = tl.zeros((G, HALF), tl.float32)
    zero = pid.to(tl.int64) * 0  # row offsets in int64 (the loop index may be a plain int)
    for i in range(M):
        row = zero + i
        ve, vo = load_dequantized_tile(buf_ptr, scale_ptr, row * wire, row * (wire // 4) + scale0, e, m, blk, blk_ok,
                                       bs, n, BITS, G, HALF)  # fmt: skip
        acc_e += ve
        acc_o += vo
    store_values(out_ptr, e, m, acc_e * multiplier, acc_o * multiplier, OUT_BF16, G, HALF)


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
    check_format(bits, block_size)
    if buf.dim() != 2:
        raise ValueError(f"dequantize_reduce: expected (M, wire) rows, got shape {tuple(buf.shape)}.")
    buf = contiguous_wire(buf, numel, bits, block_size, "dequantize_reduce")
    if out is None:
        out = torch.empty(numel, dtype=dtype or torch.float32, device=buf.device)
    if out.dtype not in FLOAT_DTYPES or out.numel() != numel or not out.is_contiguous():
        raise ValueError(
            f"dequantize_reduce: `out` must be a contiguous float tensor of {numel} elements, got"
            f" {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()})."
        )
    if numel:
        nb = num_blocks(numel, block_size)
        G, HALF = tile_shape(block_size)
        _dequantize_reduce_kernel[(triton.cdiv(nb, G),)](
            buf, buf.view(torch.float32), output_view(out), numel, buf.shape[0], buf.shape[1],
            scale_offset(numel, bits) // 4, block_size, nb, float(multiplier),
            BITS=bits, G=G, HALF=HALF, OUT_BF16=out.dtype == torch.bfloat16,
        )  # fmt: skip
    return out
