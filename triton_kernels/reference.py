"""Pure-torch twins of the kernels: the specification the Triton kernels match bit for bit, and the CPU path.

Vectorised over blocks; the Python loops run over rows, i.e. over ranks. Rows that are independent (a quantization
with nearest rounding, with or without feedback; a dequantize in parameter-aligned blocks) go one at a time, so the
CPU path's fp32 temporaries are one row's, not a gathered unit's; qgZ's step-3 re-quantization, whose input is
already its K summed rows in fp32, takes them in one pass, with feedback as without (half the small ops at K = 2).
The sum of N or K received copies is sequential, in rank order, one copy dequantized at a time, so the fp32 result
is the same as the kernels' running sum. Never imports triton.
Each op takes its input tensor and its spec (``specs``), checked once, by the public op in
``lightning_zeropp.kernels``, before it gets here.
"""

from __future__ import annotations

import torch

from .layout import QMAX, RECIPROCAL_QMAX, Blocks, num_blocks, payload_bytes, scale_offset, swizzle_order, wire_size
from .specs import DequantizeReduceQuantizeSpec, DequantizeReduceSpec, DequantizeSpec, QuantizeSpec, SwizzleQuantizeSpec

_FLT_MIN_NORMAL = torch.finfo(torch.float32).tiny


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


def _per_block(values: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """Views of ``(R, n)`` as its full blocks ``(R, n // bs, bs)`` and, if any, the partial tail ``(R, 1, n % bs)``.

    Working on views avoids padding copies; a block's statistics never see elements beyond ``n``.
    """
    full = values.shape[1] // block_size * block_size
    parts = [values[:, :full].unflatten(1, (-1, block_size))] if full else []
    if full < values.shape[1]:
        parts.append(values[:, full:].unsqueeze(1))
    return parts


def _quantize_uniform(
    x: torch.Tensor,
    bits: int,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    lost: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-quantizes ``x`` (1-D: one row; 2-D: each row on its own) into the uniform wire format (``layout``).

    ``lost`` (fp32, ``x``'s shape, may be ``x`` itself): receives ``x - dequantize(wire)``, what the quantization
    lost, computed from each block's codes before they are packed (bit for bit the dequantized wire's: the code is an
    integer in fp32 times the block's fp32 scale, one rounding, then the subtraction) instead of unpacking them."""
    rows, two_d = _as_rows(x)
    R, n = rows.shape
    nb, qmax = num_blocks(n, block_size), QMAX[bits]
    pb, so, wire = payload_bytes(n, bits), scale_offset(n, bits), wire_size(n, bits, block_size)
    out = torch.empty(R, wire, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out if two_d else out.view(-1)
    values = rows.float()
    parts = _per_block(values, block_size)
    # max |x| without a full-size temporary (NaN propagates); abs_ turns the -0.0 of an all-zero block into +0.0
    absmax = torch.cat([torch.maximum(p.amax(dim=2), p.amin(dim=2).neg_()).abs_() for p in parts], dim=1)
    scale = absmax * RECIPROCAL_QMAX[bits]  # one fp32 rounding, as the kernels' multiply
    # below the smallest normal float a block's reciprocal would overflow: such a block codes 0
    finite = torch.isfinite(scale)
    usable = finite & (scale >= _FLT_MIN_NORMAL)
    every_block_usable = bool(usable.all())
    every_block_finite = every_block_usable or bool(finite.all())
    inv = 1.0 / (scale if every_block_usable else torch.where(usable, scale, 1.0))
    # An unusable block codes 0. A finite one (an all-zero block is the common case: the spans of norm gains and
    # biases qgZ carries apart) is below qmax times the smallest normal float, so times 1 it rounds to 0 anyway; only
    # non-finite values, stochastic rounding's floor of a tiny negative value, or ``lost`` (whose sign of zero must be
    # the kernels': x - (+0)) need the full-size mask.
    masked = not every_block_usable and (stochastic or lost is not None or not every_block_finite)
    codes = out[:, :pb].view(torch.int8) if bits == 8 else torch.zeros(R, 2 * pb, dtype=torch.int8, device=x.device)
    noise = _per_block(_uniform((R, n), seed, x.device), block_size) if stochastic else [None] * len(parts)
    wire_scale = scale if every_block_finite else torch.where(finite, scale, float("nan"))
    losses = _per_block(lost.view(R, n), block_size) if lost is not None else [None] * len(parts)
    first = 0
    for part, code, u, loss in zip(parts, _per_block(codes[:, :n], block_size), noise, losses):
        blocks = slice(first, first + part.shape[1])
        first += part.shape[1]
        y = part * inv[:, blocks].unsqueeze(2)
        if stochastic:
            y.add_(u).floor_()
        else:
            y.round_()  # round half to even
        y.clamp_(-qmax, qmax)
        if masked:  # a block with Inf or NaN codes 0 with scale NaN: dequantizes to NaN
            y.masked_fill_(~usable[:, blocks].unsqueeze(2), 0.0)
        code.copy_(y)
        if loss is not None:  # after the code is taken: ``loss`` may be ``part`` itself
            torch.sub(part, y.mul_(wire_scale[:, blocks].unsqueeze(2)), out=loss)
    scale = wire_scale
    if bits == 4:
        pairs = codes.view(torch.uint8)
        torch.bitwise_or(pairs[:, 0::2] & 0xF, (pairs[:, 1::2] & 0xF) << 4, out=out[:, :pb])
    out[:, pb:so].zero_()
    out[:, so : so + 4 * nb] = scale.contiguous().view(torch.uint8).view(R, 4 * nb)
    out[:, so + 4 * nb :].zero_()
    return out if two_d else out.view(-1)


def _dequantize_into(out: torch.Tensor, buf: torch.Tensor, numel: int, bits: int, block_size: int) -> torch.Tensor:
    """``(R, wire)`` -> ``out`` ``(R, numel)``: ``q * scale`` computed in fp32, rounded once into ``out``'s dtype."""
    R = buf.shape[0]
    if numel == 0:
        return out
    nb, pb, so = num_blocks(numel, block_size), payload_bytes(numel, bits), scale_offset(numel, bits)
    payload = buf[:, :pb].view(torch.int8)
    if bits == 8:
        q = payload
    else:  # arithmetic shifts of the signed byte sign-extend each nibble
        q = torch.stack(((payload << 4) >> 4, payload >> 4), dim=2).view(R, 2 * pb)[:, :numel]
    scale = buf[:, so : so + 4 * nb].contiguous().view(torch.float32)
    first = 0
    for code, target in zip(_per_block(q, block_size), _per_block(out, block_size)):
        torch.mul(code, scale[:, first : first + code.shape[1]].unsqueeze(2), out=target)  # int8 x fp32 -> fp32
        first += code.shape[1]
    return out


def _dequantize_f32(buf: torch.Tensor, numel: int, bits: int, block_size: int) -> torch.Tensor:
    """(R, wire) -> (R, numel) float32, uniform blocks."""
    out = torch.empty(buf.shape[0], numel, dtype=torch.float32, device=buf.device)
    return _dequantize_into(out, buf, numel, bits, block_size)


# ------------------------------------------------------------------------------------------------------------------
# Parameter-aligned blocks (layout.Blocks): each block is placed in a slot of ``block_size`` of a padded row, zeros
# after its end, and quantized there with the uniform code above. Zeros change no block's absmax, so every code and
# scale is the one of the block alone; then the codes are moved to their compact places in the wire row.


class _Padded:
    """Where the elements and the payload bytes of a row laid out in ``blocks`` sit in the padded row: as runs of
    consecutive blocks that are contiguous in both layouts (a run ends after each short block, i.e. at each segment
    end), so moving between the two is one slice copy per run, about one per parameter. A payload run includes the
    zero padding after its short block (``Blocks.padded``), which the padded row's codes of zeros supply."""

    def __init__(self, blocks: Blocks, block_size: int) -> None:
        self.width = blocks.count * block_size
        self.element_runs: list[tuple[int, int, int]] = []  # (compact start, padded start, length)
        self.byte_runs: dict[int, list[tuple[int, int, int]]] = {8: [], 4: []}
        first = 0
        for b in range(blocks.count):
            length = blocks.starts[b + 1] - blocks.starts[b]
            if length < block_size or b + 1 == blocks.count:
                self._add_run(blocks, block_size, first, b + 1)
                first = b + 1

    def _add_run(self, blocks: Blocks, block_size: int, first: int, last: int) -> None:
        start, end = blocks.starts[first], blocks.starts[last]
        self.element_runs.append((start, first * block_size, end - start))
        for bits, runs in self.byte_runs.items():
            offsets = blocks.payload_offsets(bits)
            runs.append((offsets[first], first * block_size * bits // 8, offsets[last] - offsets[first]))

    @staticmethod
    def of(blocks: Blocks, block_size: int) -> _Padded:
        return blocks.cached(("reference", block_size), lambda: _Padded(blocks, block_size))

    def spread(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(R, numel)`` -> ``(R, width)``, zeros after each block's end."""
        out = torch.zeros(rows.shape[0], self.width, dtype=dtype or rows.dtype, device=rows.device)
        for compact, padded, n in self.element_runs:
            out[:, padded : padded + n] = rows[:, compact : compact + n]
        return out

    def gather(self, padded_rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([padded_rows[:, p : p + n] for _, p, n in self.element_runs], dim=1)

    def compact_wire(self, uniform: torch.Tensor, blocks: Blocks, bits: int) -> torch.Tensor:
        """A uniform wire row of the padded row -> the wire row of ``blocks``."""
        R, count = uniform.shape[0], blocks.count
        so = blocks.scale_offset(bits)
        out = torch.zeros(R, blocks.wire_size(bits), dtype=torch.uint8, device=uniform.device)
        for compact, padded, n in self.byte_runs[bits]:
            out[:, compact : compact + n] = uniform[:, padded : padded + n]
        uso = scale_offset(self.width, bits)
        out[:, so : so + 4 * count] = uniform[:, uso : uso + 4 * count]
        return out

    def expand_wire(self, buf: torch.Tensor, blocks: Blocks, bits: int, block_size: int) -> torch.Tensor:
        """The wire row of ``blocks`` -> the uniform wire row of the padded row (the inverse of compact_wire)."""
        R, count = buf.shape[0], blocks.count
        so = blocks.scale_offset(bits)
        out = torch.zeros(R, wire_size(self.width, bits, block_size), dtype=torch.uint8, device=buf.device)
        for compact, padded, n in self.byte_runs[bits]:
            out[:, padded : padded + n] = buf[:, compact : compact + n]
        uso = scale_offset(self.width, bits)
        out[:, uso : uso + 4 * count] = buf[:, so : so + 4 * count]
        return out


# ------------------------------------------------------------------------------------------------------------------
# Rotated blocks (``rotation_seed``): before quantization each block is multiplied by a sign vector and transformed by
# a Walsh-Hadamard matrix, which spreads an outlier's magnitude over the whole block, so one large element no longer
# sets a scale that rounds its neighbours to zero; after dequantization the inverse. A block of L elements that is not
# a power of two (a parameter's last block, a row's tail) is rotated as the power-of-two pieces of L's binary form,
# largest first (100 = 64 + 32 + 4): each piece is its own orthogonal transform, nothing is padded and the wire is
# unchanged. The signs depend on the seed and the element's place in its block only (the same on every rank), and
# the forward transform is unnormalized (``H (d * x)``: adds and subtracts, exact scaling for a per-block absmax
# quantizer); the inverse divides by the piece's length, a power of two (exact).


def rotation_signs(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sign vector (fp32 +-1) of elements ``0 .. n-1`` of a block: bit 0 of a 32-bit mix (murmur3's finalizer)
    of ``seed + i * 0x9E3779B1``; integer arithmetic a kernel reproduces exactly."""
    mask = 0xFFFFFFFF
    h = (torch.arange(n, dtype=torch.int64, device=device) * 0x9E3779B1 + (seed & mask)) & mask
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    h ^= h >> 16
    return (1 - 2 * (h & 1)).to(torch.float32)


def rotation_pieces(length: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of the power-of-two pieces a block of ``length`` elements is rotated in, largest first."""
    pieces, offset = [], 0
    for bit in reversed(range(length.bit_length())):
        if length >> bit & 1:
            pieces.append((offset, 1 << bit))
            offset += 1 << bit
    return pieces


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform over the last dimension (a power of two), as butterflies of stride
    1, 2, 4, ...: ``(a, b) -> (a + b, a - b)``, the order a kernel's butterflies take."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x


def _rotate_slots(slots: torch.Tensor, lengths: list[int], seed: int, inverse: bool) -> torch.Tensor:
    """Rotates (or, ``inverse``, un-rotates) each block of ``slots`` ``(R, count, block_size)`` fp32, block ``b``
    holding ``lengths[b]`` elements from its slot's start (zeros after). Returns a new tensor."""
    out = slots.clone()
    signs = rotation_signs(seed, slots.shape[2], slots.device)
    by_length: dict[int, list[int]] = {}
    for b, length in enumerate(lengths):
        by_length.setdefault(length, []).append(b)
    for length, members in by_length.items():
        index = torch.tensor(members, device=slots.device)
        for offset, size in rotation_pieces(length):
            d = signs[offset : offset + size]
            x = slots[:, index, offset : offset + size]
            y = _hadamard(x).mul_(d).div_(size) if inverse else _hadamard(x * d)
            out[:, index, offset : offset + size] = y
    return out


def _rotate_rows(
    values: torch.Tensor, block_size: int, blocks: Blocks | None, seed: int, inverse: bool
) -> torch.Tensor:
    """``(R, numel)`` fp32 -> the same rows with every block (uniform or ``blocks``) rotated (see above)."""
    R, numel = values.shape
    if numel == 0:
        return values.clone()
    if blocks is not None:
        padded = _Padded.of(blocks, block_size)
        slots = padded.spread(values).view(R, blocks.count, block_size)
        lengths = [b - a for a, b in zip(blocks.starts, blocks.starts[1:])]
        return padded.gather(_rotate_slots(slots, lengths, seed, inverse).view(R, padded.width))
    count = num_blocks(numel, block_size)
    slots = torch.zeros(R, count * block_size, dtype=torch.float32, device=values.device)
    slots[:, :numel] = values
    lengths = [block_size] * (numel // block_size) + ([numel % block_size] if numel % block_size else [])
    rotated = _rotate_slots(slots.view(R, count, block_size), lengths, seed, inverse)
    return rotated.view(R, -1)[:, :numel]


def _quantize_f32(
    values: torch.Tensor, bits: int, block_size: int, blocks: Blocks | None, stochastic: bool, seed: int | None
) -> torch.Tensor:
    """``(R, numel)`` -> ``(R, wire)`` in the uniform format or the one of ``blocks``."""
    if blocks is None:
        return _quantize_uniform(values, bits, block_size, stochastic=stochastic, seed=seed)
    padded = _Padded.of(blocks, block_size)
    uniform = _quantize_uniform(padded.spread(values), bits, block_size, stochastic=stochastic, seed=seed)
    return padded.compact_wire(uniform, blocks, bits)


def _dequantize_rows(buf: torch.Tensor, numel: int, bits: int, block_size: int, blocks: Blocks | None) -> torch.Tensor:
    """``(R, wire)`` -> ``(R, numel)`` float32."""
    if blocks is None:
        return _dequantize_f32(buf, numel, bits, block_size)
    padded = _Padded.of(blocks, block_size)
    uniform = padded.expand_wire(buf, blocks, bits, block_size)
    return padded.gather(_dequantize_f32(uniform, padded.width, bits, block_size))


def _block_lengths(numel: int, block_size: int, blocks: Blocks | None, device: torch.device) -> torch.Tensor:
    """Each block's element count, in row order."""
    if blocks is not None:
        return torch.tensor(blocks.starts, device=device).diff()
    lengths = torch.full((num_blocks(numel, block_size),), block_size, device=device)
    if numel % block_size:
        lengths[-1] = numel % block_size
    return lengths


def _decayed_residual(residual: torch.Tensor, scales: torch.Tensor | None, block_size: int, blocks: Blocks | None,
                      decay: float) -> torch.Tensor:  # fmt: skip
    """An error feedback residual ``(R, numel)`` times ``decay``, in fp32: as stored (fp32, bf16) times ``decay``, or
    int8 codes times their block's ``scale * decay`` (the kernels' rounding: the decay folded into the scale; the
    int8 -> fp32 conversion is exact)."""
    if scales is None:
        return residual.float() * decay
    lengths = _block_lengths(residual.shape[1], block_size, blocks, residual.device)
    return torch.mul(residual, (scales * decay).repeat_interleave(lengths, dim=1))


def _store_residual(lost: torch.Tensor, residual: torch.Tensor, scales: torch.Tensor | None, block_size: int,
                    blocks: Blocks | None) -> None:  # fmt: skip
    """Writes what a quantization lost (fp32 ``(R, numel)``) into the residual: as it is (fp32), rounded to nearest
    even (bf16), or block-quantized to INT8 with the wire format's own code in the same blocks (int8 codes, one per
    element in the row's order, and their scales: ``max|lost| / 127`` per block, half to even; a block of zeros gets
    scale 0). Parameter-aligned blocks are quantized in their padded slots, whose codes are then gathered: a wire's
    payload is not in the row's order (a block's codes start on 16 bytes)."""
    if scales is None:
        residual.copy_(lost)
        return
    numel, count = lost.shape[1], scales.shape[1]
    if blocks is None:
        wire = _quantize_uniform(lost, 8, block_size)
        residual.copy_(wire[:, :numel].view(torch.int8))
        so = scale_offset(numel, 8)
    else:
        padded = _Padded.of(blocks, block_size)
        wire = _quantize_uniform(padded.spread(lost), 8, block_size)
        residual.copy_(padded.gather(wire[:, : padded.width].view(torch.int8)))
        so = scale_offset(padded.width, 8)
    scales.copy_(wire[:, so : so + 4 * count].contiguous().view(torch.float32))


def _quantize_with_feedback(
    values: torch.Tensor,
    bits: int,
    block_size: int,
    blocks: Blocks | None,
    stochastic: bool,
    seed: int | None,
    residual: torch.Tensor | None,
    scales: torch.Tensor | None,
    decay: float,
    rotation_seed: int | None = None,
) -> torch.Tensor:
    """Quantizes fp32 ``(R, numel)`` rows; with ``residual`` (same shape: fp32, bf16, or int8 codes with their
    ``scales``) first adds ``decay * residual`` and then leaves in ``residual`` what the quantization lost:
    ``v - dequantize(quantize(v))``, in the residual's width. With ``rotation_seed``, the blocks of ``v`` are
    rotated before they are quantized, and what was lost is measured in the rows' own (unrotated) coordinates:
    ``v - unrotate(dequantize(quantize(rotate(v))))``, so the next call, whose rotation differs, can add it."""
    if rotation_seed is not None:
        return _quantize_rotated(values, bits, block_size, blocks, stochastic, seed, residual, scales, decay,
                                 rotation_seed)  # fmt: skip
    if residual is None:
        return _quantize_f32(values, bits, block_size, blocks, stochastic, seed)
    if blocks is not None:
        arguments = (values, bits, block_size, blocks, stochastic, seed, residual, scales, decay)
        return _quantize_with_feedback_padded(*arguments)
    v = values + _decayed_residual(residual, scales, block_size, blocks, decay)
    out = _quantize_uniform(v, bits, block_size, stochastic=stochastic, seed=seed, lost=v)  # v becomes what it lost
    _store_residual(v, residual, scales, block_size, blocks)
    return out


def _quantize_with_feedback_padded(
    values: torch.Tensor,
    bits: int,
    block_size: int,
    blocks: Blocks,
    stochastic: bool,
    seed: int | None,
    residual: torch.Tensor,
    scales: torch.Tensor | None,
    decay: float,
) -> torch.Tensor:
    """:func:`_quantize_with_feedback` for parameter-aligned blocks, bit for bit, with every step in the padded row
    (one spread in, one gather out, instead of a spread and a gather around each of the three quantizations): the
    padding stays exactly 0 throughout (``0 + decay * 0``, ``0 - dequantize(code of 0)``), so no block's absmax sees
    it, and each element takes the same fp32 operations in the same order as in the compact row."""
    padded = _Padded.of(blocks, block_size)
    R = values.shape[0]
    if scales is None:
        stored = padded.spread(residual.float()).mul_(decay)
    else:  # int8 codes (exact in fp32) times their block's scale * decay, one rounding (see _decayed_residual)
        decayed = (scales * decay).unsqueeze(2)
        stored = padded.spread(residual, torch.float32).view(R, blocks.count, block_size).mul_(decayed)
        stored = stored.view(R, padded.width)
    v = padded.spread(values).add_(stored)
    del stored  # the padded rows' fp32 temporaries: at most two at a time
    uniform = _quantize_uniform(v, bits, block_size, stochastic=stochastic, seed=seed, lost=v)
    lost = v
    if scales is None:
        residual.copy_(padded.gather(lost))
    else:
        codes = _quantize_uniform(lost, 8, block_size)
        uso = scale_offset(padded.width, 8)
        residual.copy_(padded.gather(codes[:, : padded.width].view(torch.int8)))
        scales.copy_(codes[:, uso : uso + 4 * blocks.count].contiguous().view(torch.float32))
    return padded.compact_wire(uniform, blocks, bits)


def _quantize_rotated(
    values: torch.Tensor,
    bits: int,
    block_size: int,
    blocks: Blocks | None,
    stochastic: bool,
    seed: int | None,
    residual: torch.Tensor | None,
    scales: torch.Tensor | None,
    decay: float,
    rotation_seed: int,
) -> torch.Tensor:
    """:func:`_quantize_with_feedback` with rotated blocks (see the section above)."""
    v = values.float()
    if residual is not None:
        v = v + _decayed_residual(residual, scales, block_size, blocks, decay)
    out = _quantize_f32(_rotate_rows(v, block_size, blocks, rotation_seed, False), bits, block_size, blocks,
                        stochastic, seed)  # fmt: skip
    if residual is not None:
        sent = _rotate_rows(_dequantize_rows(out, v.shape[1], bits, block_size, blocks), block_size, blocks,
                            rotation_seed, True)  # fmt: skip
        _store_residual(v - sent, residual, scales, block_size, blocks)
    return out


def quantize(x: torch.Tensor, spec: QuantizeSpec) -> torch.Tensor:
    """Block-quantizes ``x`` (1-D: one row; 2-D: each row on its own) into the wire format (see ``layout``), in
    uniform blocks or in ``spec.blocks``; with ``spec.residual``, with error feedback (see
    :func:`_quantize_with_feedback`)."""
    residual, scales = spec.residual, spec.residual_scales
    rows, two_d = _as_rows(x)
    if residual is not None and not two_d:  # written through the views: the caller's tensors keep their shapes
        residual = residual.view(1, -1)
        scales = scales.view(1, -1) if scales is not None else None
    if spec.stochastic or rows.shape[0] == 1 or spec.rotation_seed is not None:  # one noise draw covers all rows
        out = _quantize_rows(rows, spec, residual, scales)
        return out if two_d else out.view(-1)
    return _row_by_row(rows, residual, scales, lambda r, res, sc: _quantize_rows(r, spec, res, sc))


def _quantize_rows(
    rows: torch.Tensor, spec: QuantizeSpec, residual: torch.Tensor | None, scales: torch.Tensor | None
) -> torch.Tensor:
    bits, block_size, blocks = spec.bits, spec.block_size, spec.blocks
    if blocks is None and residual is None and spec.rotation_seed is None:
        return _quantize_uniform(rows, bits, block_size, stochastic=spec.stochastic, seed=spec.seed)
    values = rows.float() if residual is not None or spec.rotation_seed is not None else rows
    return _quantize_with_feedback(
        values, bits, block_size, blocks, spec.stochastic, spec.seed, residual, scales, float(spec.decay),
        spec.rotation_seed,
    )  # fmt: skip


def _row_by_row(rows: torch.Tensor, residual: torch.Tensor | None, scales: torch.Tensor | None, quantize_rows):
    """``quantize_rows`` on one row at a time (with its residual and scales rows), into one ``(R, wire)`` tensor: the
    rows of a quantization with nearest rounding are independent, and the temporaries become one row's."""
    out = None
    for i in range(rows.shape[0]):
        row = quantize_rows(rows[i : i + 1], *(t if t is None else t[i : i + 1] for t in (residual, scales)))
        if out is None:
            out = torch.empty(rows.shape[0], row.shape[1], dtype=torch.uint8, device=rows.device)
        out[i : i + 1] = row
    return out


def dequantize(buf: torch.Tensor, spec: DequantizeSpec) -> torch.Tensor:
    """Inverse of :func:`quantize`: a 1-D buffer gives ``(numel,)``, a 2-D one ``(rows, numel)``, in ``spec.dtype``;
    with ``spec.out`` (contiguous, ``(rows, numel)`` or flat), written there instead."""
    numel, bits, block_size, out = spec.numel, spec.bits, spec.block_size, spec.out
    rows, two_d = _as_rows(buf)
    if spec.blocks is not None:  # one row at a time: the fp32 temporaries are a row's, not all the gathered rows'
        R = rows.shape[0]
        target = torch.empty(R, numel, dtype=spec.dtype, device=buf.device) if out is None else out.view(R, numel)
        for i in range(R):
            target[i : i + 1] = _dequantize_rows(rows[i : i + 1], numel, bits, block_size, spec.blocks)
        if out is not None:
            return out
        return target if two_d else target.view(-1)
    if out is None:
        target = torch.empty(rows.shape[0], numel, dtype=spec.dtype, device=buf.device)
        _dequantize_into(target, rows, numel, bits, block_size)
        return target if two_d else target.view(-1)
    _dequantize_into(out.view(rows.shape[0], numel), rows, numel, bits, block_size)
    return out


def swizzle_quantize(x: torch.Tensor, spec: SwizzleQuantizeSpec) -> torch.Tensor:
    """qgZ step 1: piece ``stage`` of each of the W = N*K chunks of ``x``, in swizzled slot order, quantized. With
    ``blocks`` (the chunk's parameter-aligned blocks), the pieces are :meth:`Blocks.stages`'.

    Returns ``(W, wire_size(piece))``: rows ``[l*K, (l+1)*K)`` are for local peer ``l``.
    """
    chunk, start, size, piece = spec.piece(x.numel())
    order = torch.tensor(swizzle_order(spec.ranks_per_node, spec.num_nodes), device=x.device)
    pieces = x.view(spec.ranks_per_node * spec.num_nodes, chunk)[:, start : start + size].index_select(0, order)
    return quantize(pieces, piece)


def _sum_dequantized(buf: torch.Tensor, numel: int, bits: int, block_size: int, blocks: Blocks | None) -> torch.Tensor:
    """``buf`` ``(M, R, wire)``: the fp32 sum over dim 0 of each ``(R, wire)`` dequantized, sequentially in index order
    (the kernels' order, so results match bit for bit), one ``(R, wire)`` dequantized at a time."""
    acc = _dequantize_rows(buf[0], numel, bits, block_size, blocks)
    for i in range(1, buf.shape[0]):
        acc += _dequantize_rows(buf[i], numel, bits, block_size, blocks)
    return acc


def dequantize_reduce_quantize(buf: torch.Tensor, spec: DequantizeReduceQuantizeSpec) -> torch.Tensor:
    """qgZ step 3: ``buf`` is ``(N, K, wire_in)``, K pieces from each of N peers; returns ``(K, wire_out)``, each
    piece dequantized, summed over the N peers in fp32, and re-quantized (with ``residual``: error feedback)."""
    numel, block_size, blocks = spec.numel, spec.block_size, spec.blocks
    total = _sum_dequantized(buf, numel, spec.in_bits, block_size, blocks)
    return _quantize_with_feedback(
        total, spec.out_bits, block_size, blocks, spec.stochastic, spec.seed, spec.residual, spec.residual_scales,
        float(spec.decay), spec.rotation_seed,
    )  # fmt: skip


def dequantize_reduce(buf: torch.Tensor, spec: DequantizeReduceSpec) -> torch.Tensor:
    """qgZ step 5: ``buf`` is ``(M, wire)``; returns the fp32 sum of the M dequantized rows times ``multiplier``,
    cast to ``out``'s dtype (written into ``out`` when given) or ``dtype``."""
    total = _sum_dequantized(buf.unsqueeze(1), spec.numel, spec.bits, spec.block_size, spec.blocks)[0]
    if spec.rotation_seed is not None:  # the rows share one rotation: the sum of the rotated rows is un-rotated once
        total = _rotate_rows(total.unsqueeze(0), spec.block_size, spec.blocks, spec.rotation_seed, True)[0]
    multiplier = float(spec.multiplier)
    if multiplier != 1.0:
        total = total * multiplier
    if spec.out is not None:
        spec.out.copy_(total)
        return spec.out
    return total.to(spec.dtype or torch.float32)
