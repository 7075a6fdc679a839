"""The wire format and the qgZ slot order: plain integer arithmetic shared by the Triton kernels and the torch twins.

One quantized row of ``numel`` elements is one uint8 buffer::

    [ payload ............ | pad to 16 | fp32 scale x num_blocks | pad to 16 ]
      INT8: 1 byte / elem                 block b covers elements [b * block_size, (b + 1) * block_size)
      INT4: 2 elems / byte, element 2i in the low nibble, 2i+1 in the high nibble (two's complement)

Symmetric absmax scaling: ``scale = absmax(block) * (1 / qmax)`` (qmax 127 or 7; ``1 / qmax`` rounded to fp32 once,
``RECIPROCAL_QMAX``: a multiply, not a division, per block), ``q = round_half_even(x / scale)``,
``x' = q * scale``. A block of zeros has scale 0 and comes back exact; a block holding Inf or NaN gets scale NaN and
comes back as NaN, so an overflow is never hidden. Several rows (2-D input) are quantized independently and stacked.
"""

from __future__ import annotations

import bisect
import struct

QMAX = {8: 127, 4: 7}
# 1 / qmax rounded to the nearest fp32, as a Python float that fp32 holds exactly (so the twins' ``absmax * r`` and
# the kernels' are the same single rounding): a block's scale is ``absmax * r``, within an ulp of ``absmax / qmax``
RECIPROCAL_QMAX = {bits: struct.unpack("f", struct.pack("f", 1.0 / q))[0] for bits, q in QMAX.items()}
ALIGN = 16
PIECE_ALIGN = 16  # elements: where Blocks.stages prefers to cut (the vector tiles' block alignment)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_format(bits: int, block_size: int, *, op: str = "quantization", bits_name: str = "bits") -> None:
    """Raises unless ``bits`` and ``block_size`` describe a wire format; the message starts with ``op`` and names the
    bits argument ``bits_name``."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in QMAX:
        raise ValueError(f"{op}: `{bits_name}={bits!r}` is not supported; use 8 or 4.")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{op}: `block_size={block_size!r}` is not allowed; use a positive int.")
    if bits == 4 and block_size % 2:
        raise ValueError(
            f"{op}: `block_size={block_size}` is odd, but INT4 packs pairs of elements; use an even block size."
        )


def payload_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def scale_offset(numel: int, bits: int) -> int:
    """Byte offset of the first fp32 scale (16-byte aligned)."""
    return _round_up(payload_bytes(numel, bits), ALIGN)


def wire_size(numel: int, bits: int, block_size: int) -> int:
    """Bytes of one quantized row of ``numel`` elements."""
    return _round_up(scale_offset(numel, bits) + 4 * num_blocks(numel, block_size), ALIGN)


def swizzle_source(slot, ranks_per_node, num_nodes):
    """The chunk that goes to ``slot`` before the intra-node all-to-all (see :func:`swizzle_order`).

    The one place the formula is written: :func:`swizzle_order` (the torch twin's gather) calls it on Python ints,
    and the quantize kernel compiles it (``triton.jit(swizzle_source)``) and calls it on its row index. So it uses
    only operators both understand, on non-negative integers (where Triton's C-style ``//`` and ``%`` agree with
    Python's).
    """
    return (slot % num_nodes) * ranks_per_node + slot // num_nodes


def swizzle_order(ranks_per_node: int, num_nodes: int) -> list[int]:
    """``order[slot]`` = the chunk that goes to ``slot`` before the intra-node all-to-all.

    Chunk ``j = k * N + l`` (for rank ``l`` of node ``k``) moves to slot ``l * K + k``: slots ``[l*K, (l+1)*K)`` go to
    local peer ``l``, which then holds, from each local peer, the K chunks of the ranks with local rank ``l``. The
    paper's tensor-slice reordering: ``[0, 1, ..., YX-1] -> [0, X, 2X, ..., (Y-1)X, 1, X+1, ...]`` (X = N, Y = K).
    """
    return [swizzle_source(slot, ranks_per_node, num_nodes) for slot in range(ranks_per_node * num_nodes)]


def stage_bounds(chunk_numel: int, stages: int, stage: int, block_size: int) -> tuple[int, int]:
    """``(start, size)`` of pipeline piece ``stage`` inside each chunk: ``ceil(C / S)`` elements rounded up to whole
    quantization blocks, the last piece shorter (or empty when the chunk has fewer blocks than stages).

    Whole blocks keep every piece's start aligned like the chunk itself, so the kernels' loads stay vectorized, and
    no block is split between two stages.
    """
    piece = _round_up(-(-chunk_numel // stages), block_size)
    start = min(stage * piece, chunk_numel)
    return start, min(piece, chunk_numel - start)


def cut_pieces(numel: int, pieces: int, block_size: int, blocks: Blocks | None) -> list[tuple[int, int, Blocks | None]]:
    """``(start, size, piece blocks)`` of each of ``pieces`` consecutive pieces of a row of ``numel`` elements, cut at
    block boundaries (sizes may be 0): :meth:`Blocks.stages` for parameter-aligned ``blocks``, else
    :func:`stage_bounds` (and None). qgZ's pipeline pieces of a chunk, and quantized HSDP's rail pieces of a shard."""
    if blocks is None:
        bounds = (stage_bounds(numel, pieces, s, block_size) for s in range(pieces))
        return [(start, size, None) for start, size in bounds]
    return [(start, piece.numel, piece) for start, piece in blocks.stages(pieces)]


class Blocks:
    """Quantization blocks of one row that never straddle a boundary between segments (parameters).

    FSDP2 lays a unit's flat shard out as each parameter's padded shard, one after another; the same layout repeats in
    every rank's chunk. :meth:`of_segments` cuts each segment into whole blocks of ``block_size`` plus one shorter tail
    block, so a small parameter never shares a scale with a large neighbour (whose scale would round it to zero). The
    row's element count and payload are unchanged; the scales grow by at most one per segment. Block ``b`` covers
    elements ``[starts[b], starts[b + 1])``.

    The payload: block ``b``'s codes start at byte ``payload_offsets(bits)[b]``, packed like the uniform format's
    (INT8 one byte per element, INT4 element 2i in the low nibble); two blocks never share a byte (a block of odd length
    leaves its last high nibble 0). Where a whole block fills whole 16-byte lines at both widths (``block_size`` a
    multiple of 32: :attr:`padded`), each block's payload is padded with zeros to a multiple of 16 bytes, so every
    block starts on a 16-byte boundary and the kernels move its codes in 16-byte vectors. Only a block shorter than
    ``block_size`` (a segment's tail, at most one per segment) gets padding: at most 15 bytes per segment. Otherwise
    the blocks are packed (INT8 codes at their element's position, INT4 blocks each starting on a byte). The scales
    follow the payload as in the uniform format::

        [ payload (payload_bytes(bits)) | pad to 16 | fp32 scale x count | pad to 16 ]

    A ``Blocks`` is immutable; the kernels cache its device tables on it, so build one per layout and reuse it.
    """

    __slots__ = ("starts", "block_size", "_cache")

    def __init__(self, starts: tuple[int, ...], block_size: int | None = None) -> None:
        starts = tuple(int(s) for s in starts)
        if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"Blocks: `starts` must begin at 0 and increase strictly, got {starts[:8]}...")
        self.starts = starts
        longest = max((b - a for a, b in zip(starts, starts[1:])), default=0)
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < longest):  # fmt: skip
            raise ValueError(f"Blocks: `block_size={block_size!r}` must be an int >= the longest block ({longest}).")
        self.block_size = longest if block_size is None else block_size
        self._cache: dict = {}

    @classmethod
    def of_segments(cls, segments: list[int] | tuple[int, ...], block_size: int) -> Blocks:
        """Whole blocks of ``block_size`` from the start of each segment, and a shorter tail where one is left."""
        starts, offset = [0], 0
        for length in segments:
            if isinstance(length, bool) or not isinstance(length, int) or length < 0:
                raise ValueError(f"Blocks.of_segments: segment lengths must be ints >= 0, got {length!r}.")
            starts.extend(range(offset + block_size, offset + length, block_size))
            offset += length
            if length:
                starts.append(offset)
        return cls(tuple(starts), block_size)

    @property
    def numel(self) -> int:
        return self.starts[-1]

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    @property
    def longest(self) -> int:
        return max((b - a for a, b in zip(self.starts, self.starts[1:])), default=0)

    @property
    def padded(self) -> bool:
        """Whether each block's payload is padded to 16 bytes (a whole block fills 16-byte lines at 4 and 8 bits)."""
        return self.block_size > 0 and self.block_size % 32 == 0

    def payload_offsets(self, bits: int) -> tuple[int, ...]:
        """Byte offset of each block's first code in a wire row of ``bits``, then the payload's end (``count + 1``)."""
        key = ("payload", bits)
        if key not in self._cache:
            offsets = [0]
            for a, b in zip(self.starts, self.starts[1:]):
                size = b - a if bits == 8 else _round_up(b - a, 2) // 2
                offsets.append(offsets[-1] + (_round_up(size, ALIGN) if self.padded else size))
            self._cache[key] = tuple(offsets)
        return self._cache[key]

    def payload_bytes(self, bits: int) -> int:
        return self.payload_offsets(bits)[-1]

    def scale_offset(self, bits: int) -> int:
        return _round_up(self.payload_bytes(bits), ALIGN)

    def wire_size(self, bits: int) -> int:
        return _round_up(self.scale_offset(bits) + 4 * self.count, ALIGN)

    def piece(self, first: int, last: int) -> Blocks:
        """Blocks ``[first, last)`` as a row of their own (element offsets rebased to the first block's start)."""
        base = self.starts[first]
        return Blocks(tuple(s - base for s in self.starts[first : last + 1]), self.block_size)

    def stages(self, stages: int) -> list[tuple[int, Blocks]]:
        """The row cut into ``stages`` pipeline pieces at block boundaries: ``(element start, blocks)`` per piece,
        each about ``numel / stages`` elements (a piece is empty when the row has fewer blocks than stages).

        A cut goes to the block start nearest its ideal position (``s * ceil(numel / stages)``) that is a multiple of
        :data:`PIECE_ALIGN` elements, where one lies within :meth:`stage_slack` of it; otherwise to the first block
        start at or past the ideal position. A piece that starts aligned keeps its buffers' addresses (the input's
        chunk at ``start``, the output at ``out[start:]``) on 16-byte boundaries whenever the chunk's are, so the
        kernels' vector tiles move 16 bytes per thread in every piece, not only the first; at odd parameter sizes
        the plain cut lands on a segment's odd offset and every later piece's tiles go scalar. A piece is then at
        most ``ceil(numel / stages) + 2 * slack + longest`` elements long.

        The parameter-aligned counterpart of :func:`stage_bounds`; cached, since qgZ asks for it on every call.
        """
        key = ("stages", stages)
        if key not in self._cache:
            target = -(-self.numel // stages)
            slack = self.stage_slack(stages)
            bounds, b = [0], 0
            for s in range(1, stages):
                ideal = s * target
                while b < self.count and self.starts[b] < ideal:
                    b += 1
                window = range(max(bounds[-1], bisect.bisect_left(self.starts, ideal - slack)),
                               min(self.count, bisect.bisect_right(self.starts, ideal + slack)))  # fmt: skip
                near = [i for i in window if self.starts[i] % PIECE_ALIGN == 0]
                cut = min(near, key=lambda i: (abs(self.starts[i] - ideal), i)) if near else b
                bounds.append(max(cut, bounds[-1]))
            bounds.append(self.count)
            self._cache[key] = [(self.starts[f], self.piece(f, last)) for f, last in zip(bounds, bounds[1:])]
        return self._cache[key]

    def stage_slack(self, stages: int) -> int:
        """How far (elements) :meth:`stages` may move a cut from its ideal position to reach an aligned block start:
        an eighth of a piece, or one block where a piece is shorter than eight blocks."""
        return max(self.block_size, -(-self.numel // stages) // 8)

    def cached(self, key, make):
        """A value derived from this layout (a device table), made once."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Blocks) and other.starts == self.starts and other.block_size == self.block_size

    def __hash__(self) -> int:
        return hash((self.starts, self.block_size))

    def __repr__(self) -> str:
        return f"Blocks(numel={self.numel}, count={self.count}, block_size={self.block_size}, longest={self.longest})"
