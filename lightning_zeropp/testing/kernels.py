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


def edge_blocks(block: int) -> torch.Tensor:
    """fp32 values, one ``block`` of each kind a block's absmax must tell apart: a quiet NaN, a NaN with the sign and
    a payload set, +Inf, -Inf, NaN beside Inf, every element +-0, only subnormals, a largest magnitude whose scale
    falls just below / exactly at the smallest normal float, magnitudes near the largest float, and ordinary data
    with its largest element negative."""
    g = torch.Generator().manual_seed(block)
    ordinary = lambda: torch.randn(block, generator=g)  # noqa: E731
    tiny = torch.finfo(torch.float32).tiny  # the smallest normal float
    kinds = []
    for special in (float("nan"), torch.tensor(0xFFC12345, dtype=torch.int64).to(torch.int32).view(torch.float32)):
        x = ordinary()
        x[block // 3] = special
        kinds.append(x)
    for special in (float("inf"), -float("inf")):
        x = ordinary()
        x[-1] = special
        kinds.append(x)
    x = ordinary()
    x[0], x[1] = float("inf"), float("nan")
    kinds.append(x)
    zeros = torch.zeros(block)
    zeros[::2] = -0.0
    kinds.append(zeros)
    kinds.append(torch.rand(block, generator=g) * tiny)  # subnormals (and 0)
    for top in (tiny * 127 * (1 - 2**-23), tiny * 127, tiny * 7 * (1 - 2**-23), tiny * 7):
        x = torch.rand(block, generator=g) * top
        x[block // 2] = -top
        kinds.append(x.float())
    kinds.append(torch.rand(block, generator=g) * 3.4e38 - 1.7e38)
    x = ordinary()
    x[block // 4] = -x.abs().max() * 2
    kinds.append(x)
    return torch.cat(kinds).float()


def check_edge_blocks(device: str, bits: int, segments_or_none: bool) -> None:
    """Blocks of :func:`edge_blocks` (NaN, Inf, zeros, subnormals, scales at the smallest normal float, values near
    the largest) through quantize (one row, uniform or parameter-aligned blocks) and the step-3 re-quantization
    (2 rows, INT8 -> ``bits``): kernels against twins, bit for bit."""
    block = 128
    x = edge_blocks(block)
    n = x.numel()
    blocks = tk.Blocks.of_segments([n // 2 - 5, 5, n - n // 2], block) if segments_or_none else None
    where = f"{bits=} aligned={segments_or_none}"
    want = tk.quantize(x, bits, block, blocks=blocks, backend="torch")
    got = tk.quantize(x.to(device), bits, block, blocks=blocks, backend="triton")
    assert _same(want, got), f"quantize edge blocks {where}: {(want != got.cpu()).nonzero()[:8].tolist()}"
    rows = torch.stack([x, x.flip(0)])
    buf = tk.quantize(rows, 8, block, blocks=blocks, backend="torch").view(2, 1, -1)
    want = tk.dequantize_reduce_quantize(buf, n, 8, bits, block, blocks=blocks, backend="torch")
    got = tk.dequantize_reduce_quantize(buf.to(device), n, 8, bits, block, blocks=blocks, backend="triton")
    assert _same(want, got), f"dequantize_reduce_quantize edge blocks {where}"


def check_every_code(device: str, bits: int, segments=None, block: int = 128) -> None:
    """Dequantization of wires whose codes run through every byte value (INT4: every pair of nibbles, -8 included,
    which the quantizers never write but a peer's wire may hold): dequantize (3 rows) and dequantize_reduce (2 and 4
    rows, bf16), kernels against twins. Catches a decode that is exact only on the codes quantization produces."""
    blocks = _blocks(segments, block)
    n = blocks.numel if blocks is not None else 1100
    values = _inputs(4 * n, torch.float32, seed=bits).view(4, n)
    wire = tk.quantize(values, bits, block, blocks=blocks, backend="torch")
    codes = torch.arange(256, dtype=torch.uint8).repeat(4 * n // 256 + 2)[
        torch.randperm(4 * n, generator=torch.Generator().manual_seed(0))
    ]
    if blocks is None:
        spans = [(0, (n * bits + 7) // 8)]
    else:
        offsets = blocks.payload_offsets(bits)
        lengths = [blocks.starts[i + 1] - blocks.starts[i] for i in range(blocks.count)]
        spans = [(offsets[b], offsets[b] + (length * bits + 7) // 8) for b, length in enumerate(lengths)]
    used = 0
    for row in range(4):
        for lo, hi in spans:
            wire[row, lo:hi] = codes[used : used + hi - lo]
            used += hi - lo
    where = f"{bits=} {segments=} {block=}"
    # the decode is the same for every output dtype: plain dequantization into fp32, the sums into bf16
    a = tk.dequantize(wire[:3], n, bits, block, torch.float32, blocks=blocks, backend="torch")
    b = tk.dequantize(wire[:3].to(device), n, bits, block, torch.float32, blocks=blocks, backend="triton")
    assert _same(a, b), f"dequantize every code {where}"
    for rows in (2, 4):
        a = tk.dequantize_reduce(wire[:rows], n, bits, block, dtype=torch.bfloat16, blocks=blocks, backend="torch")
        b = tk.dequantize_reduce(
            wire[:rows].to(device), n, bits, block, dtype=torch.bfloat16, blocks=blocks, backend="triton"
        )
        assert _same(a, b), f"dequantize_reduce every code {where} {rows=}"


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


# ------------------------------------------------------------------------------------------------------------------
# Parameter-aligned blocks (``tk.Blocks``) and error feedback (``residual``, ``decay``)

# With block 128: a segment of several blocks and a tail, a 3-element one, an empty one, exactly one block, a single
# element, one block and one element
SEGMENTS = (300, 3, 0, 128, 5, 1, 257)


def _blocks(segments, block: int) -> tk.Blocks | None:
    return None if segments is None else tk.Blocks.of_segments(list(segments), block)


def _residual(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-3, 1, shape[-1])


def check_aligned_quantize_dequantize(
    device: str, segments, block: int, bits: int, dtype: torch.dtype, rows: int | None = None
) -> None:
    """quantize and dequantize (fresh, into a 2-D and into a flat ``out``) in ``Blocks.of_segments(segments)``."""
    blocks = _blocks(segments, block)
    n = blocks.numel
    x = _inputs((rows or 1) * n, dtype, seed=n + bits + block)
    x = x if rows is None else x.view(rows, n)
    want = tk.quantize(x, bits, block, blocks=blocks, backend="torch")
    got = tk.quantize(x.to(device), bits, block, blocks=blocks, backend="triton")
    where = f"{segments=} {block=} {bits=} {dtype} {rows=}"
    assert torch.equal(want, got.cpu()), f"quantize {where}: {(want != got.cpu()).nonzero()[:8].tolist()}"
    for out_dtype in (torch.float32, torch.bfloat16):
        a = tk.dequantize(want, n, bits, block, out_dtype, blocks=blocks, backend="torch")
        b = tk.dequantize(want.to(device), n, bits, block, out_dtype, blocks=blocks, backend="triton")
        assert _same(a, b), f"dequantize {where} -> {out_dtype}"
        if rows is not None:
            for shape in ((rows, n), (rows * n,)):
                out = torch.full(shape, 7.0, dtype=out_dtype, device=device)
                c = tk.dequantize(want.to(device), n, bits, block, out_dtype, out=out, blocks=blocks, backend="triton")
                assert c is out and _same(a.reshape(shape), out), f"dequantize {where} into {shape} {out_dtype}"


def _residual_in(width: int, rows: torch.Tensor, block: int, blocks: tk.Blocks | None, padded: bool):
    """``rows`` ``(R, n)`` as an error feedback residual of ``width`` bits: ``(residual, scales)``; 8 bits: int8 codes
    (rows padded to 16 bytes when ``padded``, as qgZ keeps them) and their block scales, from the torch twin."""
    if width == 32:
        return rows.clone(), None
    if width == 16:
        return rows.to(torch.bfloat16), None
    R, n = rows.shape
    wire = tk.quantize(rows, 8, block, blocks=blocks, backend="torch")
    count = blocks.count if blocks is not None else -(-n // block)
    so = blocks.scale_offset(8) if blocks is not None else tk.scale_offset(n, 8)
    codes = torch.zeros(R, -(-n // 16) * 16 if padded else n, dtype=torch.int8)[:, :n]
    codes.copy_(wire[:, :n].view(torch.int8))
    return codes, wire[:, so : so + 4 * count].contiguous().view(torch.float32)


def _first_block(blocks: tk.Blocks | None, block: int) -> int:
    return blocks.starts[1] if blocks is not None else block


def check_feedback(
    device: str,
    segments,
    block: int,
    bits: int,
    dtype: torch.dtype,
    rows: int | None = None,
    decay: float = 0.9,
    width: int = 32,
) -> None:
    """quantize with error feedback (in uniform blocks when ``segments`` is None) and a residual of ``width`` bits
    (32, 16, or 8: codes and scales): wire buffer and residual. The first block of the input and of the residual is
    zero, so an 8-bit residual's first block must come back with scale 0 and codes 0."""
    blocks = _blocks(segments, block)
    n = blocks.numel if blocks is not None else 301
    shape = (n,) if rows is None else (rows, n)
    x = _inputs((rows or 1) * n, dtype, seed=n + bits).view(-1, n)
    values = _residual((x.shape[0], n), seed=n)
    first = _first_block(blocks, block)
    x[:, :first], values[:, :first] = 0, 0
    residual, scales = _residual_in(width, values, block, blocks, padded=rows is not None)
    where = f"{segments=} {block=} {bits=} {dtype} {rows=} {width=}"
    results = []
    for backend, dev in (("torch", "cpu"), ("triton", device)):
        r = _moved(residual, dev).view(shape)
        fb = {"residual": r} if scales is None else {"residual": r, "residual_scales": _moved(scales, dev)}
        if scales is not None:
            fb["residual_scales"] = fb["residual_scales"].view(*shape[:-1], -1)
        buf = tk.quantize(x.view(shape).to(dev), bits, block, blocks=blocks, decay=decay, backend=backend, **fb)
        results.append((buf, r, fb.get("residual_scales")))
    (want, r_want, s_want), (got, r_got, s_got) = results
    assert torch.equal(want, got.cpu()), f"quantize with feedback {where}: {(want != got.cpu()).nonzero()[:8]}"
    assert r_got.shape == shape and r_want.shape == shape, f"residual {where}: reshaped"
    assert _same(r_want, r_got), f"residual {where}: {(r_want.float() != r_got.cpu().float()).nonzero()[:8].tolist()}"
    if width == 8:
        assert _same(s_want, s_got), f"residual scales {where}"
        first_scales = s_want.view(-1, s_want.shape[-1])[:, 0]
        assert torch.all(first_scales == 0), f"a zero block's residual scale is not 0 {where}"
        assert torch.all(r_want.view(-1, n)[:, :first] == 0), f"a zero block's residual codes are not 0 {where}"
        assert s_want.isnan().any() or n < 300, f"no NaN block in the residual {where}"


def _moved(t: torch.Tensor, device: str) -> torch.Tensor:
    """A copy of ``t`` on ``device`` with its strides (a padded view stays padded)."""
    if t.dim() < 2 or t.is_contiguous():
        return t.to(device, copy=True)
    full = torch.zeros(t.shape[0], t.stride(0), dtype=t.dtype, device=device)
    full[:, : t.shape[1]].copy_(t)
    return full[:, : t.shape[1]]


def check_swizzle_aligned(device: str, N: int, K: int, segments, block: int, stages: int, bits: int, dtype) -> None:
    blocks = _blocks(segments, block)
    x = _inputs(N * K * blocks.numel, dtype, seed=blocks.numel + N + K)
    for s in range(stages):
        want = tk.swizzle_quantize(x, N, K, stages, s, bits, block, blocks=blocks, backend="torch")
        got = tk.swizzle_quantize(x.to(device), N, K, stages, s, bits, block, blocks=blocks, backend="triton")
        assert torch.equal(want, got.cpu()), f"swizzle_quantize {N=} {K=} {segments=} {stages=} stage {s} {bits=}"


def check_reduce_aligned(
    device: str, N: int, K: int, segments, block: int, in_bits: int, out_bits: int, feedback: bool, width: int = 32
) -> None:
    """dequantize_reduce_quantize (with or without error feedback, a residual of ``width`` bits) and
    dequantize_reduce in ``segments``' blocks (in uniform blocks when None)."""
    blocks = _blocks(segments, block)
    n = blocks.numel if blocks is not None else 301
    values = _inputs(N * K * n, torch.float32, seed=n + K).view(N * K, n)
    buf = tk.quantize(values, in_bits, block, blocks=blocks, backend="torch").view(N, K, -1)
    where = f"{N=} {K=} {segments=} {in_bits}->{out_bits} {width=}"
    fb_want, fb_got = {}, {}
    if feedback:
        residual, scales = _residual_in(width, _residual((K, n), seed=N), block, blocks, padded=True)
        fb_want = {"residual": _moved(residual, "cpu"), "decay": 0.75}
        fb_got = {"residual": _moved(residual, device), "decay": 0.75}
        if scales is not None:
            fb_want["residual_scales"], fb_got["residual_scales"] = scales.clone(), scales.clone().to(device)
    want = tk.dequantize_reduce_quantize(buf, n, in_bits, out_bits, block, blocks=blocks, backend="torch", **fb_want)
    got = tk.dequantize_reduce_quantize(
        buf.to(device), n, in_bits, out_bits, block, blocks=blocks, backend="triton", **fb_got
    )
    assert torch.equal(want, got.cpu()), f"dequantize_reduce_quantize {where}: {(want != got.cpu()).nonzero()[:8]}"
    if feedback:
        assert _same(fb_want["residual"], fb_got["residual"]), f"dequantize_reduce_quantize residual {where}"
        if width == 8:
            assert _same(fb_want["residual_scales"], fb_got["residual_scales"]), f"residual scales {where}"
    for dtype, multiplier in ((torch.float32, 1.0), (torch.bfloat16, 1 / 3)):
        a = tk.dequantize_reduce(
            buf[:, 0], n, in_bits, block, multiplier=multiplier, dtype=dtype, blocks=blocks, backend="torch"
        )
        out = torch.full((n,), 7.0, dtype=dtype, device=device)
        b = tk.dequantize_reduce(
            buf[:, 0].to(device), n, in_bits, block, multiplier=multiplier, out=out, blocks=blocks, backend="triton"
        )
        assert b is out and _same(a, b), f"dequantize_reduce {where} {dtype} x{multiplier}"


def _steps(buf: torch.Tensor, blocks: tk.Blocks, bits: int) -> torch.Tensor:
    """``(R, wire)`` in ``blocks`` -> each element's quantization step (its block's scale), ``(R, numel)``."""
    so = blocks.scale_offset(bits)
    scales = buf[:, so : so + 4 * blocks.count].contiguous().view(torch.float32)
    lengths = torch.tensor(blocks.starts).diff()
    return scales.repeat_interleave(lengths, dim=1)


def check_stochastic_feedback(device: str, segments, block: int, bits: int, trials: int = 32) -> None:
    """Stochastic rounding in aligned blocks with error feedback: every code within one step of ``v`` (the step of
    its block), the residual exactly ``v - dequantized``, unbiased over seeds, reproducible for a seed."""
    blocks = _blocks(segments, block)
    n = blocks.numel
    assert n < 300
    x = torch.stack([_inputs(n, torch.float32, seed=n + i) for i in range(2)])  # below 300 elements: no NaN or Inf
    residual = _residual((2, n), seed=3)
    v = x + 0.5 * residual
    samples = []
    for seed in range(trials):
        r = residual.clone().to(device)
        buf = tk.quantize(x.to(device), bits, block, stochastic=True, seed=seed, blocks=blocks, residual=r,
                          decay=0.5, backend="triton").cpu()  # fmt: skip
        deq = tk.dequantize(buf, n, bits, block, torch.float32, blocks=blocks, backend="torch")
        assert torch.equal(r.cpu(), v - deq), f"residual is not v - dequantized ({seed=})"
        step = _steps(buf, blocks, bits)
        assert torch.all((deq - v).abs() <= step * (1 + 1e-6)), f"a code more than one step from v ({seed=})"
        samples.append(deq)
    step = _steps(tk.quantize(v, bits, block, blocks=blocks, backend="torch"), blocks, bits)  # nearest's scales
    assert torch.all((torch.stack(samples).mean(0) - v).abs() <= 6 * step / (2 * trials**0.5) + 1e-30), "biased"
    a = tk.quantize(x.to(device), bits, block, stochastic=True, seed=5, blocks=blocks, backend="triton")
    b = tk.quantize(x.to(device), bits, block, stochastic=True, seed=5, blocks=blocks, backend="triton")
    assert torch.equal(a, b), "not reproducible"
