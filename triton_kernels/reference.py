"""Pure-torch twins of the kernels: the specification the Triton kernels match bit for bit, and the CPU path.

Vectorised over blocks and rows; the only Python loops run over ranks (the sum of N or K received copies is
sequential, in rank order, so the fp32 result is the same as the kernels' running sum). Never imports triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import QMAX, check_format, num_blocks, payload_bytes, scale_offset, stage_bounds, swizzle_order, wire_size


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if x.dim() == 2:
        return x, True
    return x.reshape(1, -1), False


def _uniform(shape: tuple[int, ...], seed: int | None, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


def quantize(
    x: torch.Tensor, bits: int, block_size: int, *, stochastic: bool = False, seed: int | None = None
) -> torch.Tensor:
    """Block-quantizes ``x`` (1-D: one row; 2-D: each row on its own) into the wire format (see ``layout``)."""
    check_format(bits, block_size)
    rows, two_d = _as_rows(x)
    R, n = rows.shape
    nb, qmax = num_blocks(n, block_size), QMAX[bits]
    xb = _blocks(rows.float(), nb, block_size)
    # max |x| without a full-size temporary (NaN propagates); abs_ turns the -0.0 of an all-zero block into +0.0
    absmax = torch.maximum(xb.amax(dim=2), xb.amin(dim=2).neg_()).abs_()
    scale = absmax / qmax
    usable = torch.isfinite(scale) & (scale > 0)
    every_block_usable = bool(usable.all())
    y = xb / (scale if every_block_usable else torch.where(usable, scale, torch.ones_like(scale))).unsqueeze(2)
    if stochastic:
        y.add_(_uniform(tuple(y.shape), seed, y.device)).floor_()
    else:
        y.round_()  # round half to even
    y.clamp_(-qmax, qmax)
    if not every_block_usable:  # zeros stay 0; a block with Inf or NaN codes 0 with scale NaN: dequantizes to NaN
        y.masked_fill_(~usable.unsqueeze(2), 0.0)
        scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    q = y.view(R, nb * block_size)[:, :n].to(torch.int8)

    pb, so, wire = payload_bytes(n, bits), scale_offset(n, bits), wire_size(n, bits, block_size)
    out = torch.empty(R, wire, dtype=torch.uint8, device=x.device)
    if bits == 8:
        out[:, :pb] = q.view(torch.uint8)
    else:
        q = F.pad(q, (0, 2 * pb - n)).view(torch.uint8)
        torch.bitwise_or(q[:, 0::2] & 0xF, (q[:, 1::2] & 0xF) << 4, out=out[:, :pb])
    out[:, pb:so].zero_()
    out[:, so : so + 4 * nb] = scale.contiguous().view(torch.uint8).view(R, 4 * nb)
    out[:, so + 4 * nb :].zero_()
    return out if two_d else out.view(-1)


def _blocks(values: torch.Tensor, nb: int, block_size: int) -> torch.Tensor:
    """(R, n) -> (R, nb, block_size), zero-padding the last block (zeros never change a block's absmax)."""
    pad = nb * block_size - values.shape[1]
    return (F.pad(values, (0, pad)) if pad else values).view(values.shape[0], nb, block_size)


def _dequantize_f32(buf: torch.Tensor, numel: int, bits: int, block_size: int) -> torch.Tensor:
    """(R, wire) -> (R, numel) float32."""
    R = buf.shape[0]
    if numel == 0:
        return torch.zeros(R, 0, device=buf.device)
    nb, pb, so = num_blocks(numel, block_size), payload_bytes(numel, bits), scale_offset(numel, bits)
    payload = buf[:, :pb].contiguous().view(torch.int8)
    if bits == 8:
        q = payload.float()
    else:  # arithmetic shifts of the signed byte sign-extend each nibble
        q = torch.stack(((payload << 4) >> 4, payload >> 4), dim=2).view(R, 2 * pb)[:, :numel].float()
    scale = buf[:, so : so + 4 * nb].contiguous().view(torch.float32)
    return (_blocks(q, nb, block_size) * scale.unsqueeze(2)).view(R, nb * block_size)[:, :numel]


def dequantize(buf: torch.Tensor, numel: int, bits: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: a 1-D buffer gives ``(numel,)``, a 2-D one ``(rows, numel)``, in ``dtype``."""
    check_format(bits, block_size)
    rows, two_d = _as_rows(buf)
    _check_wire(rows, numel, bits, block_size)
    out = _dequantize_f32(rows, numel, bits, block_size).to(dtype)
    return out if two_d else out.view(-1)


def _check_wire(rows: torch.Tensor, numel: int, bits: int, block_size: int) -> None:
    if rows.dtype != torch.uint8:
        raise TypeError(f"dequantize: expected a uint8 wire buffer, got {rows.dtype}.")
    expected = wire_size(numel, bits, block_size)
    if rows.shape[1] != expected:
        raise ValueError(
            f"dequantize: a row of {numel} elements at {bits} bits, block {block_size} takes {expected} bytes,"
            f" but the buffer rows hold {rows.shape[1]}."
        )


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
    """qgZ step 1: piece ``stage`` of each of the W = N*K chunks of ``x``, in swizzled slot order, quantized.

    Returns ``(W, wire_size(piece))``: rows ``[l*K, (l+1)*K)`` are for local peer ``l``.
    """
    W = ranks_per_node * num_nodes
    if x.dim() != 1 or x.numel() % W:
        raise ValueError(f"swizzle_quantize: expected a flat buffer of {W} equal chunks, got shape {tuple(x.shape)}.")
    chunk = x.numel() // W
    start, size = stage_bounds(chunk, stages, stage)
    order = torch.tensor(swizzle_order(ranks_per_node, num_nodes), device=x.device)
    pieces = x.view(W, chunk)[:, start : start + size].index_select(0, order)
    return quantize(pieces, bits, block_size, stochastic=stochastic, seed=seed)


def _sum_rows_f32(values: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in fp32, sequentially in index order (the kernels' order, so results match bit for bit)."""
    acc = values[0].clone()
    for i in range(1, values.shape[0]):
        acc += values[i]
    return acc


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
    """qgZ step 3: ``buf`` is ``(N, K, wire_in)``, K pieces from each of N peers; returns ``(K, wire_out)``, each
    piece dequantized, summed over the N peers in fp32, and re-quantized."""
    check_format(in_bits, block_size)
    N, K, _ = buf.shape
    _check_wire(buf.view(N * K, -1), numel, in_bits, block_size)
    values = _dequantize_f32(buf.reshape(N * K, -1), numel, in_bits, block_size).view(N, K, numel)
    return quantize(_sum_rows_f32(values), out_bits, block_size, stochastic=stochastic, seed=seed)


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
    """qgZ step 5: ``buf`` is ``(M, wire)``; returns the fp32 sum of the M dequantized rows times ``multiplier``,
    cast to ``out``'s dtype (written into ``out`` when given) or ``dtype``."""
    check_format(bits, block_size)
    _check_wire(buf, numel, bits, block_size)
    total = _sum_rows_f32(_dequantize_f32(buf, numel, bits, block_size))
    if multiplier != 1.0:
        total = total * multiplier
    if out is not None:
        out.copy_(total)
        return out
    return total.to(dtype or torch.float32)
