"""The pure-torch quantizer (the wire format's specification): error bounds, layout, edge cases, fused qgZ ops."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from lightning_zeropp import kernels as tk
from lightning_zeropp.kernels import reference as ref
from lightning_zeropp.kernels.specs import QuantizeSpec

SIZES = [1, 2, 127, 257, 4231]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _blocks_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element: the absmax of its block (computed here independently, with a loop over blocks)."""
    out = torch.empty(x.numel())
    xf = x.float()
    for start in range(0, x.numel(), block):
        out[start : start + block] = xf[start : start + block].abs().max()
    return out


@pytest.mark.parametrize(("bits", "block", "n", "dtype"), itertools.product([8, 4], [8, 64, 256], SIZES, DTYPES))
def test_round_trip_error_within_half_a_step(bits, block, n, dtype):
    torch.manual_seed(n)
    x = (torch.randn(n) * torch.logspace(-3, 2, n)).to(dtype)  # blocks of very different scales
    buf = tk.quantize(x, bits, block)
    assert buf.dtype == torch.uint8 and buf.numel() == tk.wire_size(n, bits, block) and buf.numel() % 16 == 0
    y = tk.dequantize(buf, n, bits, block, torch.float32)
    step = _blocks_absmax(x, block) / tk.QMAX[bits]
    err = (x.float() - y).abs()
    slack = 4 * torch.finfo(torch.float32).eps * x.float().abs()  # fp32 rounding of x / scale and q * scale
    assert torch.all(err <= step / 2 + slack), f"max excess {(err - step / 2 - slack).max()}"
    assert tk.dequantize(buf, n, bits, block, dtype).dtype == dtype


def test_empty_input():
    buf = tk.quantize(torch.empty(0), 8, 64)
    assert buf.numel() == 0 and tk.dequantize(buf, 0, 8, 64, torch.float32).numel() == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_blocks_are_exact_and_nonfinite_blocks_are_nan(bits):
    x = torch.tensor([0.0] * 8 + [1.0, 2.0, float("nan"), 3.0] + [0.5, float("inf"), 1.0, 2.0] + [-4.0, 1.0, 0.0, 2.0])
    x = torch.cat([x, -torch.ones(3) * float("inf"), torch.tensor([1.0])])
    y = tk.dequantize(tk.quantize(x, bits, 4), x.numel(), bits, 4, torch.float32)
    assert torch.equal(y[:8], torch.zeros(8))
    assert torch.isnan(y[8:12]).all() and torch.isnan(y[12:16]).all() and torch.isnan(y[20:24]).all()
    assert torch.isfinite(y[16:20]).all() and y[16] == -4.0


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_quantize_lost_is_the_dequantized_wires_error_bit_for_bit(bits, stochastic, in_place):
    """What error feedback keeps: ``lost`` from the codes before packing equals ``x - dequantize(wire)``, in every
    bit, for zero, subnormal, Inf and NaN blocks and a short tail, also when ``lost`` is ``x`` itself."""
    torch.manual_seed(bits)
    x = torch.randn(3, 75) * torch.rand(3, 75) ** 3
    x[0, :8] = 0.0  # a zero block
    x[0, 8:16] *= 1e-40  # a block whose scale is below the smallest normal: codes 0
    x[1, 3], x[2, 20] = float("inf"), float("nan")
    wire = ref._quantize_uniform(x, bits, 8, stochastic=stochastic, seed=5)
    expected = x - ref._dequantize_f32(wire, 75, bits, 8)
    lost = x.clone() if in_place else torch.full_like(x, 7.0)
    source = lost if in_place else x.clone()
    wire2 = ref._quantize_uniform(source, bits, 8, stochastic=stochastic, seed=5, lost=lost)
    assert torch.equal(wire2, wire)
    assert torch.equal(lost.view(torch.int32), expected.view(torch.int32))  # NaNs included, bit for bit
    assert torch.isnan(lost[1, :8]).all() and torch.equal(lost[0, :8], torch.zeros(8))


def test_int8_layout_and_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, 3.0, 0.0])  # absmax 127 -> scale exactly 1
    buf = tk.quantize(x, 8, 8)
    q = buf[:8].view(torch.int8).tolist()
    assert q == [0, 2, 2, 0, -2, 127, 3, 0]
    assert buf[16:20].view(torch.float32).item() == 1.0 and buf.numel() == 32


def test_int4_packing_order():
    x = torch.tensor([7.0, -7.0, 3.0, 0.0, 1.0])  # block 4: scale 1; tail block [1.0]: scale 1/7
    buf = tk.quantize(x, 4, 4)
    assert buf[0].item() == 0x97  # element 0 (7) low nibble, element 1 (-7 = 0b1001) high nibble
    assert buf[1].item() == 0x03
    assert buf[2].item() == 0x07  # the tail element alone, high nibble padding 0
    assert buf[16:20].view(torch.float32).item() == 1.0
    assert tk.payload_bytes(5, 4) == 3 and tk.scale_offset(5, 4) == 16 and tk.wire_size(5, 4, 4) == 32


def test_deterministic_and_rows_are_independent():
    torch.manual_seed(0)
    x = torch.randn(5, 300)
    rows = tk.quantize(x, 4, 64)
    assert rows.shape == (5, tk.wire_size(300, 4, 64))
    for i in range(5):
        assert torch.equal(rows[i], tk.quantize(x[i], 4, 64))
    assert torch.equal(rows, tk.quantize(x.clone(), 4, 64))
    assert torch.equal(
        tk.dequantize(rows, 300, 4, 64, torch.float32)[2], tk.dequantize(rows[2], 300, 4, 64, torch.float32)
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    torch.manual_seed(1)
    n, block, trials = 512, 64, 2000
    x = torch.randn(n)
    step = _blocks_absmax(x, block) / tk.QMAX[bits]
    samples = torch.stack(
        [tk.dequantize(tk.quantize(x, bits, block, stochastic=True, seed=s), n, bits, block, torch.float32)
         for s in range(trials)]
    )  # fmt: skip
    slack = 4 * torch.finfo(torch.float32).eps * x.abs()
    assert torch.all((samples - x).abs() <= step + slack)  # never more than one step away
    # each sample's error is within one step, so the mean of `trials` has std <= step / (2 sqrt(trials))
    assert torch.all((samples.mean(0) - x).abs() <= 6 * step / (2 * trials**0.5))
    nearest = tk.dequantize(tk.quantize(x, bits, block), n, bits, block, torch.float32)
    assert (samples.mean(0) - x).abs().mean() < (nearest - x).abs().mean() / 5  # nearest is biased, this is not
    assert not torch.equal(samples[0], samples[1])
    assert torch.equal(
        tk.quantize(x, bits, block, stochastic=True, seed=7), tk.quantize(x, bits, block, stochastic=True, seed=7)
    )


# ----------------------------------------------------------------------------- qgZ slot order and fused ops
def _naive_order(N, K):
    order = []
    for local in range(N):  # slots grouped by the local peer they go to ...
        for node in range(K):  # ... holding the chunks of the ranks with that local rank, node by node
            order.append(node * N + local)
    return order


@pytest.mark.parametrize(("N", "K"), [(1, 1), (2, 2), (2, 3), (4, 2), (3, 5), (8, 1), (1, 4)])
def test_swizzle_order_matches_naive_loop(N, K):
    assert tk.swizzle_order(N, K) == _naive_order(N, K)


def test_swizzle_paper_example():
    # 2 nodes x 2 ranks: [0, 1, 2, 3] -> [0, 2, 1, 3] ([0, X, 1, X+1] with X = 2)
    assert tk.swizzle_order(2, 2) == [0, 2, 1, 3]


@pytest.mark.parametrize(("C", "S", "B"), [(10, 1, 4), (10, 3, 2), (2, 3, 2), (0, 2, 8), (7, 7, 1), (1000, 4, 64)])
def test_stage_bounds_cover_the_chunk_in_whole_blocks(C, S, B):
    covered = []
    for s in range(S):
        start, size = tk.stage_bounds(C, S, s, B)
        assert start % B == 0, "a piece must start on a block boundary"
        assert size % B == 0 or start + size == C, "only the chunk's last piece may end inside a block"
        covered.extend(range(start, start + size))
    assert covered == list(range(C))


@pytest.mark.parametrize(("N", "K", "C", "S"), [(2, 2, 37, 2), (2, 3, 300, 3), (4, 1, 5, 1)])
def test_swizzle_quantize_is_gather_then_quantize(N, K, C, S):
    torch.manual_seed(0)
    W = N * K
    x = torch.randn(W * C)
    for s in range(S):
        start, size = tk.stage_bounds(C, S, s, 16)
        pieces = torch.stack([x[j * C + start : j * C + start + size] for j in _naive_order(N, K)])
        assert torch.equal(tk.swizzle_quantize(x, N, K, S, s, 8, 16), ref.quantize(pieces, QuantizeSpec(8, 16)))


def test_dequantize_reduce_quantize_and_dequantize_reduce():
    torch.manual_seed(0)
    N, K, n = 3, 2, 301
    vals = torch.randn(N, K, n)
    buf = tk.quantize(vals.view(N * K, n), 8, 32).view(N, K, -1)
    deq = tk.dequantize(buf.view(N * K, -1), n, 8, 32, torch.float32).view(N, K, n)
    summed = deq[0] + deq[1] + deq[2]
    assert torch.equal(tk.dequantize_reduce_quantize(buf, n, 8, 4, 32), tk.quantize(summed, 4, 32))
    out = torch.empty(n, dtype=torch.bfloat16)
    tk.dequantize_reduce(buf[:, 0], n, 8, 32, multiplier=0.25, out=out)
    assert torch.equal(out, (summed[0] * 0.25).to(torch.bfloat16))


@pytest.mark.parametrize("width", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("aligned", [False, True])
def test_step3_feedback_takes_the_k_rows_at_once_as_one_at_a_time(width, aligned):
    """qgZ step 3 with error feedback re-quantizes its K rows in one pass on the CPU (as without feedback); every
    row's wire, residual and residual scales are bit for bit those of the row taken alone with its residual row,
    over three steps, with a zero row, a non-finite entry and a short tail block."""
    torch.manual_seed(3)
    N, K, n = 2, 3, 301
    blocks = tk.Blocks.of_segments([5, 200, 96], 32) if aligned else None
    count = blocks.count if aligned else ref.num_blocks(n, 32)
    dtype = {"int8": torch.int8, "bf16": torch.bfloat16, "fp32": torch.float32}[width]
    together = torch.zeros(K, n, dtype=dtype)
    scales = torch.zeros(K, count) if width == "int8" else None
    alone = [together[k : k + 1].clone() for k in range(K)]
    alone_scales = [scales[k : k + 1].clone() if scales is not None else None for k in range(K)]
    for step in range(3):
        vals = torch.randn(N, K, n) * 10.0**-step
        vals[:, 1] = 0.0 if step == 1 else vals[:, 1]
        if step == 2:
            vals[0, 2, 7] = float("inf")
        buf = tk.quantize(vals.view(N * K, n), 8, 32, blocks=blocks).view(N, K, -1)
        extra = {} if scales is None else {"residual_scales": scales}
        wire = tk.dequantize_reduce_quantize(buf, n, 8, 4, 32, blocks=blocks, residual=together, **extra)
        for k in range(K):
            extra = {} if scales is None else {"residual_scales": alone_scales[k]}
            row = tk.dequantize_reduce_quantize(buf[:, k : k + 1], n, 8, 4, 32, blocks=blocks, residual=alone[k],
                                                **extra)  # fmt: skip
            assert torch.equal(wire[k : k + 1], row), (step, k)
            assert torch.equal(together[k : k + 1].view(torch.uint8), alone[k].view(torch.uint8)), (step, k)
            if scales is not None:
                assert torch.equal(scales[k : k + 1].view(torch.int32), alone_scales[k].view(torch.int32)), (step, k)
    assert together[0].float().abs().sum() > 0  # the residual carried something (row 2 holds the Inf block's NaN)


_PEAK_SCRIPT = r"""
import sys, torch
from lightning_zeropp.kernels import reference as ref
from lightning_zeropp.kernels.layout import Blocks
from lightning_zeropp.kernels.specs import DequantizeSpec, QuantizeSpec

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

rows, n = 4, 400_003
blocks = Blocks.of_segments([7, 100_001, 1, 299_994], 128)
x = torch.randn(rows, n, dtype=torch.bfloat16)
spec = QuantizeSpec(bits=8, block_size=128, blocks=blocks)
wire = ref.quantize(x, spec)
out = torch.empty(rows * n, dtype=torch.bfloat16)
peaks = []
for call in (lambda: ref.quantize(x, spec),
             lambda: ref.dequantize(wire, DequantizeSpec(numel=n, bits=8, block_size=128, blocks=blocks,
                                                         dtype=torch.bfloat16, out=out))):
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak resident set to the current one
    before = status("VmRSS")
    call()
    peaks.append(status("VmHWM") - before)
print(" ".join(str(p) for p in peaks))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_cpu_twins_hold_one_rows_temporaries_not_all_rows():
    """The CPU path quantizes and dequantizes W independent rows one at a time: its peak above the inputs and outputs
    stays a few fp32 rows (measured: 3.7 of them; all 4 rows at once failed this test), so the planner's memory holds
    on CPU runs too."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], env=env, capture_output=True, text=True, check=True)
    row_fp32 = 4 * 400_003
    quantize_peak, dequantize_peak = (int(v) for v in out.stdout.split())
    assert quantize_peak < 5 * row_fp32, (quantize_peak / row_fp32, dequantize_peak / row_fp32)
    assert dequantize_peak < 5 * row_fp32, (quantize_peak / row_fp32, dequantize_peak / row_fp32)
