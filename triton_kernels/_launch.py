"""What the Triton launchers share: tile shapes, grids, index width and launch options.

The launchers get only calls the public ops in ``lightning_zeropp.kernels`` have checked; they keep ``assert``s only
where a wrong size would make a kernel read or write outside a buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import interpreting
from .layout import Blocks, num_blocks, scale_offset, wire_size

# FMA contraction would fuse ``q * scale`` into the following add (or ``x * inv`` into the rounding add) and round
# once where the torch twins round twice: the kernels would no longer match the twins bit for bit.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}

# Passed to the dequantizing kernels as an argument, not written into them as a constant: the INT4 decode's mask and
# float exponent (``_tiles.int4_word_pairs``). A value ptxas cannot see makes ``(code & mask) | exponent`` one logic
# instruction; with constants it emits a bit-field extract and an OR.
INT4_DECODE = 0x4B00000F

_INT32_LIMIT = 2**31 - 1


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in plain integers (Triton's own goes through a JIT function's call: microseconds a launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# What a launch of one shape needs besides its tensors (grid, row formats, constexprs, index width, device tables),
# made once: kept on the ``Blocks`` of a parameter-aligned launch (they are the layout), here for uniform blocks. A
# training step launches a few dozen shapes, so the bound only keeps a pathological caller from growing it forever.
_UNIFORM_LAUNCHES: dict = {}
_UNIFORM_LIMIT = 4096


class ShapeLaunch(NamedTuple):
    """What a launcher passes for one shape besides its tensors and seed, made once (:func:`once_per_shape`): the
    grid (None: nothing to launch), the scalar arguments after the leading buffers (``head``), the device tables and
    constants after the per-call ones (``tail``), the constexprs and options (``kwargs``), and the bytes of an output
    wire row, for the launchers that allocate one."""

    grid: tuple[int, int] | None
    head: tuple = ()
    tail: tuple = ()
    kwargs: dict | None = None  # None with no grid
    wire: int = 0


def once_per_shape(blocks: Blocks | None, key: tuple, make):
    """``make()`` the first time ``key`` is seen (with ``blocks``), the same object after. ``key`` holds every value
    ``make`` reads, the device included; never a tensor."""
    if blocks is not None:
        return blocks.cached(key, make)
    found = _UNIFORM_LAUNCHES.get(key)
    if found is None:
        if len(_UNIFORM_LAUNCHES) >= _UNIFORM_LIMIT:
            _UNIFORM_LAUNCHES.clear()
        found = _UNIFORM_LAUNCHES[key] = make()
    return found


def tile_shape(block_size: int) -> tuple[int, int]:
    """(G, HALF): blocks per program and the padded half-block; about 4096 elements per program."""
    half = next_power_of_2(-(-block_size // 2))
    return max(1, 2048 // half), half


def aligned_tile_shape(block_size: int) -> tuple[int, int]:
    """(G, HALF) of the aligned-blocks kernels: a quarter of :func:`tile_shape`'s blocks (about 1024 elements per
    program). Their masked accesses at arbitrary starts each need their own address, and a full tile's worth per
    thread would spill registers."""
    G, half = tile_shape(block_size)
    return max(1, G // 4), half


def quantize_grid(numel: int, bits: int, block_size: int, G: int) -> int:
    """Programs along a row for a kernel that writes a wire row: enough to cover the data and to write the padding
    after the payload (up to the 16-byte aligned scale offset) and after the last scale (up to 4 scales)."""
    so_elements = scale_offset(numel, bits) * (8 // bits)
    blocks = max(num_blocks(so_elements, block_size), -(-num_blocks(numel, block_size) // 4) * 4)
    return cdiv(blocks, G)


def needs_int64(*extents: int) -> bool:
    """Whether offsets into buffers of these sizes (elements or bytes) overflow int32."""
    return max(extents) > _INT32_LIMIT


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied if its elements are not adjacent along the last dimension (the kernels' loads need that; rows
    may lie anywhere: the launchers pass the row stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()


# Whether the kernels were made for Triton's interpreter: fixed when they were decorated (this import), as Triton
# fixes it; read once here, not from the environment at every launch.
INTERPRETED = interpreting()


def output_view(out: torch.Tensor) -> torch.Tensor:
    """What the kernels store into: under the interpreter, bf16 outputs as their int16 bits (``store_values``)."""
    return out.view(torch.int16) if INTERPRETED and out.dtype == torch.bfloat16 else out


def bf16_by_hand(out: torch.Tensor) -> bool:
    return INTERPRETED and out.dtype == torch.bfloat16


def stochastic_seed(seed: int | None) -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed % (2**31 - 1)


def block_table(blocks: Blocks, device: torch.device, G: int, HALF: int) -> tuple[torch.Tensor, int]:
    """The device table of aligned ``blocks`` (``layout.Blocks``) the kernels read (see ``_tiles``), and ``nvt``, the
    number of vector tiles: ``count + 1`` rows of a block's first element, its first payload bytes at 8 and at 4 bits
    (the last row: the ends), and the order in which programs take the blocks: ``nvt`` runs of G vector blocks
    (:func:`runs`), then every other block (the last row's order entry is 0). int32 unless a tile's offsets (a tile's
    elements past a block's start) overflow it. Made once per (blocks, device, tile, width) and cached on
    ``blocks``."""
    wide = needs_int64(blocks.numel + 2 * G * HALF, blocks.payload_bytes(8) + 2 * G * HALF)
    key = ("triton", torch.device(device), G, HALF, wide)

    def make() -> tuple[torch.Tensor, int]:
        first = runs(blocks, G)
        nvt = len(first)
        taken = {b + g for b in first for g in range(G)}
        order = [b + g for b in first for g in range(G)] + [b for b in range(blocks.count) if b not in taken]
        columns = (blocks.starts, blocks.payload_offsets(8), blocks.payload_offsets(4), (*order, 0))
        table = torch.tensor(columns, dtype=torch.int64 if wide else torch.int32).t().contiguous().view(-1)
        return table.to(device), nvt

    return blocks.cached(key, make)


def runs(blocks: Blocks, G: int) -> list[int]:
    """The first blocks of the vector tiles of a padded layout: runs of G consecutive whole blocks, the first starting
    at a multiple of 16 elements, taken greedily from the row's start. In a run, element offsets, payload offsets (a
    whole block's payload is ``block_size`` or ``block_size / 2`` bytes, multiples of 16) and scale slots are affine
    in the block's place, so a vector tile reads one table entry per column (``_tiles``, MODE 2). Blocks outside
    runs (tails, segments shorter than a run, odd starts) go to the masked tiles."""
    if not blocks.padded:
        return []
    starts, size = blocks.starts, blocks.block_size
    first, b = [], 0
    while b + G <= blocks.count:
        end = next((i for i in range(b, b + G) if starts[i + 1] - starts[i] != size), None)
        if end is not None:  # a short block: no run reaches past it
            b = end + 1
        elif starts[b] % 16:
            b += 1
        else:
            first.append(b)
            b += G
    return first


class Tiling(NamedTuple):
    """How a launch covers its rows: G blocks of (padded) 2 * HALF elements per program, the grid (programs along a
    row, rows), and for aligned blocks the device table, the block count, the number of vector tiles, whether the
    layout is padded (``Blocks.padded``); None (and False) for uniform blocks: a constexpr None keeps the uniform
    kernel's signature unchanged."""

    G: int
    HALF: int
    grid: tuple[int, int]
    table: torch.Tensor | None
    nblk: int | None
    nvt: int | None = None
    padded: bool = False
    GE: int | None = None  # blocks per masked sub-tile of a padded layout (its masked tiles go a quarter at a time)

    @property
    def tile(self) -> int:
        """Elements one program covers."""
        return 2 * self.G * self.HALF


def tiling(numel: int, rows: int, block_size: int, blocks: Blocks | None, device: torch.device,
           wire_bits: int | None = None) -> Tiling:  # fmt: skip
    """The :class:`Tiling` of ``rows`` rows of ``numel`` elements in uniform blocks of ``block_size`` or in aligned
    ``blocks``. ``wire_bits``: the kernel writes uniform wire rows of these bits, so its programs also cover the
    row's padding (:func:`quantize_grid`); None: they cover the elements only."""
    if blocks is not None:
        # a padded layout's tiles are the uniform ones: its vector tiles move 16 payload bytes per thread
        G, HALF = tile_shape(block_size) if blocks.padded else aligned_tile_shape(block_size)
        table, nvt = block_table(blocks, device, G, HALF)
        # at least one masked tile after the vector ones: the first writes the row's padding
        along = nvt + max(1, cdiv(blocks.count - nvt * G, G))
        return Tiling(G, HALF, (along, rows), table, blocks.count, nvt, blocks.padded, max(1, G // 4))
    G, HALF = tile_shape(block_size)
    if wire_bits is None:
        along = cdiv(num_blocks(numel, block_size), G)
    else:
        along = quantize_grid(numel, wire_bits, block_size, G)
    return Tiling(G, HALF, (along, rows), None, None)


def row_format(numel: int, bits: int, block_size: int, blocks: Blocks | None) -> tuple[int, int]:
    """(bytes per wire row, scale offset) of ``numel`` elements at ``bits`` in uniform blocks or ``blocks``."""
    if blocks is None:
        return wire_size(numel, bits, block_size), scale_offset(numel, bits)
    return blocks.wire_size(bits), blocks.scale_offset(bits)


class FeedbackArguments(NamedTuple):
    """What a quantizing kernel takes for error feedback: ``arguments`` (the residual, its scales, its row stride,
    ``decay``; all None without feedback, so the kernel's signature is the plain one), ``bits`` (the ``FEEDBACK``
    constexpr: the residual's width, 0 for none) and ``extent`` (the elements its offsets reach, for the index
    width)."""

    arguments: tuple
    bits: int
    extent: int


def feedback_arguments(spec, rows: int, n: int) -> FeedbackArguments:
    """The kernel arguments of ``spec``'s error feedback (a checked spec: ``residual`` is ``(rows, n)``, or ``(n,)``
    for one row). A bf16 residual goes as its int16 bits (the kernels convert by hand, so the interpreter, which
    truncates fp32 -> bf16, rounds as the GPU and torch do); int8 codes with their row stride and scales."""
    residual, bits = spec.residual, spec.feedback_bits
    if residual is None:
        return FeedbackArguments((None, None, None, None), 0, 0)
    stride = residual.stride(0) if residual.dim() == 2 else n
    assert residual.stride(-1) == 1 and stride >= n  # the kernel reads and writes rows of n at this stride
    if bits == 16:
        residual = residual.view(torch.int16)
    scales = spec.residual_scales
    if scales is not None:
        assert scales.is_contiguous() and scales.numel() % max(rows, 1) == 0  # one row of block scales per row
    return FeedbackArguments((residual, scales, stride, float(spec.decay)), bits, rows * stride)


class Rotation(NamedTuple):
    """What a kernel takes for rotated blocks (``rotation_seed``): the sign table (``_rotated.rotation_table``; None
    without rotation) and the keyword arguments of the launch (none without rotation, so the plain launches stay as
    they were): ``ROTATE``, ``L`` (the threads that share a block), ``GE`` (the blocks of a masked sub-tile) and
    ``num_warps``."""

    table: torch.Tensor | None
    options: dict


def rotation(rotation_seed: int | None, block_size: int, t: Tiling, device: torch.device, per_thread: int = 128,
             ) -> Rotation:  # fmt: skip
    """The :class:`Rotation` of a launch tiled by ``t``: ``L`` threads per block so that each holds at most
    ``per_thread`` of a block's (padded) elements, and warps enough for the tile's G blocks (lanes along the blocks,
    so no thread repeats another's work)."""
    if rotation_seed is None:
        return Rotation(None, {})
    from ._rotated import rotation_table

    L = max(1, 2 * t.HALF // per_thread)
    options = {"ROTATE": True, "L": L, "GE": t.GE or max(1, t.G // 4), "num_warps": max(1, min(8, t.G * L // 32))}
    return Rotation(rotation_table(rotation_seed, block_size, device), options)
