"""Triton kernels on the CPU under TRITON_INTERPRET=1, bit for bit against the torch twins (small sizes: the
interpreter is slow). The same checks run on CUDA in test_kernels_gpu.py."""

import itertools
import os
from fractions import Fraction

import pytest
import torch

from lightning_zeropp import kernels as tk
from lightning_zeropp.kernels.layout import RECIPROCAL_QMAX
from lightning_zeropp.testing.kernels import (
    DTYPES,
    SEGMENTS,
    SIZES,
    check_aligned_quantize_dequantize,
    check_edge_blocks,
    check_every_code,
    check_feedback,
    check_quantize_dequantize,
    check_reduce,
    check_reduce_aligned,
    check_rows,
    check_stochastic,
    check_stochastic_feedback,
    check_swizzle_aligned,
    check_swizzle_quantize,
)

pytestmark = [
    pytest.mark.triton_interpret,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)"
    ),
    pytest.mark.version_sensitive,
    pytest.mark.matrix,  # the fast tier: a subset covering every parameter value (conftest)
]
DEVICE = "cpu"


@pytest.mark.parametrize(("n", "bits", "block", "dtype"), itertools.product(SIZES, [8, 4], [64, 256], DTYPES))
def test_quantize_dequantize(n, bits, block, dtype):
    check_quantize_dequantize(DEVICE, n, bits, block, dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_block_plus_one_and_odd_block(bits):
    check_quantize_dequantize(DEVICE, 257, bits, 256, torch.float32)
    if bits == 8:
        check_quantize_dequantize(DEVICE, 100, 8, 33, torch.bfloat16)


def test_rows():
    check_rows(DEVICE)


@pytest.mark.parametrize(
    ("N", "K", "chunk", "stages"), [(2, 2, 37, 2), (2, 3, 100, 3), (4, 2, 33, 2), (1, 4, 20, 1), (4, 1, 5, 1)]
)
@pytest.mark.parametrize("bits", [8, 4])
def test_swizzle_quantize(N, K, chunk, stages, bits):
    check_swizzle_quantize(DEVICE, N, K, chunk, stages, bits)


@pytest.mark.parametrize(("N", "K", "n"), [(2, 2, 37), (3, 2, 301), (1, 1, 5)])
@pytest.mark.parametrize(("in_bits", "out_bits"), [(8, 4), (4, 4), (8, 8), (4, 8)])
def test_reduce(N, K, n, in_bits, out_bits):
    check_reduce(DEVICE, N, K, n, in_bits, out_bits)


@pytest.mark.slow  # about 14 s in the interpreter
@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding(bits):
    check_stochastic(DEVICE, bits)


# Parameter-aligned blocks: with block 128 (one tile), with block 512 (a row of several tiles, whose padding program 0
# writes), a row that is one short segment, one segment of several blocks, a packed layout (block 2), and VECTOR: a row
# whose whole blocks at starts that are multiples of 16 fill two vector tiles (32 blocks of 128 each; the others,
# at odd starts or short, take the masked path)
VECTOR = ((1030, 3, 1040, 1, 6, 8199), 128)
ALIGNED = [(SEGMENTS, 128), ((300, 3, 0, 1100, 5, 1, 257, 600), 512), ((5,), 128), ((1000,), 128), ((1, 2), 2), VECTOR]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(  # the aligned layouts take 10-40 s each in the interpreter: the slow tier
    "layout",
    [
        (None, 128),
        (None, 64),
        pytest.param(VECTOR, marks=pytest.mark.slow),
        pytest.param(ALIGNED[1], marks=pytest.mark.slow),
    ],
)
def test_every_code_dequantizes_as_the_twin(bits, layout):
    check_every_code(DEVICE, bits, *layout)


def test_vector_tiles_are_taken_first():
    from lightning_zeropp.kernels._launch import block_table, tile_shape

    blocks = tk.Blocks.of_segments(list(VECTOR[0]), VECTOR[1])
    G, HALF = tile_shape(VECTOR[1])
    table, nvt = block_table(blocks, torch.device("cpu"), G, HALF)
    # the 8199-element segment's 64 whole blocks at a start that is a multiple of 16: 2 runs of 32; the 8 whole
    # blocks of the first segment are too few for a run, the second segment's start is odd
    assert nvt == 2 and G == 32
    columns = [list(blocks.starts), list(blocks.payload_offsets(8)), list(blocks.payload_offsets(4))]
    assert table.view(-1, 4)[:, :3].t().tolist() == columns
    order = table.view(-1, 4)[: blocks.count, 3].tolist()
    assert sorted(order) == list(range(blocks.count))
    assert order[: nvt * G] == list(range(21, 85))
    for tile in range(nvt):  # a vector tile reads its first block's entries and steps from there (_tiles, MODE 2)
        b0 = order[tile * G]
        assert order[tile * G : (tile + 1) * G] == list(range(b0, b0 + G)) and blocks.starts[b0] % 16 == 0
        for g in range(G + 1):
            assert blocks.starts[b0 + g] == blocks.starts[b0] + g * 128
            assert blocks.payload_offsets(8)[b0 + g] == blocks.payload_offsets(8)[b0] + g * 128
            assert blocks.payload_offsets(4)[b0 + g] == blocks.payload_offsets(4)[b0] + g * 64
        assert blocks.payload_offsets(8)[b0] % 16 == 0 and blocks.payload_offsets(4)[b0] % 16 == 0


def test_vector_runs_cross_segments_without_tails_and_stop_at_tails():
    from lightning_zeropp.kernels._launch import runs

    # segments of whole blocks only: one run of 4 across three segments, then the fourth segment's 2 + tail
    assert runs(tk.Blocks.of_segments([128, 256, 128, 300], 128), 4) == [0]
    # a tail inside: no run crosses it; the run after it starts at an odd element: none there either
    assert runs(tk.Blocks.of_segments([384, 5, 512], 128), 3) == [0]
    assert runs(tk.Blocks.of_segments([384, 16, 512], 128), 3) == [0, 4]
    assert runs(tk.Blocks.of_segments([383, 512], 128), 3) == []  # 2 whole + tail; 4 whole at start 383
    assert runs(tk.Blocks.of_segments([4096], 128), 32) == [0]
    assert runs(tk.Blocks.of_segments([4096], 64), 32) == [0, 32]
    assert runs(tk.Blocks.of_segments([4096], 2), 32) == []  # not a padded layout


@pytest.mark.parametrize(("segments", "block"), ALIGNED)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, 3])
def test_aligned_quantize_dequantize(segments, block, bits, dtype, rows):
    check_aligned_quantize_dequantize(DEVICE, segments, block, bits, dtype, rows)


@pytest.mark.parametrize(("N", "K", "stages"), [(2, 2, 2), (1, 3, 3), (3, 2, 1), (2, 2, 12)])
@pytest.mark.parametrize("bits", [8, 4])
def test_aligned_swizzle_quantize(N, K, stages, bits):
    check_swizzle_aligned(DEVICE, N, K, SEGMENTS, 128, stages, bits, torch.bfloat16 if bits == 4 else torch.float32)


@pytest.mark.parametrize(("segments", "block"), [(None, 128), ALIGNED[0], ALIGNED[1], VECTOR])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [None, 2])
@pytest.mark.parametrize("width", [32, 16, 8])  # the residual: fp32, bf16, INT8 codes with block scales
def test_quantize_with_feedback(segments, block, bits, rows, width):
    check_feedback(DEVICE, segments, block, bits, torch.bfloat16 if rows else torch.float32, rows, width=width)


@pytest.mark.parametrize(("N", "K"), [(2, 2), (1, 3), (3, 2)])
@pytest.mark.parametrize(("in_bits", "out_bits"), [(8, 4), (4, 8)])
@pytest.mark.parametrize("feedback", [0, 32, 16, 8])  # no feedback, or the residual's width
def test_aligned_reduce(N, K, in_bits, out_bits, feedback):
    check_reduce_aligned(DEVICE, N, K, SEGMENTS, 128, in_bits, out_bits, feedback > 0, width=feedback or 32)


@pytest.mark.parametrize(("in_bits", "out_bits"), [(8, 4), (4, 4), (8, 8)])
@pytest.mark.parametrize("feedback", [0, 32, 16, 8])
def test_aligned_reduce_vector_tiles(in_bits, out_bits, feedback):
    check_reduce_aligned(DEVICE, 2, 2, VECTOR[0], VECTOR[1], in_bits, out_bits, feedback > 0, width=feedback or 32)


@pytest.mark.parametrize("bits", [8, 4])
def test_aligned_swizzle_quantize_vector_tiles(bits):
    check_swizzle_aligned(DEVICE, 2, 2, VECTOR[0], VECTOR[1], 2, bits, torch.bfloat16)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width", [32, 16, 8])
def test_reduce_with_feedback_uniform(bits, width):
    check_reduce_aligned(DEVICE, 2, 2, None, 64, 8, bits, True, width=width)


@pytest.mark.slow  # about 17 s each in the interpreter on an AVX2-only CPU
@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_aligned_with_feedback(bits):
    check_stochastic_feedback(DEVICE, (37, 1, 64, 90), 64, bits)


def test_empty():
    buf = tk.quantize(torch.empty(0), 8, 64, backend="triton")
    assert buf.numel() == 0 and tk.dequantize(buf, 0, 8, 64, torch.float32, backend="triton").numel() == 0


def test_kernels_write_every_wire_byte(monkeypatch):
    """The launchers allocate with ``torch.empty`` (no memset pass): the kernels must write the payload padding and
    the scale padding themselves. Poisoned allocations make a byte they skip differ from the twin's zeros."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(0xA5) if t.dtype == torch.uint8 else t.fill_(float("nan"))

    x = torch.randn(3 * 1001, dtype=torch.bfloat16)
    big = torch.randn(2 * 4096, dtype=torch.float16)
    received = tk.quantize(x.view(3, -1).float()[:, :999].contiguous(), 8, 32, backend="torch").view(3, 1, -1)
    odd = tk.Blocks.of_segments([300, 3, 0, 128, 5, 1, 257, 306], 128)  # 1000 elements, INT4 payload 502 bytes
    tiles = tk.Blocks.of_segments([1100, 5, 1, 257, 600, 1037], 512)  # 3000 elements, 11 blocks: 2 tiles of 8
    aligned_received = tk.quantize(x[:2000].view(2, 1000), 8, 128, blocks=odd, backend="torch").view(2, 1, -1)
    vector = tk.Blocks.of_segments(list(VECTOR[0]), VECTOR[1])  # vector tiles, and short blocks' 16-byte padding
    wide = torch.randn(2 * vector.numel)
    vector_received = tk.quantize(wide.view(2, -1), 8, 128, blocks=vector, backend="torch").view(2, 1, -1)

    def outputs(backend: str) -> dict:
        return {
            # large blocks: the data ends exactly at a tile's end, so the padding needs programs of its own
            "large blocks": tk.quantize(big[:2060], 8, 1030, backend=backend),
            "one block": tk.quantize(big[:4096], 4, 4096, backend=backend),
            "quantize": tk.quantize(x, 4, 64, backend=backend),
            "rows": tk.quantize(x.view(3, -1), 8, 32, backend=backend),
            "swizzle": tk.swizzle_quantize(x[:3000], 3, 2, 3, 2, 4, 32, backend=backend),
            "requantize": tk.dequantize_reduce_quantize(received, 999, 8, 4, 32, backend=backend),
            # aligned blocks: program 0 of each row writes the payload and scale padding
            "aligned int8": tk.quantize(x[:1000], 8, 128, blocks=odd, backend=backend),
            "aligned int4 rows": tk.quantize(x[:2000].view(2, -1), 4, 128, blocks=odd, backend=backend),
            "aligned several tiles": tk.quantize(x[:3000], 4, 512, blocks=tiles, backend=backend),
            "aligned swizzle": tk.swizzle_quantize(x[:3000], 3, 1, 2, 1, 4, 128, blocks=odd, backend=backend),
            "aligned requantize": tk.dequantize_reduce_quantize(
                aligned_received, 1000, 8, 4, 128, blocks=odd, residual=torch.zeros(1, 1000), backend=backend
            ),
            "vector int8 rows": tk.quantize(wide.view(2, -1), 8, 128, blocks=vector, backend=backend),
            "vector int4": tk.quantize(wide[: vector.numel], 4, 128, blocks=vector, backend=backend),
            "vector requantize": tk.dequantize_reduce_quantize(
                vector_received, vector.numel, 8, 4, 128, blocks=vector, backend=backend
            ),  # fmt: skip
        }

    want = outputs("torch")
    monkeypatch.setattr(torch, "empty", poisoned)
    got = outputs("triton")
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name}: bytes differ at {(want[name] != got[name]).nonzero()[:8]}"


@pytest.mark.parametrize("by_bits", [True, False], ids=["absmax-by-bits", "absmax-float-nan-max"])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_edge_blocks_with_either_absmax(monkeypatch, by_bits, aligned, bits):
    """The interpreter finds a block's absmax by an integer max of the magnitudes' bits, the compiled kernels by a
    NaN-propagating float max (``_tiles.ABSMAX_BY_BITS``): both, run here in the interpreter, give the twins' codes
    and scales on blocks of NaN, Inf, zeros, subnormals and scales at the smallest normal float."""
    from lightning_zeropp.kernels import _tiles

    monkeypatch.setattr(_tiles, "ABSMAX_BY_BITS", _tiles.tl.constexpr(by_bits))
    check_edge_blocks(DEVICE, bits, aligned)


def test_int4_stochastic_rounding_needs_no_clamp():
    """The kernels round INT4 stochastically as ``floor(y + u)`` without a clamp (``_tiles.quantize_pairs``): with
    ``|y| <= 7 * (1 + 3 * 2**-24)`` and the midpoint uniforms ``(k + 1/2) * 2**-16``, every fp32 ``y + u`` floors into
    [-7, 7]. Every uniform against the largest ``|y|`` fp32 can hold under that bound, then the kernel itself on
    blocks whose largest element scales to exactly +-7."""
    assert Fraction(RECIPROCAL_QMAX[4]) > Fraction(1, 7)  # the bound on |y| below rests on it
    # the bound, checked on a million absmax values (every binade of normal floats): y of a block's largest element
    absmax = torch.ldexp(
        torch.rand(2**20, generator=torch.Generator().manual_seed(1)) + 1.0,
        torch.randint(-125, 127, (2**20,), generator=torch.Generator().manual_seed(2)),
    ).float()
    y = absmax * (1.0 / (absmax * RECIPROCAL_QMAX[4]))  # fp32 throughout, as quantize_pairs
    assert float(y.max()) <= 7 * (1 + 3 * 2**-24)
    u = (torch.arange(2**16, dtype=torch.float64) + 0.5) / 2**16
    u = u.float()
    assert torch.equal(u.double(), (torch.arange(2**16, dtype=torch.float64) + 0.5) / 2**16)  # exact in fp32
    bound = torch.tensor(7 * (1 + 3 * 2**-24), dtype=torch.float64).float()  # rounds to the nearest fp32
    for y in (bound, torch.nextafter(bound, torch.tensor(8.0)), -bound, -torch.nextafter(bound, torch.tensor(8.0))):
        codes = torch.floor(y + u)  # fp32 add, as in the kernel
        assert codes.min() >= -7 and codes.max() <= 7, float(y)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    x[:, 0] = x.abs().amax(1) * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)  # the block's absmax, either sign
    x = x.flatten()
    absmax = x.view(64, 32).abs().amax(1, keepdim=True)
    for seed in range(8):
        wire = tk.quantize(x, 4, 32, stochastic=True, seed=seed, backend="triton")
        back = tk.dequantize(wire, x.numel(), 4, 32, torch.float32, backend="triton").view(64, 32)
        assert torch.all(back.abs() <= absmax * (1 + 1e-6)), "a code past +-7"
