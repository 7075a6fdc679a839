"""The wire format and the qgZ slot order: plain integer arithmetic shared by the Triton kernels and the torch twins.

One quantized row of ``numel`` elements is one uint8 buffer::

    [ payload ............ | pad to 16 | fp32 scale x num_blocks | pad to 16 ]
      INT8: 1 byte / elem                 block b covers elements [b * block_size, (b + 1) * block_size)
      INT4: 2 elems / byte, element 2i in the low nibble, 2i+1 in the high nibble (two's complement)

Symmetric absmax scaling: ``scale = absmax(block) / qmax`` (qmax 127 or 7), ``q = round_half_even(x / scale)``,
``x' = q * scale``. A block of zeros has scale 0 and comes back exact; a block holding Inf or NaN gets scale NaN and
comes back as NaN, so an overflow is never hidden. Several rows (2-D input) are quantized independently and stacked.
"""

from __future__ import annotations

QMAX = {8: 127, 4: 7}
ALIGN = 16


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_format(bits: int, block_size: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantization: `bits={bits!r}` is not supported; use 8 or 4.")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"quantization: `block_size={block_size!r}` must be a positive int.")
    if bits == 4 and block_size % 2:
        raise ValueError(f"quantization: INT4 packs pairs, so `block_size={block_size}` must be even.")


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


def check_wire(buf, numel: int, bits: int, block_size: int, op: str) -> None:
    """Raises unless ``buf`` (a tensor) is uint8 with rows of ``wire_size(numel, bits, block_size)`` bytes."""
    if str(buf.dtype) != "torch.uint8":
        raise TypeError(f"{op}: expected a uint8 wire buffer, got {buf.dtype}.")
    expected = wire_size(numel, bits, block_size)
    if buf.shape[-1] != expected:
        raise ValueError(
            f"{op}: a row of {numel} elements at {bits} bits, block {block_size} takes {expected} bytes,"
            f" but the buffer rows hold {buf.shape[-1]}."
        )


def swizzle_order(ranks_per_node: int, num_nodes: int) -> list[int]:
    """``order[slot]`` = the chunk that goes to ``slot`` before the intra-node all-to-all.

    Chunk ``j = k * N + l`` (for rank ``l`` of node ``k``) moves to slot ``l * K + k``: slots ``[l*K, (l+1)*K)`` go to
    local peer ``l``, which then holds, from each local peer, the K chunks of the ranks with local rank ``l``. The
    paper's tensor-slice reordering: ``[0, 1, ..., YX-1] -> [0, X, 2X, ..., (Y-1)X, 1, X+1, ...]`` (X = N, Y = K).
    """
    N, K = ranks_per_node, num_nodes
    return [(slot % K) * N + slot // K for slot in range(N * K)]


def stage_bounds(chunk_numel: int, stages: int, stage: int, block_size: int) -> tuple[int, int]:
    """``(start, size)`` of pipeline piece ``stage`` inside each chunk: ``ceil(C / S)`` elements rounded up to whole
    quantization blocks, the last piece shorter (or empty when the chunk has fewer blocks than stages).

    Whole blocks keep every piece's start aligned like the chunk itself, so the kernels' loads stay vectorized, and
    no block is split between two stages.
    """
    piece = _round_up(-(-chunk_numel // stages), block_size)
    start = min(stage * piece, chunk_numel)
    return start, min(piece, chunk_numel - start)


def generalized_swizzle_slot(chunk: int, stage: int, ranks_per_node: int, num_nodes: int) -> int:
    """Slot of (chunk, stage) when all stages share one buffer: stage-major, then the swizzled order within a stage.

    With stages, piece ``s`` of every chunk travels in stage ``s``, so stage ``s + 1``'s intra-node hop can run while
    stage ``s`` crosses nodes.
    """
    N, K = ranks_per_node, num_nodes
    local, node = chunk % N, chunk // N
    return stage * N * K + local * K + node
