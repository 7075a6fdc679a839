"""Every public op of ``lightning_zeropp.kernels`` checks its arguments once, before it dispatches: a bad call fails
with the same exception and the same message on the torch twins and on the Triton launchers (on the CPU under
TRITON_INTERPRET=1), and a good call runs on both with the same result. Then the dispatch itself: ``check_backend``,
and "auto" on CPU tensors without triton."""

import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_zeropp import kernels as tk
from lightning_zeropp.kernels import specs

BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=[
            pytest.mark.triton_interpret,
            pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1",
                reason="the Triton launchers run on the CPU only under TRITON_INTERPRET=1 (set by conftest without a"
                " GPU); test_kernels_gpu.py covers CUDA",
            ),
        ],
    ),
]

N, B = 40, 8  # elements per row, block size
WIRE = tk.wire_size(N, 8, B)
ROW = tk.quantize(torch.randn(N), 8, B, backend="torch")  # (WIRE,)
ROWS = tk.quantize(torch.randn(3, N), 8, B, backend="torch")  # (3, WIRE)
PEERS = ROWS.view(3, 1, WIRE)  # N=3 peers, K=1 piece each
X = torch.randn(N)
CHUNKS = torch.randn(2 * 3 * 10)  # 2 ranks per node x 3 nodes, chunks of 10


def _op(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the backend the test picks, unless the case names one."""
    return lambda backend: fn(*args, **{"backend": backend, **kwargs})


def _q(x=X, bits=8, block_size=B, **kw):
    return _op(tk.quantize, x, bits, block_size, **kw)


def _dq(buf=ROWS, numel=N, bits=8, block_size=B, dtype=torch.float32, **kw):
    return _op(tk.dequantize, buf, numel, bits, block_size, dtype, **kw)


def _sq(x=CHUNKS, ranks_per_node=2, num_nodes=3, stages=2, stage=0, bits=8, block_size=B, **kw):
    return _op(tk.swizzle_quantize, x, ranks_per_node, num_nodes, stages, stage, bits, block_size, **kw)


def _drq(buf=PEERS, numel=N, in_bits=8, out_bits=4, block_size=B, **kw):
    return _op(tk.dequantize_reduce_quantize, buf, numel, in_bits, out_bits, block_size, **kw)


def _dr(buf=ROWS, numel=N, bits=8, block_size=B, **kw):
    return _op(tk.dequantize_reduce, buf, numel, bits, block_size, **kw)


BAD = {
    # quantize
    "quantize: int input": (_q(x=torch.arange(N)), TypeError, r"`x` is a torch.int64 tensor .*use a float32"),
    "quantize: float64 input": (_q(x=X.double()), TypeError, r"`x` is a torch.float64 tensor"),
    "quantize: 3-D input": (_q(x=torch.randn(2, 2, 10)), ValueError, r"shape \(2, 2, 10\).*1-D tensor or 2-D rows"),
    "quantize: 0-D input": (_q(x=torch.tensor(1.0)), ValueError, r"shape \(\).*1-D tensor or 2-D rows"),
    "quantize: a list": (_q(x=[1.0, 2.0]), TypeError, r"`x` must be a torch.Tensor, got list"),
    "quantize: bits 5": (_q(bits=5), ValueError, r"`bits=5` is not supported; use 8 or 4"),
    "quantize: bits 8.0": (_q(bits=8.0), ValueError, r"`bits=8.0` is not supported"),
    "quantize: block 0": (_q(block_size=0), ValueError, r"`block_size=0` is not allowed; use a positive int"),
    "quantize: odd INT4 block": (_q(bits=4, block_size=3), ValueError, r"`block_size=3` is odd.*INT4 packs pairs"),
    "quantize: stochastic 1": (_q(stochastic=1), TypeError, r"`stochastic=1` is not allowed; use True or False"),
    "quantize: seed str": (_q(stochastic=True, seed="7"), TypeError, r"`seed='7'` is not an int"),
    "quantize: seed bool": (_q(seed=True), TypeError, r"`seed=True` is not an int"),
    "quantize: seed negative": (_q(seed=-1), ValueError, r"`seed=-1` is not allowed.*\[0, 2\*\*63\)"),
    "quantize: seed 2**63": (_q(seed=2**63), ValueError, r"`seed=9223372036854775808` is not allowed"),
    "quantize: backend": (_q(backend="cuda"), ValueError, r"`backend='cuda'` is not one of"),
    # error feedback residuals: fp32, bf16, or int8 codes with one fp32 scale per block (N / B = 5 blocks)
    "quantize: fp16 residual": (
        _q(residual=torch.zeros(N, dtype=torch.float16)),
        ValueError,
        r"`residual` is a torch.float16 .*use a float32 or bfloat16 tensor of shape \(40,\).*or int8 codes",
    ),
    "quantize: residual shape": (_q(residual=torch.zeros(N + 1)), ValueError, r"shape \(41,\) on cpu; use a float32"),
    "quantize: int8 without scales": (
        _q(residual=torch.zeros(N, dtype=torch.int8)),
        ValueError,
        r"`residual` is int8 codes but `residual_scales` is missing; pass the float32 scales, shape \(5,\)",
    ),
    "quantize: scales shape": (
        _q(residual=torch.zeros(N, dtype=torch.int8), residual_scales=torch.zeros(4)),
        ValueError,
        r"`residual_scales` is .* shape \(4,\) on cpu; use a float32 tensor of shape \(5,\)",
    ),
    "quantize: scales dtype": (
        _q(residual=torch.zeros(N, dtype=torch.int8), residual_scales=torch.zeros(5, dtype=torch.bfloat16)),
        ValueError,
        r"`residual_scales` is a torch.bfloat16",
    ),
    "quantize: scales with fp32": (
        _q(residual=torch.zeros(N), residual_scales=torch.zeros(5)),
        ValueError,
        r"`residual_scales` is given with a torch.float32 `residual`.*int8 residual only",
    ),
    "quantize: scales alone": (_q(residual_scales=torch.zeros(5)), ValueError, r"given without `residual`"),
    "quantize: overlapping int8 rows": (
        _q(
            x=torch.randn(2, N),
            residual=torch.zeros(N, dtype=torch.int8).expand(2, N),
            residual_scales=torch.zeros(2, 5),
        ),
        ValueError,
        r"strides \(0, 1\); use rows of unit stride that do not overlap",
    ),
    "quantize: strided bf16": (
        _q(x=torch.randn(2, N), residual=torch.zeros(2, 2 * N, dtype=torch.bfloat16)[:, ::2]),
        ValueError,
        r"use a contiguous tensor",
    ),
    # dequantize
    "dequantize: float buffer": (_dq(buf=ROWS.float()), TypeError, r"`buf` is a torch.float32 tensor.*uint8"),
    "dequantize: 3-D buffer": (_dq(buf=PEERS), ValueError, r"`buf` is .* shape \(3, 1, 80\).*1-D row .* 2-D rows"),
    "dequantize: row width": (_dq(numel=100), ValueError, r"`numel=100` .* takes 176 bytes.*= 176 bytes"),
    "dequantize: 31 bytes": (_dq(buf=ROW[:31], numel=4, block_size=4), ValueError, r"takes 32 bytes"),
    "dequantize: numel -1": (_dq(numel=-1), ValueError, r"`numel=-1` is not allowed; use an int >= 0"),
    "dequantize: numel float": (_dq(numel=40.0), TypeError, r"`numel=40.0` is not an int"),
    "dequantize: bits 3": (_dq(bits=3), ValueError, r"`bits=3` is not supported"),
    "dequantize: dtype int": (_dq(dtype=torch.int32), TypeError, r"`dtype=torch.int32` is not allowed"),
    "dequantize: dtype float64": (_dq(dtype=torch.float64), TypeError, r"`dtype=torch.float64` is not allowed"),
    "dequantize: out shape": (
        _dq(out=torch.empty(3, N + 1)),
        ValueError,
        r"`out` is .* shape \(3, 41\).*use shape \(3, 40\) or \(120,\)",
    ),
    "dequantize: 1-D out shape": (_dq(buf=ROW, out=torch.empty(1, N)), ValueError, r"use shape \(40,\)\."),
    "dequantize: out dtype": (
        _dq(out=torch.empty(3, N, dtype=torch.float16)),
        TypeError,
        r"`out` is a torch.float16 .*, but `dtype=torch.float32`; pass dtype=out.dtype",
    ),
    "dequantize: out strides": (_dq(out=torch.empty(N, 3).t()), ValueError, r"strides \(1, 3\); use a contiguous"),
    "dequantize: out device": (_dq(out=torch.empty(3, N, device="meta")), ValueError, r"on meta.*use one device"),
    "dequantize: backend": (_dq(backend="cuda"), ValueError, r"`backend='cuda'`"),
    # swizzle_quantize
    "swizzle_quantize: 2-D": (_sq(x=torch.randn(6, 10)), ValueError, r"shape \(6, 10\).*use a 1-D tensor\."),
    "swizzle_quantize: int": (_sq(x=torch.zeros(60, dtype=torch.int32)), TypeError, r"torch.int32 tensor"),
    "swizzle_quantize: ranks 0": (_sq(ranks_per_node=0), ValueError, r"`ranks_per_node=0` .* use an int >= 1"),
    "swizzle_quantize: nodes -1": (_sq(num_nodes=-1), ValueError, r"`num_nodes=-1` .* use an int >= 1"),
    "swizzle_quantize: nodes float": (_sq(num_nodes=3.0), TypeError, r"`num_nodes=3.0` is not an int"),
    "swizzle_quantize: stages 0": (_sq(stages=0), ValueError, r"`stages=0` .* use an int >= 1"),
    "swizzle_quantize: stage = stages": (_sq(stage=2), ValueError, r"`stage=2` .*0 <= stage < stages=2"),
    "swizzle_quantize: stage -1": (_sq(stage=-1), ValueError, r"`stage=-1` .* use an int >= 0"),
    "swizzle_quantize: chunks": (_sq(x=torch.randn(61)), ValueError, r"not 6 equal chunks.*ranks_per_node \* num"),
    "swizzle_quantize: bits": (_sq(bits=16), ValueError, r"`bits=16` is not supported"),
    "swizzle_quantize: seed": (_sq(stochastic=True, seed=1.5), TypeError, r"`seed=1.5` is not an int"),
    "swizzle_quantize: backend": (_sq(backend="cuda"), ValueError, r"`backend='cuda'`"),
    # dequantize_reduce_quantize
    "dequantize_reduce_quantize: 2-D": (_drq(buf=ROWS), ValueError, r"shape \(3, 80\).*\(N, K, wire\)"),
    "dequantize_reduce_quantize: in_bits": (_drq(in_bits=5), ValueError, r"`in_bits=5` is not supported"),
    "dequantize_reduce_quantize: out_bits": (_drq(out_bits=2), ValueError, r"`out_bits=2` is not supported"),
    "dequantize_reduce_quantize: odd INT4": (_drq(block_size=7), ValueError, r"`block_size=7` is odd"),
    "dequantize_reduce_quantize: width": (_drq(numel=17), ValueError, r"`numel=17` .* takes 48 bytes"),
    "dequantize_reduce_quantize: no peer": (_drq(buf=PEERS[:0]), ValueError, r"pieces from no peer; use N >= 1"),
    "dequantize_reduce_quantize: uint16": (_drq(buf=PEERS.to(torch.int16)), TypeError, r"torch.int16.*uint8"),
    "dequantize_reduce_quantize: seed": (_drq(seed=-3), ValueError, r"`seed=-3` is not allowed"),
    "dequantize_reduce_quantize: flag": (_drq(stochastic="yes"), TypeError, r"`stochastic='yes'`"),
    "dequantize_reduce_quantize: backend": (_drq(backend="cuda"), ValueError, r"`backend='cuda'`"),
    "dequantize_reduce_quantize: scales rows": (
        _drq(residual=torch.zeros(1, N, dtype=torch.int8), residual_scales=torch.zeros(5)),
        ValueError,
        r"use a float32 tensor of shape \(1, 5\)",
    ),
    # dequantize_reduce
    "dequantize_reduce: 1-D": (_dr(buf=ROW), ValueError, r"shape \(80,\) on cpu; use 2-D rows \(M, wire\)"),
    "dequantize_reduce: no rows": (_dr(buf=ROWS[:0]), ValueError, r"no rows to sum; use M >= 1"),
    "dequantize_reduce: width": (_dr(block_size=4), ValueError, r"takes 96 bytes"),
    "dequantize_reduce: nan": (_dr(multiplier=float("nan")), ValueError, r"`multiplier=nan` .* finite float"),
    "dequantize_reduce: inf": (_dr(multiplier=float("inf")), ValueError, r"`multiplier=inf`"),
    "dequantize_reduce: str": (_dr(multiplier="0.5"), ValueError, r"`multiplier='0.5'`"),
    "dequantize_reduce: bool": (_dr(multiplier=True), ValueError, r"`multiplier=True`"),
    "dequantize_reduce: out rows": (_dr(out=torch.empty(3, N)), ValueError, r"shape \(3, 40\).*use shape \(40,\)"),
    "dequantize_reduce: out long": (_dr(out=torch.empty(N + 1)), ValueError, r"use shape \(40,\)"),
    "dequantize_reduce: out int": (_dr(out=torch.empty(N, dtype=torch.int32)), TypeError, r"use a float32"),
    "dequantize_reduce: out strides": (_dr(out=torch.empty(2 * N)[::2]), ValueError, r"use a contiguous tensor"),
    "dequantize_reduce: dtype vs out": (
        _dr(out=torch.empty(N), dtype=torch.float16),
        TypeError,
        r"`out` is a torch.float32 .*, but `dtype=torch.float16`",
    ),
    "dequantize_reduce: dtype int": (_dr(dtype=torch.int8), TypeError, r"`dtype=torch.int8` .*\(or None\)"),
    "dequantize_reduce: out device": (_dr(out=torch.empty(N, device="meta")), ValueError, r"use one device"),
    "dequantize_reduce: backend": (_dr(backend="cuda"), ValueError, r"`backend='cuda'`"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("case", "call", "error", "match"), [(k, *v) for k, v in BAD.items()], ids=BAD.keys())
def test_a_bad_call_fails_alike_on_every_backend(case, call, error, match, backend):
    with pytest.raises(error, match=match) as got:
        call(backend)
    assert str(got.value).startswith(f"lightning_zeropp.kernels.{case.split(':')[0]}: "), got.value
    with pytest.raises(Exception) as twin:
        call("torch")
    assert (type(got.value), str(got.value)) == (type(twin.value), str(twin.value))


GOOD = {
    "quantize strided bf16 rows": (_q(x=torch.randn(3, 2 * N).bfloat16()[:, ::2]), True),
    "quantize 1-D fp16 INT4": (_q(x=X.half(), bits=4), True),
    "quantize empty": (_q(x=torch.empty(0)), True),
    "quantize stochastic, largest seed": (_q(stochastic=True, seed=2**63 - 1), False),  # other noise streams
    "dequantize 1-D": (_dq(buf=ROW, dtype=torch.bfloat16), True),
    "dequantize into rows": (_dq(out=torch.empty(3, N)), True),
    "dequantize into a flat out": (_dq(out=torch.empty(3 * N, dtype=torch.float16), dtype=torch.float16), True),
    "swizzle_quantize last stage INT4": (_sq(stage=1, bits=4), True),
    "swizzle_quantize one rank": (_sq(x=torch.randn(10), ranks_per_node=1, num_nodes=1, stages=1), True),
    "dequantize_reduce_quantize": (_drq(), True),
    "dequantize_reduce_quantize INT8 -> INT8, seed 0": (_drq(out_bits=8, seed=0), True),
    "dequantize_reduce into out": (_dr(multiplier=0.25, out=torch.empty(N, dtype=torch.bfloat16)), True),
    "dequantize_reduce int multiplier, fp16": (_dr(multiplier=3, dtype=torch.float16), True),
    "dequantize_reduce no elements": (_dr(buf=ROWS[:, :0], numel=0), True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("call", "exact"), GOOD.values(), ids=GOOD.keys())
def test_a_good_call_runs_alike_on_every_backend(call, exact, backend):
    got = call(backend).clone()  # a call with `out` returns it: keep this result before the twin overwrites it
    want = call("torch").clone()
    assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, want.device)
    if exact:
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------------------------
# The dispatch: check_backend, interpreting, and "auto" without triton


def test_interpreting_reads_the_environment(monkeypatch):
    for value, expected in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert tk.interpreting() is expected
    monkeypatch.delenv("TRITON_INTERPRET")
    assert tk.interpreting() is False


@pytest.mark.parametrize("device", ["cpu", "cuda", "meta", torch.device("cuda", 1)])
def test_check_backend_auto_and_torch_run_anywhere(device):
    tk.check_backend("auto", device)
    tk.check_backend("torch", device)


def test_check_backend_names_kernel_backend():
    with pytest.raises(ValueError, match=r"`kernel_backend='cuda'` is not one of \('auto', 'triton', 'torch'\)"):
        tk.check_backend("cuda", "cpu")


def test_check_backend_triton_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for device in ("cpu", torch.device("cpu"), "meta"):
        with pytest.raises(ValueError, match=r'`kernel_backend="triton"` needs CUDA devices, but got a \w+ device'):
            tk.check_backend("triton", device)
    with pytest.raises(ValueError, match=r'`backend="triton"` needs CUDA tensors, but got a cpu tensor.*TRITON_INT'):
        tk.quantize(X, 8, B, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"got a meta device"):
        tk.check_backend("triton", "meta")


def test_check_backend_triton_passes_where_it_runs():
    pytest.importorskip("triton")
    tk.check_backend("triton", "cuda")  # imports the launchers; needs no GPU
    if tk.interpreting():
        tk.check_backend("triton", "cpu")


def _run(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # a fresh interpreter importing torch
def test_auto_on_cpu_never_loads_the_triton_launchers():
    """Without TRITON_INTERPRET, CPU tensors take the twins and the Triton side of the package is never imported
    (Lightning itself may import triton: what matters is that our launchers and compat.triton are not)."""
    out = _run(
        """
        import sys
        import torch
        from lightning_zeropp import kernels as tk
        x = torch.randn(100)
        y = tk.dequantize(tk.quantize(x, 8, 32), 100, 8, 32, torch.float32)
        assert torch.equal(y, tk.dequantize(tk.quantize(x, 8, 32, backend="torch"), 100, 8, 32, torch.float32))
        print(sorted(m for m in sys.modules if m.startswith("lightning_zeropp.") and "triton" in m))
        try:
            tk.quantize(x, 8, 32, backend="triton")
        except ValueError as err:
            print(err)
        """
    )
    loaded, refusal = out.splitlines()
    assert loaded == "[]"
    assert '`backend="triton"` needs CUDA tensors, but got a cpu tensor' in refusal


@pytest.mark.slow  # a fresh interpreter importing torch
def test_without_triton_auto_runs_and_triton_says_why():
    """Where triton cannot be imported (it installs on Linux x86-64 only): the package imports, "auto" and "torch"
    run on the CPU, and asking for "triton" raises ImportError with the reason."""
    out = _run(
        """
        import sys
        sys.modules["triton"] = None  # what an absent triton looks like to an import
        import torch
        from lightning_zeropp import kernels as tk
        x = torch.randn(100)
        tk.dequantize(tk.quantize(x, 4, 32), 100, 4, 32, torch.bfloat16)
        tk.check_backend("auto", "cuda")
        tk.check_backend("torch", "cuda")
        for call in (lambda: tk.check_backend("triton", "cuda"), lambda: tk.quantize(x, 8, 32, backend="triton")):
            try:
                call()
            except ImportError as err:
                print(err)
        """,
        TRITON_INTERPRET="1",
    )
    for line, name in zip(out.splitlines(), ("kernel_backend", "backend"), strict=True):
        assert f'`{name}="triton"` needs the triton package (' in line and 'use "torch"' in line, line


SPECS = {
    tk.quantize: ("x", specs.QuantizeSpec),
    tk.dequantize: ("buf", specs.DequantizeSpec),
    tk.swizzle_quantize: ("x", specs.SwizzleQuantizeSpec),
    tk.dequantize_reduce_quantize: ("buf", specs.DequantizeReduceQuantizeSpec),
    tk.dequantize_reduce: ("buf", specs.DequantizeReduceSpec),
}


@pytest.mark.parametrize("op", SPECS, ids=[op.__name__ for op in SPECS])
def test_each_op_takes_its_tensor_its_spec_and_backend(op):
    """The spec declares the op's arguments: the op's signature (for help and documentation) is the spec's, and an
    argument the spec lacks is refused before anything runs."""
    tensor, spec = SPECS[op]
    fields = [f.name for f in dataclasses.fields(spec)]
    assert list(inspect.signature(op).parameters) == [tensor, *inspect.signature(spec).parameters, "backend"]
    assert sorted(inspect.signature(spec).parameters) == sorted(fields)
    assert spec.name == op.__name__
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        op(torch.zeros(8), colour=1)
