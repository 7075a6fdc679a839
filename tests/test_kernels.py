"""Triton kernels on the CPU under TRITON_INTERPRET=1, bit for bit against the torch twins (small sizes: the
interpreter is slow). The same checks run on CUDA in test_kernels_gpu.py."""

import itertools
import os

import pytest
import torch

from lightning_zeropp import kernels as tk
from lightning_zeropp.testing.kernels import (
    DTYPES,
    SIZES,
    check_quantize_dequantize,
    check_reduce,
    check_rows,
    check_stochastic,
    check_swizzle_quantize,
)

pytestmark = [
    pytest.mark.triton_interpret,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)"
    ),
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


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding(bits):
    check_stochastic(DEVICE, bits)


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

    def outputs(backend: str) -> dict:
        return {
            # large blocks: the data ends exactly at a tile's end, so the padding needs programs of its own
            "large blocks": tk.quantize(big[:2060], 8, 1030, backend=backend),
            "one block": tk.quantize(big[:4096], 4, 4096, backend=backend),
            "quantize": tk.quantize(x, 4, 64, backend=backend),
            "rows": tk.quantize(x.view(3, -1), 8, 32, backend=backend),
            "swizzle": tk.swizzle_quantize(x[:3000], 3, 2, 3, 2, 4, 32, backend=backend),
            "requantize": tk.dequantize_reduce_quantize(received, 999, 8, 4, 32, backend=backend),
        }

    want = outputs("torch")
    monkeypatch.setattr(torch, "empty", poisoned)
    got = outputs("triton")
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name}: bytes differ at {(want[name] != got[name]).nonzero()[:8]}"
