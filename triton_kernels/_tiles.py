"""Triton building blocks shared by the kernels: one tile = G quantization blocks, each seen as two vectors.

A tile is loaded and stored contiguously (``[G, 2 * HALF]``, HALF = the next power of two >= ceil(bs / 2)) and
split in registers into its even- and odd-indexed elements, ``[G, HALF]`` each. That is the INT4 byte layout
(element 2i in the low nibble, 2i+1 in the high nibble of one byte), so one kernel can read one bit width and write
another without reshuffling memory. The arithmetic is the torch twins', operation for operation, so results match
bit for bit:

- ``scale = absmax / qmax`` and ``x / scale`` are IEEE divisions (``div_rn``), never approximate reciprocals;
- round half to even is ``(y + 1.5 * 2**23) - 1.5 * 2**23`` (exact for |y| < 2**22; here |y| <= 127);
- ``tl.max`` skips NaN, so NaN is detected on its own: a block with NaN or Inf gets scale NaN and q = 0.
"""

import triton
import triton.language as tl

_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23
_FLT_MAX = 3.4028234663852886e38


@triton.jit
def tile_offsets(pid, bs, n, nb, G: tl.constexpr, HALF: tl.constexpr):
    """Contiguous element offsets ``[G, 2 * HALF]`` of program ``pid``'s G blocks, their mask, block ids, block mask."""
    blk = pid.to(tl.int64) * G + tl.arange(0, G)
    t = tl.arange(0, 2 * HALF)
    e = blk[:, None] * bs + t[None, :]
    blk_ok = blk < nb
    m = blk_ok[:, None] & (t[None, :] < bs) & (e < n)
    return e, m, blk, blk_ok


@triton.jit
def split_pairs(v, G: tl.constexpr, HALF: tl.constexpr):
    """``[G, 2 * HALF]`` -> even and odd elements, ``[G, HALF]`` each."""
    return tl.split(tl.reshape(v, (G, HALF, 2)))


@triton.jit
def join_pairs(ve, vo, G: tl.constexpr, HALF: tl.constexpr):
    return tl.reshape(tl.join(ve, vo), (G, 2 * HALF))


@triton.jit
def _int4_bytes(blk, blk_ok, bs, n, HALF: tl.constexpr):
    """Byte offsets ``[G, HALF]`` of the INT4 payload of the blocks (bs is even), the pair masks (even, odd)."""
    j = tl.arange(0, HALF)
    eb = blk[:, None] * (bs // 2) + j[None, :]
    m_even = blk_ok[:, None] & (2 * j[None, :] < bs) & (2 * eb < n)
    return eb, m_even, m_even & (2 * eb + 1 < n)


@triton.jit
def quantize_tile(xe, xo, ue, uo, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """fp32 pairs (masked elements 0) -> int32 codes in [-QMAX, QMAX] and the fp32 scale of each block."""
    absmax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    has_nan = tl.sum(((xe != xe) | (xo != xo)).to(tl.int32), axis=1) > 0
    bad = has_nan | (absmax > _FLT_MAX)
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))
    usable = (~bad) & (scale > 0.0)
    scale = tl.where(bad, float("nan"), scale)
    denom = tl.where(usable, scale, 1.0)[:, None]
    ye = tl.math.div_rn(xe, tl.broadcast_to(denom, xe.shape))
    yo = tl.math.div_rn(xo, tl.broadcast_to(denom, xo.shape))
    if STOCHASTIC:
        ye = tl.floor(ye + ue)
        yo = tl.floor(yo + uo)
    else:
        ye = (ye + _ROUND_MAGIC) - _ROUND_MAGIC
        yo = (yo + _ROUND_MAGIC) - _ROUND_MAGIC
    ye = tl.minimum(tl.maximum(ye, -QMAX), QMAX)
    yo = tl.minimum(tl.maximum(yo, -QMAX), QMAX)
    qe = tl.where(usable[:, None], ye, 0.0).to(tl.int32)
    qo = tl.where(usable[:, None], yo, 0.0).to(tl.int32)
    return qe, qo, scale


@triton.jit
def store_tile(out_ptr, scale_ptr, row_bytes, row_scales, e, m, blk, blk_ok, bs, n, qe, qo, scale,
               BITS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Writes a tile's codes into a wire row (payload at byte 0) and its scales (fp32 view of the same row)."""
    if BITS == 8:
        q = join_pairs(qe, qo, G, HALF)
        tl.store(out_ptr + row_bytes + e, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=m)
    else:
        eb, m_even, m_odd = _int4_bytes(blk, blk_ok, bs, n, HALF)
        packed = (qe & 0xF) | ((qo & 0xF) << 4)
        tl.store(out_ptr + row_bytes + eb, packed.to(tl.uint8), mask=m_even)
    tl.store(scale_ptr + row_scales + blk, scale, mask=blk_ok)


@triton.jit
def load_dequantized_tile(buf_ptr, scale_ptr, row_bytes, row_scales, e, m, blk, blk_ok, bs, n,
                          BITS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Reads a tile of a wire row back to fp32 pairs ``q * scale`` (masked elements 0)."""
    if BITS == 8:
        q = tl.load(buf_ptr + row_bytes + e, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        qe, qo = split_pairs(q, G, HALF)
        m_even, m_odd = split_pairs(m, G, HALF)
    else:
        eb, m_even, m_odd = _int4_bytes(blk, blk_ok, bs, n, HALF)
        byte = tl.load(buf_ptr + row_bytes + eb, mask=m_even, other=0).to(tl.int32)
        qe = (((byte & 0xF) ^ 8) - 8).to(tl.float32)
        qo = (((byte >> 4) ^ 8) - 8).to(tl.float32)
    scale = tl.load(scale_ptr + row_scales + blk, mask=blk_ok, other=0.0)[:, None]
    ve = tl.where(m_even, qe * scale, 0.0)
    vo = tl.where(m_odd, qo * scale, 0.0)
    return ve, vo


@triton.jit
def load_pairs(ptr, e, m, G: tl.constexpr, HALF: tl.constexpr):
    """A contiguous tile of a float input as fp32 even / odd pairs (masked elements 0)."""
    return split_pairs(tl.load(ptr + e, mask=m, other=0.0).to(tl.float32), G, HALF)


@triton.jit
def uniform_pairs(seed, offsets, G: tl.constexpr, HALF: tl.constexpr):
    """Counter-based uniform [0, 1) numbers for stochastic rounding, one per element offset."""
    return split_pairs(tl.rand(seed, offsets), G, HALF)


@triton.jit
def store_values(out_ptr, e, m, ve, vo, OUT_BF16: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):
    """Stores fp32 pairs contiguously in ``out_ptr``'s dtype. bf16 is rounded to nearest even with integer
    arithmetic (``out_ptr`` then points at the int16 view of the output): Triton's interpreter truncates fp32 ->
    bf16, the GPU rounds, torch rounds; doing it by hand makes all three agree."""
    v = join_pairs(ve, vo, G, HALF)
    if OUT_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)  # any NaN -> the canonical bf16 NaN, as torch
        tl.store(out_ptr + e, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=m)
    else:
        tl.store(out_ptr + e, v.to(out_ptr.dtype.element_ty), mask=m)
