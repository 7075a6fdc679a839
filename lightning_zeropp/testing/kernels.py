"""Bit-exactness checks of the Triton kernels against the torch twins, shared by the interpreter tests (CPU under
``TRITON_INTERPRET=1``), the GPU tests and projects that ship their own build of the kernels.

Each check takes the device to run on; inputs are made on the CPU (so both devices see the same values) and moved.
Inputs span ten decades of magnitude and, above 300 elements, hold a NaN, an Inf, a -Inf and a block of zeros.
"""

from __future__ import annotations

import torch

from lightning_zeropp import kernels as tk

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 127, 4231)


def _inputs(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-4, 3, n)[torch.randperm(n, generator=g)]
    if n > 300:  # a block with NaN, one with Inf, one of zeros, one with -Inf
        x[5], x[260] = float("nan"), float("inf")
        x[512:768] = 0.0
        x[-3] = -float("inf")
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN included."""
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def check_quantize_dequantize(device: str, n: int, bits: int, block: int, dtype: torch.dtype) -> None:
    x = _inputs(n, dtype, seed=n + bits + block)
    want = tk.quantize(x, bits, block, backend="torch")
    got = tk.quantize(x.to(device), bits, block, backend="triton")
    assert _same(want, got), f"quantize {n=} {bits=} {block=} {dtype}: {(want != got.cpu()).nonzero()[:8].tolist()}"
    for out_dtype in DTYPES:
        a = tk.dequantize(want, n, bits, block, out_dtype, backend="torch")
        b = tk.dequantize(want.to(device), n, bits, block, out_dtype, backend="triton")
        assert _same(a, b), f"dequantize {n=} {bits=} {block=} -> {out_dtype}"


def check_rows(device: str) -> None:
    x = _inputs(3 * 300, torch.bfloat16, 3).view(3, 300)
    assert _same(tk.quantize(x, 4, 64, backend="torch"), tk.quantize(x.to(device), 4, 64, backend="triton"))


def check_swizzle_quantize(device: str, N: int, K: int, chunk: int, stages: int, bits: int) -> None:
    x = _inputs(N * K * chunk, torch.float32, seed=chunk)
    for s in range(stages):
        want = tk.swizzle_quantize(x, N, K, stages, s, bits, 32, backend="torch")
        got = tk.swizzle_quantize(x.to(device), N, K, stages, s, bits, 32, backend="triton")
        assert _same(want, got), f"swizzle_quantize {N=} {K=} {chunk=} {stages=} stage {s} {bits=}"


def check_reduce(device: str, N: int, K: int, n: int, in_bits: int, out_bits: int) -> None:
    values = _inputs(N * K * n, torch.float32, seed=n).view(N * K, n)
    buf = tk.quantize(values, in_bits, 32, backend="torch").view(N, K, -1)
    want = tk.dequantize_reduce_quantize(buf, n, in_bits, out_bits, 32, backend="torch")
    got = tk.dequantize_reduce_quantize(buf.to(device), n, in_bits, out_bits, 32, backend="triton")
    assert _same(want, got), f"dequantize_reduce_quantize {N=} {K=} {n=} {in_bits}->{out_bits}"
    for dtype in DTYPES:
        for multiplier in (1.0, 0.25, 1 / 3):
            a = tk.dequantize_reduce(buf[:, 0], n, in_bits, 32, multiplier=multiplier, dtype=dtype, backend="torch")
            b = tk.dequantize_reduce(
                buf[:, 0].to(device), n, in_bits, 32, multiplier=multiplier, dtype=dtype, backend="triton"
            )
            assert _same(a, b), f"dequantize_reduce {N=} {n=} {in_bits=} {dtype} x{multiplier}"


def check_stochastic(device: str, bits: int) -> None:
    """Statistically: unbiased like the twin (the random streams differ by design: Philox in-kernel vs torch)."""
    n, block, trials = 256, 64, 300
    x = _inputs(n, torch.float32, 11).to(device)
    step = torch.stack([x[i : i + block].abs().max().expand(min(block, n - i)) for i in range(0, n, block)])
    step = step.flatten() / tk.QMAX[bits]
    samples = torch.stack(
        [tk.dequantize(tk.quantize(x, bits, block, stochastic=True, seed=s, backend="triton"), n, bits, block,
                       torch.float32, backend="triton") for s in range(trials)]
    )  # fmt: skip
    assert torch.all((samples - x).abs() <= step * (1 + 1e-6) + 1e-30)
    assert torch.all((samples.mean(0) - x).abs() <= 6 * step / (2 * trials**0.5))
    a = tk.quantize(x, bits, block, stochastic=True, seed=5, backend="triton")
    assert _same(a, tk.quantize(x, bits, block, stochastic=True, seed=5, backend="triton"))  # reproducible
    assert not _same(a, tk.quantize(x, bits, block, stochastic=True, seed=6, backend="triton"))
