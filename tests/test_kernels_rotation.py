"""The rotated specializations of the Triton kernels (``rotation_seed``: ``_rotated``) against the torch twins, bit for
bit: on the CPU under TRITON_INTERPRET=1 (small sizes: the interpreter is slow), and the same checks on a CUDA device
when there is one (``gpu``).

Every layout a rotated tile meets: uniform blocks (a row's full tiles, its last masked tile), parameter-aligned blocks
(vector runs, a padded layout's masked sub-tiles, a packed layout), block sizes that are not powers of two (blocks
rotated in pieces), one thread per block and several (the butterflies across threads); INT8 and INT4; error feedback
with fp32, bf16 and INT8 residuals. Stochastic rounding draws its noise in the kernel (Philox), the twin from torch:
there the rotated kernel is checked against the plain kernel on the twin's rotation of its input (the same noise, by
the same counters), bit for bit, and the residual against the twin's inverse rotation of what was sent."""

import os

import pytest
import torch

from lightning_zeropp import kernels as tk
from lightning_zeropp.kernels import reference as ref
from lightning_zeropp.testing.kernels import SEGMENTS, edge_blocks

pytestmark = [pytest.mark.version_sensitive, pytest.mark.matrix]  # matrix: the fast tier covers each value (conftest)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param(
        "cpu",
        marks=[
            pytest.mark.triton_interpret,
            pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)"),
        ],
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a CUDA device; the CPU runs the interpreter"
            ),
        ],
    ),
]
SEED = 0x9E3779B97F4A7C15 % 2**63  # above 2**32: the kernels take the seed's low 32 bits, as the twins

# (segments or None, block, n for uniform blocks): uniform blocks with a masked last tile (and, at 4231 / 64, full
# tiles), SEGMENTS (tails, a 3-element, an empty, a 1-element parameter), a run of vector tiles (VECTOR: 32 whole
# blocks at starts that are multiples of 16), a packed layout (block 2), and blocks that are not a power of two
UNIFORM = (None, 128, 301)
FULL_TILES = (None, 64, 4231)
ALIGNED = (SEGMENTS, 128, None)
VECTOR = ((1030, 3, 1040, 1, 6, 8199), 128, None)
PACKED = ((7, 2, 5, 1), 2, None)
ODD_UNIFORM = (None, 100, 257)
ODD_ALIGNED = ((300, 7, 1, 93), 96, None)
UNPADDED = ((300, 7, 1, 93, 2), 100, None)  # parameter-aligned blocks in a packed layout, blocks of several threads
LARGE = (None, 512, 1300)  # 4 threads per block: the butterflies of the top two strides cross threads


def _blocks(layout):
    segments, block, n = layout
    blocks = None if segments is None else tk.Blocks.of_segments(list(segments), block)
    return blocks, block, (n if blocks is None else blocks.numel)


def _inputs(rows: int, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Heavy-tailed rows over ten decades (what rotation is for); above 300 elements a NaN, an Inf and zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-4, 3, n)[torch.randperm(n, generator=g)]
    if n > 300:
        x[0, 5], x[-1, 260] = float("nan"), float("inf")
        x[:, 128:200] = 0.0
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN included (any NaN: the twins and kernels may carry different payloads)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def _residual(width: int, rows: int, n: int, block: int, blocks) -> dict:
    """An error feedback residual of ``width`` bits for ``rows`` rows of ``n`` (int8: codes in rows padded to 16
    bytes, as qgZ keeps them, and their scales)."""
    values = torch.randn(rows, n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-3, 1, n)
    if width == 32:
        return {"residual": values, "decay": 0.9}
    if width == 16:
        return {"residual": values.to(torch.bfloat16), "decay": 0.9}
    count = blocks.count if blocks is not None else -(-n // block)
    codes = torch.zeros(rows, -(-n // 16) * 16, dtype=torch.int8)[:, :n]
    codes.copy_(torch.randint(-127, 128, (rows, n), generator=torch.Generator().manual_seed(1), dtype=torch.int8))
    return {"residual": codes, "residual_scales": torch.rand(rows, count) * 1e-2, "decay": 0.9}


def _moved(feedback: dict, device: str) -> dict:
    """A copy of the residual's tensors on ``device`` (a padded int8 view stays padded)."""
    out = {}
    for key, t in feedback.items():
        if not isinstance(t, torch.Tensor):
            out[key] = t
        elif t.dim() == 2 and not t.is_contiguous():
            full = torch.zeros(t.shape[0], t.stride(0), dtype=t.dtype, device=device)
            full[:, : t.shape[1]].copy_(t)
            out[key] = full[:, : t.shape[1]]
        else:
            out[key] = t.to(device, copy=True)
    return out


def _check_residuals(want: dict, got: dict, where: str) -> None:
    for key in ("residual", "residual_scales"):
        if key in want:
            assert _same(want[key], got[key]), f"{key} {where}"


# ------------------------------------------------------------------------------------------------------------------
# The checks (each op against its twin)


def check_quantize(device, layout, bits, width=0, rows=2, dtype=torch.float32):
    blocks, block, n = _blocks(layout)
    x = _inputs(rows, n, n + bits, dtype)
    fb = _residual(width, rows, n, block, blocks) if width else {}
    fb_want, fb_got = _moved(fb, "cpu"), _moved(fb, device)
    want = tk.quantize(x, bits, block, blocks=blocks, rotation_seed=SEED, backend="torch", **fb_want)
    got = tk.quantize(x.to(device), bits, block, blocks=blocks, rotation_seed=SEED, backend="triton", **fb_got)
    where = f"{layout=} {bits=} {width=} {dtype}"
    assert torch.equal(want, got.cpu()), f"quantize {where}: {(want != got.cpu()).nonzero()[:8].tolist()}"
    _check_residuals(fb_want, fb_got, where)


def check_requantize(device, layout, N, K, in_bits, out_bits, width=0):
    blocks, block, n = _blocks(layout)
    buf = tk.quantize(_inputs(N * K, n, n + N), in_bits, block, blocks=blocks, backend="torch").view(N, K, -1)
    fb = _residual(width, K, n, block, blocks) if width else {}
    fb_want, fb_got = _moved(fb, "cpu"), _moved(fb, device)
    args = (n, in_bits, out_bits, block)
    want = tk.dequantize_reduce_quantize(buf, *args, blocks=blocks, rotation_seed=SEED, backend="torch", **fb_want)
    got = tk.dequantize_reduce_quantize(buf.to(device), *args, blocks=blocks, rotation_seed=SEED, backend="triton",
                                        **fb_got)  # fmt: skip
    where = f"{layout=} {N=} {K=} {in_bits}->{out_bits} {width=}"
    assert torch.equal(want, got.cpu()), f"dequantize_reduce_quantize {where}: {(want != got.cpu()).nonzero()[:8]}"
    _check_residuals(fb_want, fb_got, where)


def check_dequantize_reduce(device, layout, M, bits, dtype, multiplier, into_out=False):
    blocks, block, n = _blocks(layout)
    buf = tk.quantize(_inputs(M, n, n + M), bits, block, blocks=blocks, rotation_seed=SEED, backend="torch")
    kwargs = dict(blocks=blocks, rotation_seed=SEED, multiplier=multiplier)
    want = tk.dequantize_reduce(buf, n, bits, block, dtype=dtype, backend="torch", **kwargs)
    if into_out:
        out = torch.full((n,), 7.0, dtype=dtype, device=device)
        got = tk.dequantize_reduce(buf.to(device), n, bits, block, out=out, backend="triton", **kwargs)
        assert got is out
    else:
        got = tk.dequantize_reduce(buf.to(device), n, bits, block, dtype=dtype, backend="triton", **kwargs)
    assert _same(want, got), f"dequantize_reduce {layout=} {M=} {bits=} {dtype} x{multiplier} {into_out=}"


def _unrotated_sent(wire, n, bits, block, blocks):
    """What each row's receiver gets back, in the rows' coordinates: the twin's un-rotation of its dequantization."""
    return ref._rotate_rows(ref._dequantize_rows(wire.cpu(), n, bits, block, blocks), block, blocks, SEED, True)


def check_stochastic(device, layout, bits, width=0, requantize=False):
    """Stochastic rounding (noise from Philox in the kernel): the rotated kernel's wire is the plain kernel's for the
    twin's rotation of the same values, with the same seed (the same counters), bit for bit; the residual is the
    values less the twin's un-rotation of what was sent, bit for bit."""
    blocks, block, n = _blocks(layout)
    rows = 2
    x = _inputs(rows, n, n + bits)
    x[~torch.isfinite(x)] = 0.0  # the checks below compare finite residuals
    fb = _residual(width, rows, n, block, blocks) if width else {}
    fb_got = _moved(fb, device)
    noise = dict(stochastic=True, seed=12345)
    if requantize:
        buf = tk.quantize(x, 8, block, blocks=blocks, backend="torch").view(1, rows, -1)
        got = tk.dequantize_reduce_quantize(buf.to(device), n, 8, bits, block, blocks=blocks, rotation_seed=SEED,
                                            backend="triton", **noise, **fb_got)  # fmt: skip
        values = ref._sum_dequantized(buf, n, 8, block, blocks)
    else:
        got = tk.quantize(x.to(device), bits, block, blocks=blocks, rotation_seed=SEED, backend="triton", **noise,
                          **fb_got)  # fmt: skip
        values = x.clone()
    if width:
        values = values + ref._decayed_residual(fb["residual"], fb.get("residual_scales"), block, blocks, fb["decay"])
    rotated = ref._rotate_rows(values, block, blocks, SEED, False)
    plain = tk.quantize(rotated.to(device), bits, block, blocks=blocks, backend="triton", **noise)
    where = f"{layout=} {bits=} {width=} {requantize=}"
    assert torch.equal(plain.cpu(), got.cpu()), f"stochastic {where}: {(plain.cpu() != got.cpu()).nonzero()[:8]}"
    if width:
        lost = values - _unrotated_sent(got, n, bits, block, blocks)
        stored = {"residual": torch.empty_like(fb["residual"]).copy_(fb["residual"])}
        if "residual_scales" in fb:
            stored["residual_scales"] = fb["residual_scales"].clone()
        ref._store_residual(lost, stored["residual"], stored.get("residual_scales"), block, blocks)
        _check_residuals(stored, fb_got, where)


# ------------------------------------------------------------------------------------------------------------------
# The tests

LAYOUTS = [UNIFORM, FULL_TILES, ALIGNED, PACKED, ODD_UNIFORM, ODD_ALIGNED, UNPADDED, LARGE]
SLOW_LAYOUTS = [VECTOR]  # 10279 elements: seconds in the interpreter


@pytest.mark.parametrize("device", DEVICES)
def test_sign_table_is_the_twins(device):
    from lightning_zeropp.kernels._rotated import rotation_table

    for block in (1, 2, 7, 96, 128, 1000):
        table = rotation_table(SEED, block, device).cpu()
        signs = ref.rotation_signs(SEED, block)
        assert torch.equal(table[:block], signs), block
        pieces = torch.tensor([size for offset, size in ref.rotation_pieces(block) for _ in range(size)])
        assert torch.equal(table[block:], signs / pieces), block


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS + [pytest.param(v, marks=pytest.mark.slow) for v in SLOW_LAYOUTS])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize(device, layout, bits):
    if bits == 4 and layout[1] % 2:
        pytest.skip("INT4 needs an even block size")
    check_quantize(device, layout, bits, rows=2, dtype=torch.bfloat16 if bits == 4 else torch.float32)
    check_quantize(device, layout, bits, rows=1, dtype=torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "layout", [UNIFORM, ALIGNED, ODD_ALIGNED, UNPADDED, pytest.param(VECTOR, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width", [32, 16, 8])  # the residual: fp32, bf16, INT8 codes with block scales
def test_quantize_with_feedback(device, layout, bits, width):
    check_quantize(device, layout, bits, width, rows=2, dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("in_bits", "out_bits"), [(8, 4), (4, 4), (4, 8), (8, 8)])
def test_requantize(device, layout, in_bits, out_bits):
    if 4 in (in_bits, out_bits) and layout[1] % 2:
        pytest.skip("INT4 needs an even block size")
    check_requantize(device, layout, 2, 2, in_bits, out_bits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("N", "K"), [(1, 3), (3, 2), (5, 1)])  # 5 rows: half a block per thread
@pytest.mark.parametrize("layout", [UNIFORM, ALIGNED])
@pytest.mark.parametrize("width", [0, 32, 16, 8])
def test_requantize_rows_and_feedback(device, N, K, layout, width):
    check_requantize(device, layout, N, K, 8, 4, width)


@pytest.mark.slow  # seconds each in the interpreter
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [0, 8])
def test_requantize_vector_tiles(device, width):
    check_requantize(device, VECTOR, 2, 2, 8, 4, width)
    check_requantize(device, VECTOR, 5, 1, 4, 4, width)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS + [pytest.param(v, marks=pytest.mark.slow) for v in SLOW_LAYOUTS])
@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_reduce(device, layout, bits):
    if bits == 4 and layout[1] % 2:
        pytest.skip("INT4 needs an even block size")
    check_dequantize_reduce(device, layout, 2, bits, torch.float32, 1.0)
    check_dequantize_reduce(device, layout, 3, bits, torch.bfloat16, 1 / 3, into_out=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M", [1, 4, 6])  # 6 rows: half a block per thread
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_reduce_rows_and_dtypes(device, M, dtype):
    check_dequantize_reduce(device, ALIGNED, M, 4, dtype, 0.125, into_out=True)
    check_dequantize_reduce(device, UNIFORM, M, 4, dtype, 1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [UNIFORM, ALIGNED, PACKED, ODD_ALIGNED])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width", [0, 32, 8])
def test_stochastic_rounding(device, layout, bits, width):
    if bits == 4 and layout[1] % 2:
        pytest.skip("INT4 needs an even block size")
    check_stochastic(device, layout, bits, width)
    check_stochastic(device, layout, bits, width, requantize=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("by_bits", [True, False], ids=["absmax-by-bits", "absmax-float-nan-max"])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_edge_blocks(device, monkeypatch, by_bits, aligned, bits):
    """NaN, Inf, zeros, subnormals, scales at the smallest normal float, values near the largest (``edge_blocks``),
    rotated: a non-finite element makes its whole piece non-finite (Inf - Inf), so its block NaN; the kernels as the
    twins, with either absmax (``_tiles.ABSMAX_BY_BITS``; compiled, only the float one)."""
    if device == "cpu":
        from lightning_zeropp.kernels import _tiles

        monkeypatch.setattr(_tiles, "ABSMAX_BY_BITS", _tiles.tl.constexpr(by_bits))
    elif by_bits:
        pytest.skip("the compiled kernels find the absmax by a float max only")
    x = edge_blocks(128)
    n = x.numel()
    segments = (n // 2 - 5, 5, n - n // 2) if aligned else None
    layout = (segments, 128, n)
    blocks, block, n = _blocks(layout)
    want = tk.quantize(x, bits, block, blocks=blocks, rotation_seed=SEED, backend="torch")
    got = tk.quantize(x.to(device), bits, block, blocks=blocks, rotation_seed=SEED, backend="triton")
    assert torch.equal(want, got.cpu()), f"quantize {layout=} {bits=}"
    buf = tk.quantize(torch.stack([x, x.flip(0)]), 8, block, blocks=blocks, backend="torch").view(2, 1, -1)
    want = tk.dequantize_reduce_quantize(buf, n, 8, bits, block, blocks=blocks, rotation_seed=SEED, backend="torch")
    got = tk.dequantize_reduce_quantize(buf.to(device), n, 8, bits, block, blocks=blocks, rotation_seed=SEED,
                                        backend="triton")  # fmt: skip
    assert torch.equal(want, got.cpu()), f"dequantize_reduce_quantize {layout=} {bits=}"
    wire = tk.quantize(torch.stack([x, x.flip(0)]), bits, block, blocks=blocks, rotation_seed=SEED, backend="torch")
    want = tk.dequantize_reduce(wire, n, bits, block, blocks=blocks, rotation_seed=SEED, backend="torch")
    got = tk.dequantize_reduce(wire.to(device), n, bits, block, blocks=blocks, rotation_seed=SEED, backend="triton")
    assert _same(want, got), f"dequantize_reduce {layout=} {bits=}"


@pytest.mark.parametrize("device", DEVICES)
def test_kernels_write_every_wire_byte(device, monkeypatch):
    """The rotated quantizers write the payload's and the scales' padding themselves (no memset): poisoned
    allocations make a byte they skip differ from the twin's zeros."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(0xA5) if t.dtype == torch.uint8 else t

    blocks = tk.Blocks.of_segments([300, 3, 0, 128, 5, 1, 257, 306], 128)  # INT4 payload of 502 bytes
    x = _inputs(2, blocks.numel, 3)
    received = tk.quantize(x, 8, 128, blocks=blocks, backend="torch").view(2, 1, -1)

    def outputs(backend: str, dev: str) -> dict:
        return {
            "uniform": tk.quantize(x[:, :999].contiguous().to(dev), 4, 64, rotation_seed=SEED, backend=backend),
            "aligned": tk.quantize(x.to(dev), 4, 128, blocks=blocks, rotation_seed=SEED, backend=backend),
            "requantize": tk.dequantize_reduce_quantize(received.to(dev), blocks.numel, 8, 4, 128, blocks=blocks,
                                                        rotation_seed=SEED, backend=backend),
        }  # fmt: skip

    want = outputs("torch", "cpu")
    monkeypatch.setattr(torch, "empty", poisoned)
    got = outputs("triton", device)
    for name in want:
        assert torch.equal(want[name], got[name].cpu()), f"{name}: {(want[name] != got[name].cpu()).nonzero()[:8]}"


GATE = "tests/test_compile_gate.py::test_every_configuration_compiles_for_sm80_and_sm90"


@pytest.mark.slow  # a subprocess compiling the rotated variants: minutes when cold
def test_rotated_kernels_compile_with_the_installed_triton(request):
    """The rotated specializations compile for sm_90 with the Triton that is installed, not only with the one the
    compile gate (tests/test_compile_gate.py) ran: the interpreter runs none of the compiler's checks, and the
    rotated kernels once passed every interpreter test and the gate on Triton 3.9 but failed to compile on 3.5 and
    3.6 (a ``jit`` helper's result used as a constexpr). This module is ``version_sensitive``, so ``.ci/oldest.sh``
    runs this on the oldest Triton the project allows. One launch per kernel and variant (layout, rounding, residual
    width, threads per block), from the strategy's own launches (``aot.strategy_launches``). Where the gate's check
    of every sm_90 specialization runs in the same session (the full suite), it compiles each of these with this same
    Triton, so this one would only repeat its cold compiles."""
    if any(item.nodeid == GATE for item in request.session.items):
        pytest.skip(f"{GATE} compiles every rotated specialization for sm_90 in this session, with this Triton")
    import subprocess
    import sys

    code = """
from lightning_zeropp.kernels import aot
seen, bad = set(), []
for launch in aot.unique_launches(aot.strategy_launches()):
    k = launch.kwargs
    if not k.get("ROTATE"):
        continue
    variant = (launch.kernel.__name__, k.get("ALIGNED"), k.get("STOCHASTIC"), k.get("FEEDBACK"), k.get("L"))
    if variant in seen:
        continue
    seen.add(variant)
    c = aot.compile_launch(launch, 90)
    if c.error or c.registers <= 0:
        bad.append(f"{variant} [{c.label}]: {c.error[-600:]}")
print("compiled", len(seen))
print("\\n".join(bad))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled, *bad = done.stdout.strip().splitlines()
    assert int(compiled.split()[1]) >= 12 and not bad, done.stdout[-4000:]
