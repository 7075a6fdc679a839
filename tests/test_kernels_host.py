"""The launchers' host work per call: a shape's launch metadata (row formats, tiling, grid, device tables,
constexprs, index width) is worked out once, and a later call of that shape launches exactly what a fresh one would.
Recorded, not run (``compat.triton.record_launches``): no kernel executes. No time is measured here (a test never
times: ``benchmarks/host_cost.py`` does)."""

import pytest
import torch

from lightning_zeropp import kernels as tk
from lightning_zeropp.kernels import _launch, dequantize_kernel, quantize_kernel, requantize_kernel, triton_ops

compat = pytest.importorskip("lightning_zeropp.compat.triton")

N, K, B = 2, 2, 64


def _calls():
    """One call of each op a training step makes (the spec built and checked as the public op does), at a shape
    of ``n`` elements (uniform or parameter-aligned blocks)."""

    def make(n: int, aligned: bool):
        x = torch.randn(n, dtype=torch.bfloat16)
        blocks = tk.Blocks.of_segments([n // 3, 1, n - n // 3 - 1], B) if aligned else None
        q8 = tk.quantize(x, 8, B, blocks=blocks, backend="torch")
        g = torch.randn(n * N * K, dtype=torch.bfloat16)
        recv = tk.quantize(torch.randn(N * K, n), 8, B, blocks=blocks, backend="torch").view(N, K, -1)
        rail = tk.quantize(torch.randn(K, n), 4, B, blocks=blocks, backend="torch")
        specs = tk.specs
        return [
            ("quantize", x, specs.QuantizeSpec(8, B, blocks=blocks)),
            ("dequantize", q8, specs.DequantizeSpec(n, 8, B, torch.bfloat16, blocks=blocks)),
            ("swizzle_quantize", g, specs.SwizzleQuantizeSpec(N, K, 1, 0, 8, B)),
            ("dequantize_reduce_quantize", recv, specs.DequantizeReduceQuantizeSpec(n, 8, 4, B, blocks=blocks)),
            ("dequantize_reduce", rail, specs.DequantizeReduceSpec(n, 4, B, dtype=torch.bfloat16, blocks=blocks)),
        ]

    return make


def _plain(value):
    """A launch argument as something comparable: a tensor by what Triton specializes on, a value as itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.data_ptr() % 16 == 0)
    return value


def _launches(name, tensor, spec):
    with compat.record_launches() as launches:
        getattr(triton_ops, name)(tensor, spec)
    assert len(launches) == 1
    kernel, args, kwargs, grid = launches[0]
    return kernel, [_plain(a) for a in args], kwargs, grid


def _forget_every_shape(calls):
    """Starts from nothing: the uniform shapes forgotten (the aligned ones live on the calls' new ``Blocks``)."""
    _launch._UNIFORM_LAUNCHES.clear()


@pytest.mark.parametrize("aligned", [False, True], ids=["uniform", "parameter-aligned"])
def test_a_shape_is_tiled_once_and_later_calls_launch_what_a_fresh_call_would(monkeypatch, aligned):
    calls = _calls()(300, aligned)
    _forget_every_shape(calls)
    tiled = []
    for module in (quantize_kernel, dequantize_kernel, requantize_kernel):
        real = module.tiling

        def counting(*args, _real=real, **kwargs):
            tiled.append(args[:2])
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "tiling", counting)
    fresh = [_launches(*c) for c in calls]
    assert len(tiled) == len(calls)  # each op's shape tiled once
    again = [_launches(*c) for c in calls]
    assert len(tiled) == len(calls)  # and never again
    assert again == fresh
    # another size is another shape: tiled anew, and launched differently
    other = _calls()(520, aligned)
    changed = [_launches(*c) for c in other]
    assert len(tiled) == 2 * len(calls)
    assert all(a[2:] != b[2:] or a[1] != b[1] for a, b in zip(changed, fresh))


def test_what_is_kept_per_shape_holds_no_tensor_of_a_call():
    """The cache keeps grids, sizes and the device tables it made; never a caller's tensor (which it would keep
    alive, and hand to the next call of the shape)."""
    calls = _calls()(300, False)
    _forget_every_shape(calls)
    for c in calls:
        _launches(*c)
    held = [id(t) for shape in _launch._UNIFORM_LAUNCHES.values() for t in (*shape.head, *shape.tail)]
    for _, tensor, _ in calls:
        assert id(tensor) not in held


def test_the_uniform_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_launch, "_UNIFORM_LIMIT", 3)
    _launch._UNIFORM_LAUNCHES.clear()
    for n in range(64, 64 + 8 * 16, 16):
        _launches("quantize", torch.randn(n), tk.specs.QuantizeSpec(8, B))
        assert len(_launch._UNIFORM_LAUNCHES) <= 3


def test_the_plain_integer_helpers_agree_with_tritons():
    triton = pytest.importorskip("triton")
    for n in range(1, 5000):
        assert _launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 4096):
            assert _launch.cdiv(n, d) == triton.cdiv(n, d)


def test_recording_leaves_tritons_classes_as_it_found_them():
    """The launch is replaced for the block only: compiled kernels' ``run`` and interpreted kernels' ``[grid]`` (their
    own method before Triton 3.7, inherited after) are Triton's again afterwards."""
    jit, interpreted = compat.JITFunction, compat.InterpretedFunction
    before = jit.run, dict(interpreted.__dict__).get("__getitem__")
    with compat.record_launches():
        assert jit.run is not before[0]
    with compat.stub_launches():
        pass
    assert (jit.run, dict(interpreted.__dict__).get("__getitem__")) == before
