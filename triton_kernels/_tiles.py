"""Triton building blocks shared by the kernels: one tile = G quantization blocks, each seen as two vectors.

A tile is loaded and stored contiguously (``[G, 2 * HALF]``, HALF = the next power of two >= ceil(BS / 2)) and
split in registers into its even- and odd-indexed elements, ``[G, HALF]`` each. That is the INT4 byte layout
(element 2i in the low nibble, 2i+1 in the high nibble of one byte), so one kernel can read one bit width and write
another without reshuffling memory.

Masks decide whether the compiler can move 16 bytes per instruction, so every helper takes ``MASKED``:

- ``MASKED=False`` (every tile but the last of a row): no mask at all when the block size is a power of two, so
  loads and stores vectorize.
- ``MASKED=True`` (the last tile): input elements are masked against ``n``; payload bytes against the padded payload
  end ``so`` (a multiple of 16, the wire format's alignment), so even the last tile's payload moves in vectors and
  writes its own zero padding; scales against the padded scale count ``nb4`` (multiple of 4) for the same reason.
  The kernels never need a memset of the wire buffer.

The arithmetic is the torch twins', operation for operation, so results match bit for bit (the launchers turn off
FMA contraction, which would fuse ``q * scale`` into a following add):

- ``scale = absmax * r`` with ``r = 1 / qmax`` rounded to fp32 once (``layout.RECIPROCAL_QMAX``: a multiply where a
  division by the constant took a reciprocal's refinement and a slow-path check), ``inv = 1 / scale`` once per block
  (IEEE division), ``y = x * inv``;
- round half to even is ``y + 1.5 * 2**23``, whose low mantissa bits are then the code (exact for |y| < 2**22);
- ``absmax`` is a NaN-propagating max of the magnitudes, so a block with NaN or Inf is found without a separate
  pass: it gets scale NaN and codes 0; a block whose scale is below the smallest normal float codes 0 (its
  reciprocal would overflow). Compiled, it is a float max with NaN propagation (one ``FMNMX.NAN`` per element, the
  magnitude an operand modifier); in Triton's interpreter, which runs a custom reduction element by element, an
  integer max of the magnitudes' bits (two instructions per element compiled, the same result: see
  :data:`ABSMAX_BY_BITS`).
"""

import types

import triton
import triton.language as tl

from . import interpreting, layout

ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
INT4_MAGIC = tl.constexpr(8388616.0)  # 2**23 + 8
FLT_MAX = tl.constexpr(3.4028234663852886e38)
FLT_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)
RECIPROCAL_QMAX_8 = tl.constexpr(layout.RECIPROCAL_QMAX[8])  # fp32 holds them exactly
RECIPROCAL_QMAX_4 = tl.constexpr(layout.RECIPROCAL_QMAX[4])
# Philox 4x32 with 7 rounds passes the BigCrush battery (Salmon et al., SC 2011, "Parallel random numbers: as easy as
# 1, 2, 3"); 10 is the library default's safety margin. Rounding noise needs no more, and each round costs.
PHILOX_ROUNDS = tl.constexpr(7)
# How quantize_pairs finds a block's NaN-propagating absmax. Compiled (False): a float max with NaN propagation
# (``max.NaN.f32``, the magnitude folded into ``FMNMX``), 1 instruction per element. In the interpreter (True): the
# integer max of ``bits(x) & 0x7FFFFFFF`` (a float's magnitude bits order like the magnitude, and every NaN's lie above
# Inf's), 2 instructions per element compiled, but a built-in reduction the interpreter runs vectorized, where the
# float max's custom combine runs element by element (the kernel tests 6x slower). The two give the same absmax for
# every block without NaN and NaN (scale NaN, codes 0) for every block with one; tests/test_kernels.py runs both.
ABSMAX_BY_BITS = tl.constexpr(interpreting())


def _jit_here(fn: types.FunctionType):
    """``triton.jit`` of a plain function of a module that must not import triton (``layout``, which the torch twins
    use): the same code with this module's globals, where Triton looks names up (its interpreter requires
    ``triton.language`` among them). The source stays where it is written."""
    return triton.jit(types.FunctionType(fn.__code__, globals(), fn.__name__, fn.__defaults__, fn.__closure__))


# qgZ's slot order: the function the torch twin's gather uses, compiled, so the formula is written once
swizzle_source = _jit_here(layout.swizzle_source)


@triton.jit
def program_ids(IDX64: tl.constexpr):
    """(tile, row) of this program, in int64 when the buffers exceed 2**31 elements (32-bit math is cheaper)."""
    pid, row = tl.program_id(0), tl.program_id(1)
    if IDX64:
        pid, row = pid.to(tl.int64), row.to(tl.int64)
    return pid, row


@triton.jit
def tile_index(pid, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):
    """Block ids ``[G]``, element offsets ``[G, 2 * HALF]`` within the row, and lane ids ``[2 * HALF]``."""
    blk = pid * G + tl.arange(0, G)
    t = tl.arange(0, 2 * HALF)
    return blk, blk[:, None] * BS + t[None, :], t


@triton.jit
def is_full_tile(pid, n, BS: tl.constexpr, G: tl.constexpr):
    """Whether every element of tile ``pid`` lies below ``n`` (then no element mask is needed)."""
    return (pid + 1) * (G * BS) <= n


@triton.jit
def padded_blocks(n, BS: tl.constexpr):
    """The block count rounded up to 4: the scale slots a wire row holds (its end is 16-byte aligned)."""
    return (n + BS - 1) // BS + 3 & -4


@triton.jit
def wire_row(bytes_ptr, scales_ptr, row, wire, so):
    """Pointers to the payload and to the first scale of wire row ``row`` (rows of ``wire`` bytes, scales from byte
    ``so``), given the buffer's int8 and fp32 views. ``wire`` and ``so`` are multiples of 16 and not negative, so a
    shift divides them by 4 (``//`` on a signed int costs three instructions: the rounding toward zero)."""
    return bytes_ptr + row * wire, scales_ptr + row * (wire // 4) + so // 4


@triton.jit
def wire_row_bytes(bytes_ptr, row, wire, so):
    """:func:`wire_row` from the int8 view alone: the scales' pointer is the row's byte ``so`` cast to fp32 (``so`` is a
    multiple of 16). No division by 4 (three instructions on a signed int, per row), one address per row. Used by the
    parameter-aligned kernels; the uniform ones keep :func:`wire_row`, whose register allocation ptxas keeps without
    a stack frame at sm_80 (this form gave one uniform variant, N = 8 INT4 -> INT4 with an fp32 residual, 96 registers
    and a 16-byte stack)."""
    payload = bytes_ptr + row * wire
    return payload, (payload + so).to(tl.pointer_type(tl.float32))


@triton.jit
def split_pairs(v, G: tl.constexpr, HALF: tl.constexpr):
    """``[G, 2 * HALF]`` -> even and odd elements, ``[G, HALF]`` each."""
    return tl.split(tl.reshape(v, (G, HALF, 2)))


@triton.jit
def join_pairs(ve, vo, G: tl.constexpr, HALF: tl.constexpr):
    return tl.reshape(tl.join(ve, vo), (G, 2 * HALF))


@triton.jit
def load_pairs(ptr, e, t, n, MASKED: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
               STRIDED: tl.constexpr = False):  # fmt: skip
    """A contiguous tile of a float input as fp32 even / odd pairs (elements past ``n`` or the block are 0);
    ``STRIDED``: see :func:`load_pairs_aligned`."""
    if STRIDED and not MASKED and BS == 2 * HALF:
        ee, eo = split_pairs(e, G, HALF)
        return tl.load(ptr + ee).to(tl.float32), tl.load(ptr + eo).to(tl.float32)
    if MASKED:
        v = tl.load(ptr + e, mask=(t[None, :] < BS) & (e < n), other=0.0)
    elif BS == 2 * HALF:
        v = tl.load(ptr + e)
    else:
        v = tl.load(ptr + e, mask=t[None, :] < BS, other=0.0)
    return split_pairs(v.to(tl.float32), G, HALF)


@triton.jit
def _abs_bits_max(x):
    """Per block, the bits of max |x| as int32, NaN-propagating: with the sign bit cleared, a float's bits order like
    its magnitude, and every NaN's bits lie above Inf's. (A float max skips NaN; a custom NaN-propagating combine
    would do, but Triton's interpreter runs custom reductions element by element, 100x slower.)"""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max_nan(xe, xo):
    """Per block, max |x| as fp32, NaN-propagating (a float reduction with a custom combine; see
    :data:`ABSMAX_BY_BITS`)."""
    return tl.reduce(tl.maximum(tl.abs(xe), tl.abs(xo), propagate_nan=tl.PropagateNan.ALL), 1, _max_nan)


@triton.jit
def uniform_pairs(seed, counter0, G: tl.constexpr, HALF: tl.constexpr):
    """Uniform numbers in (0, 1) for stochastic rounding, ``[G, HALF]`` even and odd.

    One Philox 4x32 call gives four 32-bit words; each word gives two 16-bit uniforms, the midpoints
    ``(k + 1/2) * 2**-16`` (fine enough for rounding: the bias is below 2**-17 of a step; and never 0 nor 1, which
    lets INT4 rounding skip its clamp, see :func:`quantize_pairs`). So one call serves eight elements, instead of one
    call per element. Counters ``counter0 + [0, G * HALF / 4)`` must be unique per tile.
    """
    c = counter0 + tl.arange(0, G * HALF // 4)
    r0, r1, r2, r3 = tl.randint4x(seed, c, PHILOX_ROUNDS)
    ue = tl.reshape(tl.join(tl.join(_lo16(r0), _hi16(r0)), tl.join(_lo16(r1), _hi16(r1))), (G, HALF))
    uo = tl.reshape(tl.join(tl.join(_lo16(r2), _hi16(r2)), tl.join(_lo16(r3), _hi16(r3))), (G, HALF))
    return ue, uo


@triton.jit
def _lo16(r):
    """The low 16 bits k as ``(k + 1/2) * 2**-16``: k at the top of a mantissa of 1.0 with the next bit set
    (``0x40``: 2**-17), minus 1 (exact)."""
    return ((r.to(tl.uint32, bitcast=True) << 7) & 0x7FFF80 | 0x3F800040).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def _hi16(r):
    return ((r.to(tl.uint32, bitcast=True) >> 9) & 0x7FFF80 | 0x3F800040).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def quantize_pairs(xe, xo, seed, counter0, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr, G: tl.constexpr,
                   HALF: tl.constexpr):  # fmt: skip
    """fp32 pairs (masked elements 0) -> codes in [-QMAX, QMAX] and each block's fp32 scale.

    The codes come back as int32 words whose low bits are the code in two's complement: ``y + 1.5 * 2**23`` rounds
    ``y`` to the nearest integer (ties to even) and leaves it in the low mantissa bits, so no float -> int conversion
    is needed. Nearest rounding needs no clamp: ``r`` (``layout.RECIPROCAL_QMAX``) is ``1 / QMAX`` within 2**-24
    (relatively), so ``|x| * (1 / (absmax * r)) <= QMAX * (1 + 4 * 2**-24)`` (three more roundings), which rounds to
    QMAX. Nor does stochastic rounding to INT4: there ``r`` lies above 1/7, so ``|y| <= 7 * (1 + 3 * 2**-24) < 7 +
    2**-19``, and the uniforms lie in
    ``[2**-17, 1 - 2**-17]``, so ``y + u`` (rounded to fp32, whose spacing near 7 and 8 is 2**-21) stays inside
    ``(-7, 8)`` and ``floor`` gives a code in [-7, 7]. At INT8 (``127 * 3 * 2**-24`` exceeds 2**-17) it clamps. A block
    that cannot be scaled (NaN, Inf, or a scale below the smallest normal float) codes 0.
    """
    if ABSMAX_BY_BITS:
        absmax = tl.maximum(_abs_bits_max(xe), _abs_bits_max(xo)).to(tl.float32, bitcast=True)
    else:
        absmax = _abs_max_nan(xe, xo)
    bad = (absmax != absmax) | (absmax > FLT_MAX)
    tl.static_assert(QMAX == 127 or QMAX == 7)
    scale = absmax * (RECIPROCAL_QMAX_8 if QMAX == 127 else RECIPROCAL_QMAX_4)
    usable = (~bad) & (scale >= FLT_MIN_NORMAL)
    scale = tl.where(bad, float("nan"), scale)
    inv = tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), tl.where(usable, scale, 1.0))[:, None]
    ok = usable[:, None]
    ye = xe * inv
    yo = xo * inv
    if STOCHASTIC:
        ue, uo = uniform_pairs(seed, counter0, G, HALF)
        if QMAX <= 7:  # no clamp needed (above)
            ye = tl.floor(ye + ue)
            yo = tl.floor(yo + uo)
        else:  # y + u may round up to QMAX + 1 or, at -QMAX * (1 + 3 * 2**-24), down past -QMAX
            ye = tl.minimum(tl.maximum(tl.floor(ye + ue), -QMAX), QMAX)
            yo = tl.minimum(tl.maximum(tl.floor(yo + uo), -QMAX), QMAX)
    ye = tl.where(ok, ye, 0.0) + ROUND_MAGIC
    yo = tl.where(ok, yo, 0.0) + ROUND_MAGIC
    return ye.to(tl.int32, bitcast=True), yo.to(tl.int32, bitcast=True), scale


@triton.jit
def store_codes(out_ptr, scale_ptr, ye, yo, scale, e, blk, t, so, nb4, BITS: tl.constexpr, MASKED: tl.constexpr,
                BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Writes a tile's codes into a wire row (payload at byte 0, padded to ``so``) and its scales."""
    if BITS == 8:
        q = join_pairs(ye, yo, G, HALF).to(tl.int8)  # the low byte of each code word
        if MASKED:  # payload
            tl.store(out_ptr + e, q, mask=(t[None, :] < BS) & (e < so))  # payload
        elif BS == 2 * HALF:  # payload
            tl.store(out_ptr + e, q)  # payload
        else:  # payload
            tl.store(out_ptr + e, q, mask=t[None, :] < BS)  # payload
    else:
        j = tl.arange(0, HALF)
        eb = blk[:, None] * (BS // 2) + j[None, :]
        packed = ((ye & 0xF) | (yo << 4)).to(tl.int8)
        if MASKED:  # payload
            tl.store(out_ptr + eb, packed, mask=(j[None, :] < BS // 2) & (eb < so))  # payload
        elif BS == 2 * HALF:  # payload
            tl.store(out_ptr + eb, packed)  # payload
        else:  # payload
            tl.store(out_ptr + eb, packed, mask=j[None, :] < BS // 2)  # payload
    if MASKED:
        tl.store(scale_ptr + blk, scale, mask=blk < nb4)  # blocks past n hold only zeros: scale 0, the padding
    else:
        tl.store(scale_ptr + blk, scale)


@triton.jit
def _interleave4(a, b, c, d, G: tl.constexpr, HALF: tl.constexpr):
    """``[G, HALF // 4]`` x 4 -> ``[G, HALF]``: element ``4 * i + k`` from the k-th argument's ``i``."""
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (G, HALF))


@triton.jit
def int4_word_pairs(w, nib, G: tl.constexpr, HALF: tl.constexpr):
    """INT4 codes packed in int32 words ``[G, HALF // 4]`` (little-endian: codes 0..7 of a word from bit 0 up) ->
    fp32 even / odd codes ``[G, HALF]``, exactly.

    No int -> float conversion (a quarter-rate instruction on the GPU, one per code): XOR with ``0x88888888`` turns
    every two's-complement nibble ``q`` into ``q + 8``; a nibble OR ``0x4B000000`` is the float ``2**23 + q + 8``, and
    subtracting ``2**23 + 8`` leaves ``q`` (both lie in [2**23, 2**24): the difference is exact). ``nib`` is
    :data:`~._launch.INT4_DECODE` (``0x4B00000F``), a kernel argument: ``(y & nib) | (nib & -16)`` is then one
    three-register logic instruction per code, where constant operands make ptxas split it into a bit-field extract
    and an OR (three instructions). Per code: a shift, one logic instruction and one add.

    Used where it is measured shorter (sm_90, instructions per element on a full tile): sums of 3 or more rows (4
    rows: 27.7 -> 25.1 uniform, 29.1 -> 26.6 parameter-aligned; 8 uniform rows: 52.9 -> 50.6). Not for 1 or 2 rows,
    where the byte decode is as short or shorter (plain INT4 -> bf16: 7.2 against 7.8), nor for 8 parameter-aligned
    rows, whose decoded words need 167 registers instead of 96 and make ptxas reload ``nib`` ~150 times (56.4 against
    53.5). The count does not weigh the byte decode's int -> float conversions, one per code at a quarter of the
    issue rate."""
    x = w ^ -2004318072  # 0x88888888 as an int32
    exponent = nib & -16  # 0x4B000000
    ce = _interleave4(x, x >> 8, x >> 16, x >> 24, G, HALF)
    co = _interleave4(x >> 4, x >> 12, x >> 20, x >> 28, G, HALF)
    qe = ((ce & nib) | exponent).to(tl.float32, bitcast=True) - INT4_MAGIC
    qo = ((co & nib) | exponent).to(tl.float32, bitcast=True) - INT4_MAGIC
    return qe, qo


@triton.jit
def load_dequantized(buf_ptr, scale_ptr, e, blk, t, n, so, nb4, nib, WORDS: tl.constexpr, BITS: tl.constexpr,
                     MASKED: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Reads a tile of a wire row back to fp32 pairs ``q * scale``; elements past ``n`` come back as 0. ``WORDS``:
    INT4 codes read as 32-bit words (:func:`int4_word_pairs`)."""
    if BITS == 8:
        if MASKED:  # payload
            q = tl.load(buf_ptr + e, mask=(t[None, :] < BS) & (e < so), other=0)  # payload
        elif BS == 2 * HALF:  # payload
            q = tl.load(buf_ptr + e)  # payload
        else:  # payload
            q = tl.load(buf_ptr + e, mask=t[None, :] < BS, other=0)  # payload
        qe, qo = split_pairs(q.to(tl.float32), G, HALF)
    elif WORDS and BS % 8 == 0:  # whole words per block: eight codes per 32-bit load (``int4_word_pairs``)
        j = tl.arange(0, HALF // 4)
        ew = blk[:, None] * (BS // 8) + j[None, :]
        words = buf_ptr.to(tl.pointer_type(tl.int32))  # a wire row starts 16-byte aligned
        if MASKED:  # payload
            w = tl.load(words + ew, mask=(j[None, :] < BS // 8) & (ew < so // 4), other=0)  # payload
        elif BS == 2 * HALF:  # payload
            w = tl.load(words + ew)  # payload
        else:  # payload
            w = tl.load(words + ew, mask=j[None, :] < BS // 8, other=0)  # payload
        qe, qo = int4_word_pairs(w, nib, G, HALF)
    else:
        j = tl.arange(0, HALF)
        eb = blk[:, None] * (BS // 2) + j[None, :]
        if MASKED:  # payload
            byte = tl.load(buf_ptr + eb, mask=(j[None, :] < BS // 2) & (eb < so), other=0)  # payload
        elif BS == 2 * HALF:  # payload
            byte = tl.load(buf_ptr + eb)  # payload
        else:  # payload
            byte = tl.load(buf_ptr + eb, mask=j[None, :] < BS // 2, other=0)  # payload
        byte = byte.to(tl.int32)  # sign-extends the int8: arithmetic shifts then sign-extend each nibble
        qe = ((byte << 28) >> 28).to(tl.float32)
        qo = (byte >> 4).to(tl.float32)
    if MASKED:
        scale = tl.load(scale_ptr + blk, mask=blk < nb4, other=0.0)[:, None]
        ve = qe * scale
        vo = qo * scale
        me, mo = split_pairs(e < n, G, HALF)  # the payload's padding is not data, whatever a sender put there
        ve = tl.where(me, ve, 0.0)
        vo = tl.where(mo, vo, 0.0)
    else:
        scale = tl.load(scale_ptr + blk)[:, None]
        ve = qe * scale
        vo = qo * scale
    return ve, vo


@triton.jit
def sum_dequantized(buf_ptr, scale_ptr, row0, row_step, wire, e, blk, t, n, so, nb4, nib, ROWS: tl.constexpr,
                    BITS: tl.constexpr, MASKED: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
                    HALF: tl.constexpr):  # fmt: skip
    """The fp32 sum of wire rows ``row0 + i * row_step`` (i < ROWS), in index order like the twins' running sum.

    ROWS is a compile-time constant so the loop unrolls and the loads of all rows are in flight at once.
    """
    words: tl.constexpr = ROWS >= 3  # see int4_word_pairs
    payload, scales = wire_row(buf_ptr, scale_ptr, row0, wire, so)
    acc_e, acc_o = load_dequantized(payload, scales, e, blk, t, n, so, nb4, nib, words, BITS, MASKED, BS, G, HALF)
    for i in tl.static_range(1, ROWS):
        payload, scales = wire_row(buf_ptr, scale_ptr, row0 + i * row_step, wire, so)
        ve, vo = load_dequantized(payload, scales, e, blk, t, n, so, nb4, nib, words, BITS, MASKED, BS, G, HALF)
        acc_e += ve
        acc_o += vo
    return acc_e, acc_o


@triton.jit
def quantize_to_row(out_ptr, scale_ptr, row, pid, wire, so, nb4, xe, xo, seed, e, blk, t, BITS: tl.constexpr,
                    QMAX: tl.constexpr, STOCHASTIC: tl.constexpr, MASKED: tl.constexpr, BS: tl.constexpr,
                    G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Quantizes tile ``pid``'s fp32 pairs into wire row ``row`` (codes, scales and their padding).

    The rounding noise's Philox counters are numbered by (row, tile), so no two tiles of a launch share any.
    """
    counter0 = (row * tl.num_programs(0) + pid) * (G * HALF // 4)
    ye, yo, scale = quantize_pairs(xe, xo, seed, counter0, QMAX, STOCHASTIC, G, HALF)
    payload, scales = wire_row(out_ptr, scale_ptr, row, wire, so)
    store_codes(payload, scales, ye, yo, scale, e, blk, t, so, nb4, BITS, MASKED, BS, G, HALF)
    return ye, yo, scale


@triton.jit
def _output_values(out_ptr, v, BF16_BY_HAND: tl.constexpr):
    """fp32 values in ``out_ptr``'s dtype (see :func:`store_values` for ``BF16_BY_HAND``)."""
    if BF16_BY_HAND:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)  # any NaN -> the canonical bf16 NaN, as torch
        v = rounded.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        v = v.to(out_ptr.dtype.element_ty)
    return v


@triton.jit
def store_values(out_ptr, e, t, n, ve, vo, MASKED: tl.constexpr, BF16_BY_HAND: tl.constexpr, BS: tl.constexpr,
                 G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Stores fp32 pairs contiguously in ``out_ptr``'s dtype.

    ``BF16_BY_HAND`` (only under the interpreter, which truncates fp32 -> bf16 where the GPU and torch round):
    round to nearest even with integer arithmetic into the int16 view of the output, so all three agree.
    """
    v = _output_values(out_ptr, join_pairs(ve, vo, G, HALF), BF16_BY_HAND)
    if MASKED:
        tl.store(out_ptr + e, v, mask=(t[None, :] < BS) & (e < n))
    elif BS == 2 * HALF:
        tl.store(out_ptr + e, v)
    else:
        tl.store(out_ptr + e, v, mask=t[None, :] < BS)


# ------------------------------------------------------------------------------------------------------------------
# Error feedback: ``v = x + decay * residual`` is quantized, and ``residual`` becomes ``v - q * scale``, stored in the
# residual's width (``FEEDBACK``: 32 fp32, 16 bf16, 8 INT8 codes with a scale per block; 0: no feedback). The
# decayed residual is ``decay * r`` for fp32 and bf16, and ``q * (scale * decay)`` for INT8 codes (the decay folded
# into the block's scale: one multiply per element, not two; the twins round the same way).


@triton.jit
def with_feedback(xe, xo, re, ro):
    """The values to quantize: ``x`` plus the decayed residual (:func:`load_residual`; rounded, then the sum: no FMA
    contraction)."""
    return xe + re, xo + ro


@triton.jit
def lost_pairs(ve, vo, ye, yo, scale):
    """What quantizing ``v`` lost: ``v - q * scale``, the exact value the receiver dequantizes subtracted.

    ``ye``/``yo`` are :func:`quantize_pairs`' code words (the float ``1.5 * 2**23 + q``, bitcast): subtracting the
    magic number from the float gives the code exactly."""
    s = scale[:, None]
    qe = ye.to(tl.float32, bitcast=True) - ROUND_MAGIC
    qo = yo.to(tl.float32, bitcast=True) - ROUND_MAGIC
    return ve - qe * s, vo - qo * s


@triton.jit
def _bf16_bits_to_f32(b):
    """bf16 bits (an int16 load) as fp32: exact, the bits placed at the top of a float."""
    return (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def load_residual(res_ptr, rscale_ptr, row, e, blk, t, n, rs, decay, WIDTH: tl.constexpr, MASKED: tl.constexpr,
                  BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """A tile of residual row ``row`` (rows ``rs`` elements apart) times ``decay``, as fp32 pairs, 0 past ``n``.
    ``WIDTH`` 32: fp32; 16: bf16 (an int16 view: the interpreter and the GPU then convert alike); 8: INT8 codes (a
    masked tile reads the row's padding too, in vectors) times their block's scale times ``decay`` (a row of scales
    per row of codes)."""
    res_ptr += row * rs
    if WIDTH == 32:
        ve, vo = load_pairs(res_ptr, e, t, n, MASKED, BS, G, HALF)
        ve, vo = ve * decay, vo * decay
    elif WIDTH == 16:
        if MASKED:
            b = tl.load(res_ptr + e, mask=(t[None, :] < BS) & (e < n), other=0)
        elif BS == 2 * HALF:
            b = tl.load(res_ptr + e)
        else:
            b = tl.load(res_ptr + e, mask=t[None, :] < BS, other=0)
        ve, vo = split_pairs(_bf16_bits_to_f32(b) * decay, G, HALF)
    else:
        nb = (n + BS - 1) // BS
        rscale_ptr += row * nb
        if MASKED:
            q = tl.load(res_ptr + e, mask=(t[None, :] < BS) & (e < rs), other=0)
            scale = tl.load(rscale_ptr + blk, mask=blk < nb, other=0.0) * decay
            v = tl.where(e < n, q.to(tl.float32) * scale[:, None], 0.0)  # the row's padding is not data
        else:
            if BS == 2 * HALF:
                q = tl.load(res_ptr + e)
            else:
                q = tl.load(res_ptr + e, mask=t[None, :] < BS, other=0)
            v = q.to(tl.float32) * (tl.load(rscale_ptr + blk) * decay)[:, None]
        ve, vo = split_pairs(v, G, HALF)  # the decay is in the scale
    return ve, vo


@triton.jit
def store_residual(res_ptr, rscale_ptr, row, e, blk, t, n, rs, le, lo, WIDTH: tl.constexpr, MASKED: tl.constexpr,
                   BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Stores what a quantization lost (fp32 pairs) into a residual row of ``WIDTH`` (see :func:`load_residual`): as
    it is, rounded to nearest even bf16, or quantized again to INT8 codes and one scale per block (the wire's code:
    ``max|lost| / 127``, half to even; a masked tile also writes the row's padding, zeros)."""
    res_ptr += row * rs
    if WIDTH == 32:
        store_values(res_ptr, e, t, n, le, lo, MASKED, False, BS, G, HALF)
    elif WIDTH == 16:
        store_values(res_ptr, e, t, n, le, lo, MASKED, True, BS, G, HALF)
    else:
        nb = (n + BS - 1) // BS
        rscale_ptr += row * nb
        ye, yo, scale = quantize_pairs(le, lo, 0, 0, 127, False, G, HALF)
        q = join_pairs(ye, yo, G, HALF).to(tl.int8)
        if MASKED:
            tl.store(res_ptr + e, q, mask=(t[None, :] < BS) & (e < rs))
            tl.store(rscale_ptr + blk, scale, mask=blk < nb)
        else:
            if BS == 2 * HALF:
                tl.store(res_ptr + e, q)
            else:
                tl.store(res_ptr + e, q, mask=t[None, :] < BS)
            tl.store(rscale_ptr + blk, scale)


# ------------------------------------------------------------------------------------------------------------------
# Parameter-aligned blocks (layout.Blocks). A device table (``_launch.block_table``) holds ``nblk + 1`` rows of four:
# a block's first element and its first payload bytes at 8 and at 4 bits (the last row: the row's ends), and in the
# fourth column the order in which the programs take the blocks (entry ``i`` of the order in row ``i``). A block's
# entries share one address (``table + 4 * blk``) and differ by an immediate offset. Each of a tile's G blocks is one
# row of the ``[G, 2 * HALF]`` tile, at its own start: element ``t`` of block ``b`` is row element ``starts[b] + t``.
#
# ``MODE`` says what the compiler may assume about a tile's blocks:
#   2  vector: G consecutive whole blocks of BS elements (a run inside one segment, or across segments without a
#      tail), the first starting at a multiple of 16 elements, in a padded layout (``Blocks.padded``: a whole block's
#      payload is BS or BS / 2 bytes, so the run's payload is contiguous too). Everything is then affine in the run's
#      first block, as in the uniform kernels: ``blk`` is that block's id (a scalar) and one load per column gives
#      the run's element and payload offsets; no per-block table loads. No masks (for a power-of-two BS): every load
#      and store moves 16 bytes. The table's order lists these runs first, G blocks each, so programs ``pid < nvt``
#      take only them. A padded layout's tiles are the uniform kernels' (16 payload bytes per thread need that many
#      elements).
#   1  padded edge: any blocks of a padded layout (a segment's tail, a block at an odd start), a quarter of a tile at
#      a time (each masked element needs its own address; a whole tile would spill). Element accesses are masked by
#      the block's length; payload accesses by its padded length (a multiple of 16 bytes): they move what a quarter
#      tile gives a thread (8 bytes of INT8, 4 of INT4), and the store writes the block's zero padding.
# The PTX's line info cannot tell a vector tile's payload access from a masked tile's (a masked load's may point at a
# neighbouring line), so the compile gate checks the widths per kernel: the widest is 16 bytes, the narrowest 4.
#   0  packed: blocks of a layout that is not padded (``block_size`` not a multiple of 32); everything masked.


@triton.jit
def aligned_index(table_ptr, nblk, base, MODE: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):
    """The block ids ``[G]`` of the tile at ``base`` in the table's order (MODE 2: the first of the run, a scalar),
    which exist ``[G]``, their lengths ``[G]``, element offsets ``[G, 2 * HALF]`` within the row, and which of those
    are the blocks' elements."""
    i = base + tl.arange(0, G)
    valid = i < nblk
    t = tl.arange(0, 2 * HALF)
    if MODE == 2:
        blk = tl.load(table_ptr + 4 * base + 3)
        first = tl.multiple_of(tl.load(table_ptr + 4 * blk), 16) + tl.arange(0, G) * BS
        length = tl.zeros_like(first) + BS
    else:
        blk = tl.load(table_ptr + 4 * i + 3, mask=valid, other=0)
        first = tl.load(table_ptr + 4 * blk, mask=valid, other=0)
        length = tl.load(table_ptr + 4 * blk + 4, mask=valid, other=0) - first
    return blk, valid, length, first[:, None] + t[None, :], t[None, :] < length[:, None]


@triton.jit
def _load_elements(ptr, e, inside, MODE: tl.constexpr, BS: tl.constexpr, HALF: tl.constexpr):
    """A tile's elements (0 outside its blocks); a vector tile of power-of-two blocks is not masked at all."""
    if MODE == 2 and BS == 2 * HALF:  # elements
        v = tl.load(ptr + e)  # elements
    elif MODE == 2:  # elements
        v = tl.load(ptr + e, mask=tl.arange(0, 2 * HALF)[None, :] < BS, other=0)  # elements
    else:  # elements
        v = tl.load(ptr + e, mask=inside, other=0)  # elements
    return v


@triton.jit
def _store_elements(ptr, e, inside, v, MODE: tl.constexpr, BS: tl.constexpr, HALF: tl.constexpr):
    if MODE == 2 and BS == 2 * HALF:  # elements
        tl.store(ptr + e, v)  # elements
    elif MODE == 2:  # elements
        tl.store(ptr + e, v, mask=tl.arange(0, 2 * HALF)[None, :] < BS)  # elements
    else:  # elements
        tl.store(ptr + e, v, mask=inside)  # elements


@triton.jit
def _block_scales(scale_ptr, blk, valid, MODE: tl.constexpr):
    """The fp32 scales of a tile's blocks (0 for blocks past the row's last)."""
    if MODE == 2:  # a run: consecutive scales
        s = tl.load(scale_ptr + blk + tl.arange(0, valid.shape[0]))
    else:
        s = tl.load(scale_ptr + blk, mask=valid, other=0.0)
    return s


@triton.jit
def _store_block_scales(scale_ptr, blk, valid, scale, MODE: tl.constexpr):
    if MODE == 2:
        tl.store(scale_ptr + blk + tl.arange(0, valid.shape[0]), scale)
    else:
        tl.store(scale_ptr + blk, scale, mask=valid)


@triton.jit
def load_pairs_aligned(ptr, e, inside, MODE: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                       STRIDED: tl.constexpr = False):  # fmt: skip
    """A tile of aligned blocks of a float input as fp32 even / odd pairs (elements past a block's end are 0).

    ``STRIDED`` (vector tiles of power-of-two blocks): the even and the odd elements as two loads of every other
    element, each in the layout of the pairs' consumer, where one contiguous load is split in registers otherwise. A
    contiguous load moves 16 bytes per thread, but Triton lays it out by its own vector width, and where the tile's
    other accesses want a different layout (INT4 codes: 16 pairs per thread) it converts the whole tile through
    shared memory, which costs more than the element-wide loads the strided form makes (see :func:`_quantize_kernel
    <lightning_zeropp.kernels.quantize_kernel>`'s choice, measured in SASS)."""
    if STRIDED and MODE == 2 and BS == 2 * HALF:
        ee, eo = split_pairs(e, G, HALF)
        return tl.load(ptr + ee).to(tl.float32), tl.load(ptr + eo).to(tl.float32)
    return split_pairs(_load_elements(ptr, e, inside, MODE, BS, HALF).to(tl.float32), G, HALF)


@triton.jit
def _payload(table_ptr, nblk, blk, valid, length, BITS: tl.constexpr, MODE: tl.constexpr, BS: tl.constexpr,
             HALF: tl.constexpr, WORDS: tl.constexpr = False):  # fmt: skip
    """Byte offsets ``[G, W]`` of a tile's payload in a wire row of ``BITS`` (W = 2 * HALF at 8 bits, HALF at 4) and
    how many bytes of each block to move ``[G]``: its codes, or (padded layout) its codes and their padding.
    ``WORDS`` (padded layout, 4 bits): the same in 32-bit words, ``[G, HALF // 4]``."""
    column = table_ptr + (3 - BITS // 4)  # 8 bits: the second column, 4 bits: the third
    if MODE == 2:  # a run: whole blocks back to back, BS or BS / 2 bytes each
        byte0 = tl.multiple_of(tl.load(column + 4 * blk), 16) + tl.arange(0, valid.shape[0]) * (BS * BITS // 8)
    else:
        byte0 = tl.load(column + 4 * blk, mask=valid, other=0)
        if MODE == 1:
            byte0 = tl.multiple_of(byte0, 16)
    if BITS == 8:
        used = length
        lane = tl.arange(0, 2 * HALF)
    elif WORDS:
        used = (length + 1) >> 1
        lane = tl.arange(0, HALF // 4)
    else:
        used = (length + 1) >> 1
        lane = tl.arange(0, HALF)
    if MODE == 1:
        used = tl.multiple_of((used + 15) & -16, 16)
    if WORDS:
        byte0 = tl.multiple_of(byte0 >> 2, 4)  # offsets and lengths are not negative: a shift divides
        used = used >> 2
    return byte0[:, None] + lane[None, :], used


@triton.jit
def _store_payload(ptr, p, used, v, MODE: tl.constexpr, FULL: tl.constexpr, W: tl.constexpr):
    """Stores a tile's payload bytes ``v`` at ``p`` (``used`` per block; FULL bytes per whole block, W lanes)."""
    if MODE == 2 and FULL == W:  # payload
        tl.store(ptr + p, v)  # payload
    elif MODE == 2:  # payload
        tl.store(ptr + p, v, mask=tl.arange(0, W)[None, :] < FULL)  # payload
    else:  # payload
        tl.store(ptr + p, v, mask=tl.arange(0, W)[None, :] < used[:, None])  # payload


@triton.jit
def _load_payload(ptr, p, used, MODE: tl.constexpr, FULL: tl.constexpr, W: tl.constexpr):
    if MODE == 2 and FULL == W:  # payload
        v = tl.load(ptr + p)  # payload
    elif MODE == 2:  # payload
        v = tl.load(ptr + p, mask=tl.arange(0, W)[None, :] < FULL, other=0)  # payload
    else:  # payload
        v = tl.load(ptr + p, mask=tl.arange(0, W)[None, :] < used[:, None], other=0)  # payload
    return v  # payload (the line info of a masked load may point past it)


@triton.jit
def store_codes_aligned(out_ptr, scale_ptr, table_ptr, nblk, ye, yo, scale, blk, valid, length, BITS: tl.constexpr,
                        MODE: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Writes a tile's codes of aligned blocks into a wire row and its scales. Lanes past a block's end hold the codes
    of masked (zero) elements, 0: an odd block's last high nibble, and a padded block's padding."""
    p, used = _payload(table_ptr, nblk, blk, valid, length, BITS, MODE, BS, HALF)
    if BITS == 8:
        _store_payload(out_ptr, p, used, join_pairs(ye, yo, G, HALF).to(tl.int8), MODE, BS, 2 * HALF)
    else:
        _store_payload(out_ptr, p, used, ((ye & 0xF) | (yo << 4)).to(tl.int8), MODE, BS // 2, HALF)
    _store_block_scales(scale_ptr, blk, valid, scale, MODE)


@triton.jit
def store_padding_aligned(out_ptr, scale_ptr, table_ptr, nblk, so, BITS: tl.constexpr, MODE: tl.constexpr):
    """Zeros in a wire row of aligned blocks where no block writes: after the payload up to ``so`` (fewer than 16
    bytes; none in a padded layout, whose blocks write their own padding) and after the last scale up to a multiple
    of 4 scales."""
    if MODE == 0:
        pb = tl.load(table_ptr + 4 * nblk + (3 - BITS // 4))
        i = tl.arange(0, 16)
        tl.store(out_ptr + pb + i, tl.zeros([16], tl.int8), mask=pb + i < so)
    slot = nblk + tl.arange(0, 4)
    tl.store(scale_ptr + slot, tl.zeros([4], tl.float32), mask=slot < (nblk + 3 & -4))


@triton.jit
def quantize_to_row_aligned(out_ptr, scale_ptr, table_ptr, nblk, row, base, edge0, wire, so, xe, xo, seed, blk, valid,
                            length, BITS: tl.constexpr, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr,
                            MODE: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """:func:`quantize_to_row` for the aligned blocks of the tile at ``base`` in the table's order. The row's first
    masked tile (at ``edge0``; the launch always has one) also writes the row's padding, so vector tiles have no
    branch for it. The rounding noise's counters are numbered by (row, block slot in the order)."""
    counter0 = (row * (nblk + G) + base) * HALF // 4
    ye, yo, scale = quantize_pairs(xe, xo, seed, counter0, QMAX, STOCHASTIC, G, HALF)
    payload, scales = wire_row_bytes(out_ptr, row, wire, so)
    store_codes_aligned(payload, scales, table_ptr, nblk, ye, yo, scale, blk, valid, length, BITS, MODE, BS, G, HALF)
    if MODE != 2:
        if base == edge0:
            store_padding_aligned(payload, scales, table_ptr, nblk, so, BITS, MODE)
    return ye, yo, scale


@triton.jit
def load_dequantized_aligned(buf_ptr, scale_ptr, table_ptr, nblk, blk, valid, length, nib, BITS: tl.constexpr,
                             MODE: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                             WORDS: tl.constexpr):  # fmt: skip
    """Reads a tile of aligned blocks of a wire row back to fp32 pairs ``q * scale`` (lanes past a block's end: code
    0 or the padding's zeros). ``WORDS``: INT4 codes of a padded layout read as 32-bit words (``int4_word_pairs``)."""
    if BITS == 8:
        p, used = _payload(table_ptr, nblk, blk, valid, length, BITS, MODE, BS, HALF)
        q = _load_payload(buf_ptr, p, used, MODE, BS, 2 * HALF)
        qe, qo = split_pairs(q.to(tl.float32), G, HALF)
    elif WORDS and MODE != 0 and BS % 8 == 0:  # padded: each block's payload starts 16-byte aligned, whole words
        p, used = _payload(table_ptr, nblk, blk, valid, length, BITS, MODE, BS, HALF, True)
        w = _load_payload(buf_ptr.to(tl.pointer_type(tl.int32)), p, used, MODE, BS // 8, HALF // 4)
        qe, qo = int4_word_pairs(w, nib, G, HALF)
    else:
        p, used = _payload(table_ptr, nblk, blk, valid, length, BITS, MODE, BS, HALF)
        byte = _load_payload(buf_ptr, p, used, MODE, BS // 2, HALF).to(tl.int32)
        qe = ((byte << 28) >> 28).to(tl.float32)
        qo = (byte >> 4).to(tl.float32)
    scale = _block_scales(scale_ptr, blk, valid, MODE)[:, None]
    return qe * scale, qo * scale


@triton.jit
def sum_dequantized_aligned(buf_ptr, scale_ptr, table_ptr, nblk, row0, row_step, wire, so, blk, valid, length, nib,
                            ROWS: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, BS: tl.constexpr,
                            G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """:func:`sum_dequantized` for aligned blocks (INT4 words for 3 or 4 rows: see :func:`int4_word_pairs`)."""
    words: tl.constexpr = 3 <= ROWS and ROWS <= 4
    payload, scales = wire_row_bytes(buf_ptr, row0, wire, so)
    acc_e, acc_o = load_dequantized_aligned(payload, scales, table_ptr, nblk, blk, valid, length, nib, BITS, MODE, BS,
                                            G, HALF, words)  # fmt: skip
    for i in tl.static_range(1, ROWS):
        payload, scales = wire_row_bytes(buf_ptr, row0 + i * row_step, wire, so)
        ve, vo = load_dequantized_aligned(payload, scales, table_ptr, nblk, blk, valid, length, nib, BITS, MODE, BS,
                                          G, HALF, words)  # fmt: skip
        acc_e += ve
        acc_o += vo
    return acc_e, acc_o


@triton.jit
def store_values_aligned(out_ptr, e, inside, ve, vo, BF16_BY_HAND: tl.constexpr, MODE: tl.constexpr,
                         BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """:func:`store_values` for a tile of aligned blocks."""
    v = _output_values(out_ptr, join_pairs(ve, vo, G, HALF), BF16_BY_HAND)
    _store_elements(out_ptr, e, inside, v, MODE, BS, HALF)


@triton.jit
def load_residual_aligned(res_ptr, rscale_ptr, row, rs, nblk, blk, valid, e, inside, decay, WIDTH: tl.constexpr,
                          MODE: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """:func:`load_residual` for a tile of aligned blocks (``nblk`` per row; elements past a block's end are 0)."""
    res_ptr += row * rs
    if WIDTH == 32:
        v = _load_elements(res_ptr, e, inside, MODE, BS, HALF) * decay
    elif WIDTH == 16:
        v = _bf16_bits_to_f32(_load_elements(res_ptr, e, inside, MODE, BS, HALF)) * decay
    else:
        q = _load_elements(res_ptr, e, inside, MODE, BS, HALF)
        v = q.to(tl.float32) * (_block_scales(rscale_ptr + row * nblk, blk, valid, MODE) * decay)[:, None]
        if MODE != 2 or BS != 2 * HALF:
            v = tl.where(inside, v, 0.0)  # a scale of NaN must not reach the lanes past a block's end
    return split_pairs(v, G, HALF)


@triton.jit
def store_residual_aligned(res_ptr, rscale_ptr, row, rs, nblk, blk, valid, e, inside, le, lo, WIDTH: tl.constexpr,
                           MODE: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """:func:`store_residual` for a tile of aligned blocks."""
    res_ptr += row * rs
    if WIDTH == 8:
        ye, yo, scale = quantize_pairs(le, lo, 0, 0, 127, False, G, HALF)
        _store_elements(res_ptr, e, inside, join_pairs(ye, yo, G, HALF).to(tl.int8), MODE, BS, HALF)
        _store_block_scales(rscale_ptr + row * nblk, blk, valid, scale, MODE)
    else:
        store_values_aligned(res_ptr, e, inside, le, lo, WIDTH == 16, MODE, BS, G, HALF)
