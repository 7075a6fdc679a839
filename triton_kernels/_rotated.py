"""Triton building blocks of the rotated specializations (``rotation_seed``): every block of a tile lies in the
registers of one thread (or of ``L`` threads), so the Walsh-Hadamard butterflies are register additions; bit-identical
to ``reference._rotate_rows``.

Layout. The plain kernels address a tile as ``[G, 2 * HALF]``: Triton gives a thread 16 bytes of a block and spreads
the block over several threads, and a butterfly between two threads' elements then goes through shared memory
(measured on sm_90: +20 SASS instructions per element for blocks of 128, against 7.5 for the additions themselves).
The rotated tiles address memory as ``[P, G, L, C]``: element ``(p, g, l, c)`` is element ``l * SPAN + p * C + c`` of
block ``g`` (C consecutive elements: one 16-byte access; SPAN = 2 * HALF / L). Triton orders a layout's dimensions by
contiguity, then from the last: C in a thread, lanes along G and L, and the P vectors of a thread in its registers.
Permuted and reshaped (a renaming of registers, no instruction) the tile is the plain kernels' ``[G, 2 * HALF]`` and
its even / odd pairs, so ``_tiles``' quantization serves both; every access the kernel makes (input, payload,
residual, output) uses the same form, with its own C, so no conversion moves the tile.

Butterflies, in ``reference._hadamard``'s order (strides 1, 2, 4, ...; fp32 throughout): stride 1 is an even element
and the next odd one (the pairs); strides below SPAN are within a thread (reshape, split and join of registers);
strides of SPAN and up pair the ``L`` threads of a block (a gather along L: a warp shuffle per element). The
launchers choose the share of a block a thread holds (``_launch.rotation``): 128 elements where the registers allow
(no butterfly crosses threads for blocks up to 128), 64 or 32 where error feedback keeps the unrotated block beside
the rotated one or many rows' loads are in flight; a masked tile goes a part of its blocks at a time, each over more
threads (:func:`masked_lanes`).

Signs. Each element's sign (``reference.rotation_signs``: a 32-bit mix of the seed and the element's place) is the
same for every block: :func:`rotation_table` computes them once per launch into a table of ``2 * block_size`` floats,
the signs and the signs divided by their piece's length (the inverse's factor), which every thread reads (cached
loads) instead of mixing bits for each of its elements. The forward transform folds the signs into its first
butterfly, ``(a * da) +- (b * db)`` as ``fma(b, +-db, a * da)`` (exact products: the twin's roundings); the inverse
multiplies by ``sign / length``, a power of two, once (the twin's ``* sign`` then ``/ length``: the same rounding).

Rounding noise (stochastic rounding): the plain kernels' Philox counters for the same block (:func:`noise_counter`),
so a rotated kernel rounds as the plain kernel rounds the twin's rotation of its input (the tests check that, bit for
bit, the noise being the kernels' own).

Pieces. A block whose length is not a power of two (a parameter's last block, a row's tail, any block when
``block_size`` is not a power of two) is rotated in the power-of-two pieces of its length (``PIECES``): element ``i``
of a block of ``n`` lies in a piece of ``2**k`` elements, ``k`` the highest bit of ``i ^ n``; a butterfly of stride
``2**s`` changes it only where ``i < n`` and ``(i ^ n) >= 2**(s + 1)`` (its partner then lies in the same piece).
"""

import triton
import triton.language as tl

from ._tiles import (
    ROUND_MAGIC,
    join_pairs,
    padded_blocks,
    quantize_pairs,
    split_pairs,
    store_padding_aligned,
    wire_row_bytes,
    with_feedback,
)

# ------------------------------------------------------------------------------------------------------------------
# The sign table


@triton.jit(do_not_specialize=["seed"])  # a new seed per reduction must not recompile
def _rotation_table_kernel(out_ptr, seed, BS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i]`` = the sign of element ``i`` of a block (``reference.rotation_signs``) and ``out[BS + i]`` = that
    sign divided by the length of the piece element ``i`` of a whole block lies in."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < BS
    h = (i.to(tl.int64) * 0x9E3779B1 + seed) & 0xFFFFFFFF  # int64 products wrap: their low 32 bits are the twin's
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    sign = (1 - 2 * (h & 1)).to(tl.float32)
    tl.store(out_ptr + i, sign, mask=inside)
    tl.store(out_ptr + BS + i, sign * inverse_piece(i, BS), mask=inside)


def rotation_table(seed: int, block_size: int, device):
    """The sign table of blocks of ``block_size`` for ``seed`` (see the module docstring), on ``device``."""
    import torch

    from ._launch import LAUNCH_OPTIONS

    out = torch.empty(2 * block_size, dtype=torch.float32, device=device)
    block = min(1024, triton.next_power_of_2(block_size))
    _rotation_table_kernel[(triton.cdiv(block_size, block),)](out, seed & 0xFFFFFFFF, BS=block_size, BLOCK=block,
                                                              **LAUNCH_OPTIONS)  # fmt: skip
    return out


@triton.jit
def inverse_piece(i, n):
    """``1 / 2**k`` for element ``i < n`` of a block of ``n``, ``2**k`` the length of its piece (``k``: the highest bit
    of ``i ^ n``): the exponent of ``float(i ^ n)`` (exact below 2**24) mirrored about 0."""
    bits = ((i ^ n).to(tl.float32).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.int32)
    return (0x7F000000 - bits).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------------------------------------------
# Tiles in the ``[P, G, L, C]`` form


@triton.jit
def _offsets(first, W: tl.constexpr, L: tl.constexpr, C: tl.constexpr):
    """Offsets ``[P, G, L, C]`` of W consecutive places from each ``first[g]``, and the places ``[P, 1, L, C]``."""
    SPAN: tl.constexpr = W // L
    p = tl.arange(0, SPAN // C)[:, None, None, None]
    lane = tl.arange(0, L)[None, None, :, None]
    c = tl.arange(0, C)[None, None, None, :]
    t = lane * SPAN + p * C + c
    return first[None, :, None, None] + t, t


@triton.constexpr_function
def _vector(bits, W, L):
    """Elements of ``bits`` bits in 16 bytes, at most a thread's W / L. (A ``constexpr_function``, as the other
    compile-time helpers here: what a ``jit`` function returns is a tensor, not a constexpr, before Triton 3.7.)"""
    return min(128 // bits, W // L)


@triton.jit
def _to_rows(v, G: tl.constexpr, W: tl.constexpr):
    """``[P, G, L, C]`` -> ``[G, W]`` (registers renamed)."""
    return tl.reshape(tl.permute(v, (1, 2, 0, 3)), (G, W))


@triton.jit
def _from_rows(v, W: tl.constexpr, L: tl.constexpr, C: tl.constexpr):
    """``[G, W]`` -> ``[P, G, L, C]``."""
    return tl.permute(tl.reshape(v, (v.shape[0], L, W // L // C, C)), (2, 0, 1, 3))


@triton.jit
def load_rows(ptr, first, limit, W: tl.constexpr, L: tl.constexpr, MASKED: tl.constexpr):
    """``[G, W]``: W consecutive values from each ``first[g]`` (with ``MASKED``, only places below ``limit[g]``,
    0 elsewhere)."""
    C: tl.constexpr = _vector(ptr.dtype.element_ty.primitive_bitwidth, W, L)
    offs, t = _offsets(first, W, L, C)
    mask = t < limit[None, :, None, None] if MASKED else None
    v = tl.load(ptr + offs, mask=mask, other=0 if MASKED else None)  # elements
    return _to_rows(v, first.shape[0], W)


@triton.jit
def store_rows(ptr, first, limit, v, W: tl.constexpr, L: tl.constexpr, MASKED: tl.constexpr):
    """Stores ``v`` ``[G, W]`` at W consecutive places from each ``first[g]`` (only below ``limit[g]``)."""
    C: tl.constexpr = _vector(ptr.dtype.element_ty.primitive_bitwidth, W, L)
    offs, t = _offsets(first, W, L, C)
    v = _from_rows(v, W, L, C)
    tl.store(ptr + offs, v, mask=t < limit[None, :, None, None] if MASKED else None)  # elements


@triton.jit
def _load_payload(ptr, first, limit, W: tl.constexpr, L: tl.constexpr, MASKED: tl.constexpr):
    """:func:`load_rows` of wire payload bytes (its own lines, which the compile gate reads as the payload's)."""
    C: tl.constexpr = _vector(ptr.dtype.element_ty.primitive_bitwidth, W, L)
    offs, t = _offsets(first, W, L, C)
    mask = t < limit[None, :, None, None] if MASKED else None
    v = tl.load(ptr + offs, mask=mask, other=0 if MASKED else None)  # payload
    return _to_rows(v, first.shape[0], W)


@triton.jit
def _store_payload(ptr, first, limit, v, W: tl.constexpr, L: tl.constexpr, MASKED: tl.constexpr):
    C: tl.constexpr = _vector(ptr.dtype.element_ty.primitive_bitwidth, W, L)
    offs, t = _offsets(first, W, L, C)
    v = _from_rows(v, W, L, C)
    tl.store(ptr + offs, v, mask=t < limit[None, :, None, None] if MASKED else None)  # payload


@triton.jit
def load_pairs_rot(ptr, first, length, L: tl.constexpr, MASKED: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):
    """A tile of a float input as fp32 even / odd pairs ``[G, HALF]`` (places past ``length[g]``: 0)."""
    return split_pairs(load_rows(ptr, first, length, 2 * HALF, L, MASKED).to(tl.float32), G, HALF)


@triton.jit
def signs(table_ptr, G: tl.constexpr, HALF: tl.constexpr, L: tl.constexpr, BS: tl.constexpr, INVERSE: tl.constexpr):
    """The sign table's row (the signs, or ``INVERSE``: the signs over their piece's length) as pairs ``[G, HALF]``,
    the same for every block (places past ``BS``: 0)."""
    first = tl.zeros([G], tl.int32) + (BS if INVERSE else 0)
    return split_pairs(load_rows(table_ptr, first, first * 0 + BS, 2 * HALF, L, BS != 2 * HALF), G, HALF)


# ------------------------------------------------------------------------------------------------------------------
# The transform


@triton.jit
def _pair_stage(x, H: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, L: tl.constexpr):
    """The butterflies of stride H along the pairs' index (``[G, HALF]``): ``(a, b) -> (a + b, a - b)``. Within a
    thread (H below its HALF / L pairs): registers split and joined; across its L threads: the partner gathered from
    the thread it lies in, then ``own * (+1 or -1) + partner`` (one rounding: the product is exact)."""
    if H < HALF // L:
        y = tl.permute(tl.reshape(x, (G, HALF // (2 * H), 2, H)), (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (G, HALF))
    else:
        BIT: tl.constexpr = H // (HALF // L)  # the lane bit this stride crosses
        y = tl.reshape(x, (G, L, HALF // L))
        lane = tl.arange(0, L)[None, :, None]
        partner = tl.gather(y, tl.broadcast_to(lane ^ BIT, y.shape), 1)
        y = tl.reshape(tl.fma(y, tl.where((lane & BIT) == 0, 1.0, -1.0), partner), (G, HALF))
    return y


@triton.jit
def _stages(ye, yo, length, PIECES: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, L: tl.constexpr):
    """The butterflies of strides 2, 4, ... (each a stride of ``H`` pairs), in order; with ``PIECES``, within each
    block's pieces only."""
    for k in tl.static_range(0, 16):
        if (1 << k) < HALF:
            be = _pair_stage(ye, 1 << k, G, HALF, L)
            bo = _pair_stage(yo, 1 << k, G, HALF, L)
            if PIECES:
                ie = 2 * tl.arange(0, HALF)[None, :]
                n = length[:, None]
                ye = tl.where((ie < n) & ((ie ^ n) >= (4 << k)), be, ye)
                yo = tl.where((ie + 1 < n) & (((ie + 1) ^ n) >= (4 << k)), bo, yo)
            else:
                ye, yo = be, bo
    return ye, yo


@triton.jit
def rotate(xe, xo, de, do, length, PIECES: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, L: tl.constexpr):
    """Each block of the pairs times its signs ``de``/``do``, transformed (``reference._rotate_slots``, forward)."""
    t = xe * de
    ye = tl.fma(xo, do, t)
    yo = tl.fma(xo, -do, t)
    if PIECES:  # an element alone in its piece (a block's odd last one) keeps its signed self
        ie = 2 * tl.arange(0, HALF)[None, :]
        n = length[:, None]
        paired = (ie < n) & ((ie ^ n) >= 2)
        ye = tl.where(paired, ye, t)
        yo = tl.where(paired, yo, xo * do)
    return _stages(ye, yo, length, PIECES, G, HALF, L)


@triton.jit
def unrotate(xe, xo, inv_e, inv_o, length, PIECES: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
             L: tl.constexpr):  # fmt: skip
    """The inverse of :func:`rotate`: each block transformed, then times its sign over its piece's length (``inv_e``,
    ``inv_o``: the sign table's second row; with ``PIECES``, the signs, scaled here by each block's pieces)."""
    ye = xe + xo
    yo = xe - xo
    if PIECES:
        ie = 2 * tl.arange(0, HALF)[None, :]
        n = length[:, None]
        paired = (ie < n) & ((ie ^ n) >= 2)
        ye = tl.where(paired, ye, xe)
        yo = tl.where(paired, yo, xo)
        inv_e = inv_e * inverse_piece(ie, n)
        inv_o = inv_o * inverse_piece(ie + 1, n)
    ye, yo = _stages(ye, yo, length, PIECES, G, HALF, L)
    return ye * inv_e, yo * inv_o


# ------------------------------------------------------------------------------------------------------------------
# Wire rows and residuals


@triton.jit
def store_codes_rot(payload_ptr, pay, limit, ye, yo, BITS: tl.constexpr, MASKED: tl.constexpr, G: tl.constexpr,
                    HALF: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """Writes a tile's codes (``quantize_pairs``' words) into a wire row: each block's payload from byte ``pay[g]``
    (with ``MASKED``, its first ``limit[g]`` bytes: codes, then zeros of masked places)."""
    if BITS == 8:
        _store_payload(payload_ptr, pay, limit, join_pairs(ye, yo, G, HALF).to(tl.int8), 2 * HALF, L, MASKED)
    else:
        _store_payload(payload_ptr, pay, limit, ((ye & 0xF) | (yo << 4)).to(tl.int8), HALF, L, MASKED)


@triton.jit
def load_dequantized_rot(payload_ptr, pay, limit, scale, length, BITS: tl.constexpr, MASKED: tl.constexpr,
                         G: tl.constexpr, HALF: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """A tile of a wire row back to fp32 pairs ``q * scale`` (``scale`` ``[G]``); with ``MASKED``, bytes below
    ``limit[g]`` read, places past ``length[g]`` 0 (a payload's padding is not data, whatever a sender put there).
    INT4 codes are decoded a byte at a time: in this layout as short as ``_tiles.int4_word_pairs`` (3 instructions a
    code), which needs more registers."""
    if BITS == 8:
        q = _load_payload(payload_ptr, pay, limit, 2 * HALF, L, MASKED)
        qe, qo = split_pairs(q.to(tl.float32), G, HALF)
    else:
        byte = _load_payload(payload_ptr, pay, limit, HALF, L, MASKED).to(tl.int32)
        qe = ((byte << 28) >> 28).to(tl.float32)
        qo = (byte >> 4).to(tl.float32)
    s = scale[:, None]
    ve = qe * s
    vo = qo * s
    if MASKED:
        ie = 2 * tl.arange(0, HALF)[None, :]
        n = length[:, None]
        ve = tl.where(ie < n, ve, 0.0)
        vo = tl.where(ie + 1 < n, vo, 0.0)
    return ve, vo


@triton.jit
def _bf16_round(v):
    """fp32 -> bf16 bits (int16), nearest even, any NaN the canonical one: as torch (the interpreter truncates)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def store_values_rot(ptr, first, limit, ve, vo, BF16_BY_HAND: tl.constexpr, MASKED: tl.constexpr, G: tl.constexpr,
                     HALF: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """Stores fp32 pairs in ``ptr``'s dtype (``BF16_BY_HAND``: bf16 bits rounded here, into an int16 view)."""
    v = join_pairs(ve, vo, G, HALF)
    v = _bf16_round(v) if BF16_BY_HAND else v.to(ptr.dtype.element_ty)
    store_rows(ptr, first, limit, v, 2 * HALF, L, MASKED)


@triton.jit
def load_residual_rot(res_ptr, first, length, rscale, decay, WIDTH: tl.constexpr, MASKED: tl.constexpr,
                      G: tl.constexpr, HALF: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """The decayed residual of a tile as fp32 pairs (``_tiles.load_residual``'s arithmetic): fp32 or bf16 (int16
    bits) times ``decay``, or INT8 codes times their block's ``scale * decay`` (``rscale``: the block's scale);
    places past ``length[g]`` 0."""
    if WIDTH == 32:
        ve, vo = load_pairs_rot(res_ptr, first, length, L, MASKED, G, HALF)
        ve, vo = ve * decay, vo * decay
    elif WIDTH == 16:
        b = load_rows(res_ptr, first, length, 2 * HALF, L, MASKED)
        ve, vo = split_pairs((b.to(tl.int32) << 16).to(tl.float32, bitcast=True) * decay, G, HALF)
    else:
        q = load_rows(res_ptr, first, length, 2 * HALF, L, MASKED)
        ve, vo = split_pairs(q.to(tl.float32) * (rscale * decay)[:, None], G, HALF)
        if MASKED:  # a scale of NaN must not reach the places past a block's end
            ie = 2 * tl.arange(0, HALF)[None, :]
            n = length[:, None]
            ve = tl.where(ie < n, ve, 0.0)
            vo = tl.where(ie + 1 < n, vo, 0.0)
    return ve, vo


@triton.jit
def store_residual_rot(res_ptr, first, length, le, lo, WIDTH: tl.constexpr, MASKED: tl.constexpr, G: tl.constexpr,
                       HALF: tl.constexpr, L: tl.constexpr):  # fmt: skip
    """Stores what a quantization lost into a residual of ``WIDTH`` (``_tiles.store_residual``'s arithmetic); for
    INT8 returns the blocks' scales (the caller stores them), else None."""
    scale = None
    if WIDTH == 8:
        ye, yo, scale = quantize_pairs(le, lo, 0, 0, 127, False, G, HALF)
        store_rows(res_ptr, first, length, join_pairs(ye, yo, G, HALF).to(tl.int8), 2 * HALF, L, MASKED)
    else:
        store_values_rot(res_ptr, first, length, le, lo, WIDTH == 16, MASKED, G, HALF, L)
    return scale


# ------------------------------------------------------------------------------------------------------------------
# A tile's blocks. ``KIND``: 3 a row's full tile of uniform blocks, 4 its last (masked) one; 2, 1, 0: a tile of
# parameter-aligned blocks in ``_tiles``' MODE 2 (a vector run), 1 (any blocks of a padded layout) or 0 (packed). The
# rotated kernels take a masked tile whole (not a quarter at a time, as the plain ones): a thread's accesses of a
# block share its start, so one address and immediate offsets serve them.


@triton.constexpr_function
def masked_lanes(G, GE, L, HALF, UNIFORM):
    """The threads per block of a masked tile, which goes a part of the tile's blocks at a time over the whole tile's
    G * L threads. Parameter-aligned blocks: GE blocks at a time (the plain kernels' masked sub-tile, a quarter of the
    tile), so a thread holds a quarter of what it holds in a whole tile (masks and pieces take registers). Uniform
    blocks (a row's last tile): as many, but never less than 8 bytes of a block's INT4 payload (16 of its INT8 payload)
    per thread, which each access then moves at once."""
    lanes = min(G * L // GE, HALF)
    return max(L, min(lanes, HALF // 8)) if UNIFORM else lanes


@triton.constexpr_function
def masked_blocks(G, GE, L, HALF, UNIFORM):
    """The blocks a masked tile goes at a time (:func:`masked_lanes`)."""
    return G * L // masked_lanes(G, GE, L, HALF, True) if UNIFORM else GE


@triton.constexpr_function
def masked_kind(KIND, BS, HALF):
    """Whether a tile of ``KIND`` needs masks (and pieces): it may hold short blocks, or blocks are not a power of
    two."""
    return KIND == 0 or KIND == 1 or KIND == 4 or BS != 2 * HALF


@triton.jit
def tile_blocks(base, n, table_ptr, nblk, KIND: tl.constexpr, BS: tl.constexpr, G: tl.constexpr):
    """G blocks ``[G]``: their ids (the scale slots), which exist, their first elements and lengths, and their first
    payload bytes at 8 and at 4 bits (uniform: blocks ``base ..`` of a row of ``n``; aligned: the table's order
    entries ``base ..``)."""
    g = tl.arange(0, G)
    if KIND >= 3:
        blk = base + g
        valid = blk < padded_blocks(n, BS)
        first = blk * BS
        if KIND == 3:
            length = tl.zeros([G], tl.int32) + BS
        else:
            length = tl.minimum(tl.maximum(n - first, 0), BS)
        pay8 = first
        pay4 = first >> 1  # INT4 blocks are even
    elif KIND == 2:  # a run of G whole blocks: everything affine in its first block
        b0 = tl.load(table_ptr + 4 * base + 3)
        blk = b0 + g
        valid = g < G
        first = tl.multiple_of(tl.load(table_ptr + 4 * b0), 16) + g * BS
        length = tl.zeros([G], tl.int32) + BS
        pay8 = tl.multiple_of(tl.load(table_ptr + 4 * b0 + 1), 16) + g * BS
        pay4 = tl.multiple_of(tl.load(table_ptr + 4 * b0 + 2), 16) + g * (BS // 2)
    else:
        i = base + g
        valid = i < nblk
        blk = tl.load(table_ptr + 4 * i + 3, mask=valid, other=0)
        first = tl.load(table_ptr + 4 * blk, mask=valid, other=0)
        length = tl.load(table_ptr + 4 * blk + 4, mask=valid, other=0) - first
        pay8 = tl.load(table_ptr + 4 * blk + 1, mask=valid, other=0)
        pay4 = tl.load(table_ptr + 4 * blk + 2, mask=valid, other=0)
        if KIND == 1:  # a padded layout: every block's payload starts on 16 bytes
            pay8 = tl.multiple_of(pay8, 16)
            pay4 = tl.multiple_of(pay4, 16)
    return blk, valid, first, length, pay8, pay4


@triton.jit
def noise_counter(row, base, nblk, KIND: tl.constexpr, GT: tl.constexpr, GE: tl.constexpr, HALF: tl.constexpr):
    """The first Philox counter of the rounding noise of the blocks from ``base``: the plain kernels' (``_tiles``'
    ``quantize_to_row``, with tiles of GT blocks, and ``quantize_to_row_aligned``, whose masked tiles of a padded
    layout go GE blocks at a time), so a rotated kernel rounds with the noise the plain one gives its rotated input."""
    if KIND >= 3:
        counter0 = (row * tl.num_programs(0) * GT + base) * (HALF // 4)
    elif KIND == 1:
        counter0 = (row * (nblk + GE) + base) * HALF // 4
    else:
        counter0 = (row * (nblk + GT) + base) * HALF // 4
    return counter0


@triton.jit
def payload_limit(pay, length, so, BITS: tl.constexpr, KIND: tl.constexpr, BS: tl.constexpr):
    """Bytes of each block's payload a masked access moves: uniform blocks, up to the row's padded payload end ``so``;
    aligned blocks, the codes' bytes, and in a padded layout the padding after them up to 16 bytes (a store writes
    its zeros; a read's places past the block's end are set to 0, :func:`load_dequantized_rot`)."""
    if KIND >= 3:
        limit = tl.minimum(tl.maximum(so - pay, 0), (BS * BITS + 7) // 8)
    else:
        limit = length if BITS == 8 else (length + 1) >> 1
        if KIND == 1:  # a multiple of 16 (the padding: zeros, or masked on reading): a masked access moves 16 bytes
            limit = tl.multiple_of((limit + 15) & -16, 16)
    return limit


@triton.jit
def store_block_scales(scale_ptr, blk, valid, scale, KIND: tl.constexpr):
    """A tile's fp32 block scales (uniform: the row's padded slots too, whose blocks hold no data: scale 0)."""
    if KIND == 2 or KIND == 3:
        tl.store(scale_ptr + blk, scale)
    else:
        tl.store(scale_ptr + blk, scale, mask=valid)


@triton.jit
def load_block_scales(scale_ptr, blk, valid, KIND: tl.constexpr):
    if KIND == 2 or KIND == 3:
        s = tl.load(scale_ptr + blk)
    else:
        s = tl.load(scale_ptr + blk, mask=valid, other=0.0)
    return s


@triton.jit
def dequantized_codes(ye, yo, scale):
    """``q * scale`` of :func:`~._tiles.quantize_pairs`' code words: what a receiver dequantizes."""
    s = scale[:, None]
    return (ye.to(tl.float32, bitcast=True) - ROUND_MAGIC) * s, (yo.to(tl.float32, bitcast=True) - ROUND_MAGIC) * s


# ------------------------------------------------------------------------------------------------------------------
# The quantizers' common end


@triton.jit
def quantize_rotated(xe, xo, row, base, edge0, n, out_ptr, wire, so, seed, res_ptr, rscale_ptr, rs, decay, table_ptr,
                     nblk, sign_ptr, blk, valid, first, length, pay8, pay4, BITS: tl.constexpr, QMAX: tl.constexpr,
                     BS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, STOCHASTIC: tl.constexpr,
                     FEEDBACK: tl.constexpr, KIND: tl.constexpr, GT: tl.constexpr, GE: tl.constexpr,
                     L: tl.constexpr):  # fmt: skip
    """Quantizes the fp32 pairs of a tile's blocks (:func:`tile_blocks`) rotated into wire row ``row`` (codes,
    scales, the row's padding), as ``reference._quantize_rotated``: with error feedback (``FEEDBACK``: the
    residual's width), ``v = x + decay * residual`` is rotated and quantized, and the residual becomes
    ``v - unrotate(q * scale)``, in the rows' own coordinates (the next call's rotation differs)."""
    MASKED: tl.constexpr = masked_kind(KIND, BS, HALF)
    if FEEDBACK:
        nb = nblk if KIND < 3 else (n + BS - 1) // BS  # a row's residual scales
        rvalid = valid if KIND < 3 else blk < nb
        rscale = None
        if FEEDBACK == 8:
            rscale = load_block_scales(rscale_ptr + row * nb, blk, rvalid, KIND)
        re, ro = load_residual_rot(res_ptr + row * rs, first, length, rscale, decay, FEEDBACK, MASKED, G, HALF, L)
        xe, xo = with_feedback(xe, xo, re, ro)
    de, do = signs(sign_ptr, G, HALF, L, BS, False)
    ve, vo = rotate(xe, xo, de, do, length, MASKED, G, HALF, L)
    ye, yo, scale = quantize_pairs(ve, vo, seed, noise_counter(row, base, nblk, KIND, GT, GE, HALF), QMAX,
                                   STOCHASTIC, G, HALF)  # fmt: skip
    payload, scales = wire_row_bytes(out_ptr, row, wire, so)
    pay = pay8 if BITS == 8 else pay4
    store_codes_rot(payload, pay, payload_limit(pay, length, so, BITS, KIND, BS), ye, yo, BITS, MASKED, G, HALF,
                    L)  # fmt: skip
    store_block_scales(scales, blk, valid, scale, KIND)
    if KIND < 2:
        if base == edge0:  # the row's first masked tile writes its padding
            store_padding_aligned(payload, scales, table_ptr, nblk, so, BITS, KIND)
    if FEEDBACK:
        qe, qo = dequantized_codes(ye, yo, scale)
        if MASKED:  # the signs, scaled by each block's pieces in unrotate
            ie, io = de, do
        else:
            ie, io = signs(sign_ptr, G, HALF, L, BS, True)
        se, so_ = unrotate(qe, qo, ie, io, length, MASKED, G, HALF, L)
        rscale = store_residual_rot(res_ptr + row * rs, first, length, xe - se, xo - so_, FEEDBACK, MASKED, G, HALF, L)
        if FEEDBACK == 8:
            store_block_scales(rscale_ptr + row * nb, blk, rvalid, rscale, KIND)
