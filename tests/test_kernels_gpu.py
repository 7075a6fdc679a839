"""The kernel checks of test_kernels.py on a CUDA device (bit-exact against the torch twins computed on the CPU)."""

import itertools

import pytest
import torch

from lightning_zeropp.testing.kernels import (
    DTYPES,
    SEGMENTS,
    check_edge_blocks,
    check_every_code,
    check_feedback,
    check_quantize_dequantize,
    check_reduce,
    check_reduce_aligned,
    check_rows,
    check_stochastic,
    check_swizzle_quantize,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; the CPU runs test_kernels.py"),
]
DEVICE = "cuda"


@pytest.mark.parametrize(
    ("n", "bits", "block", "dtype"), itertools.product([1, 127, 4231, 257, 1 << 20], [8, 4], [64, 256], DTYPES)
)
def test_quantize_dequantize(n, bits, block, dtype):
    check_quantize_dequantize(DEVICE, n, bits, block, dtype)


def test_rows():
    check_rows(DEVICE)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", [(None, 128), (None, 64), ((1030, 3, 1040, 1, 6, 8199), 128)])
def test_every_code_dequantizes_as_the_twin(bits, layout):
    check_every_code(DEVICE, bits, *layout)


@pytest.mark.parametrize(("N", "K", "chunk", "stages"), [(2, 2, 37, 2), (8, 4, 4097, 2), (4, 2, 33, 3), (1, 4, 20, 1)])
@pytest.mark.parametrize("bits", [8, 4])
def test_swizzle_quantize(N, K, chunk, stages, bits):
    check_swizzle_quantize(DEVICE, N, K, chunk, stages, bits)


@pytest.mark.parametrize(("N", "K", "n"), [(2, 2, 37), (8, 4, 100_003), (1, 1, 5)])
@pytest.mark.parametrize(("in_bits", "out_bits"), [(8, 4), (4, 4), (8, 8)])
def test_reduce(N, K, n, in_bits, out_bits):
    check_reduce(DEVICE, N, K, n, in_bits, out_bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding(bits):
    check_stochastic(DEVICE, bits)


@pytest.mark.parametrize("segments", [None, SEGMENTS])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width", [32, 16, 8])  # the error feedback residual: fp32, bf16, INT8 codes and block scales
def test_feedback(segments, bits, width):
    check_feedback(DEVICE, segments, 128, bits, torch.float32, None, width=width)
    check_feedback(DEVICE, segments, 128, bits, torch.bfloat16, 3, width=width)
    check_reduce_aligned(DEVICE, 4, 2, segments, 128, 8, bits, True, width=width)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_edge_blocks(aligned, bits):
    """The compiled kernels' NaN-propagating float absmax (``FMNMX.NAN``) on NaN, Inf, zeros, subnormals and scales at
    the smallest normal float, against the twins."""
    check_edge_blocks(DEVICE, bits, aligned)
