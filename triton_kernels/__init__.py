"""Quantization kernels for ZeRO++ and the one dispatch point between Triton and the pure-torch twins.

Every public op takes ``backend``: ``"auto"`` runs Triton on CUDA tensors and the torch twin elsewhere; ``"torch"``
always runs the twin; ``"triton"`` always runs Triton (on a CPU tensor only under ``TRITON_INTERPRET=1``).
Importing this package never imports triton.

Each op's arguments after its input tensor are declared once, as a spec (``specs``: a frozen dataclass per op, with
the defaults and the checks). The op builds its spec from the call and checks it all before it dispatches, with one
message per fault (the argument, its value, what is allowed); the twin (``reference``) and the launcher
(``triton_ops``) take ``(tensor, spec)`` and only ever see valid calls, so a call fails the same way on every backend
and device, and neither repeats the signature.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Literal

import torch

from . import reference
from .layout import (
    QMAX,
    RECIPROCAL_QMAX,
    Blocks,
    cut_pieces,
    payload_bytes,
    scale_offset,
    stage_bounds,
    swizzle_order,
    wire_size,
)
from .specs import (
    DequantizeReduceQuantizeSpec,
    DequantizeReduceSpec,
    DequantizeSpec,
    QuantizeSpec,
    SwizzleQuantizeSpec,
)

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET`` set and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_backend(backend: str, device: torch.device | str) -> None:
    """Raises unless the ops can run with ``backend`` on tensors of ``device``; ``"auto"`` and ``"torch"`` always can.

    Args:
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (the strategy's ``kernel_backend``).
        device: where the tensors will live.

    Raises:
        ValueError: ``backend`` is not one of the three, or is ``"triton"`` on a device Triton does not run on (only
            CUDA; the CPU only under ``TRITON_INTERPRET=1``).
        ImportError: ``backend`` is ``"triton"`` and triton cannot be imported (the message says why).
    """
    where = "lightning_zeropp.kernels"
    _check_backend_name(where, "kernel_backend", backend)
    if backend == "triton":
        device_type = torch.device(device).type
        if not _triton_runs_on(device_type):
            raise ValueError(_refusal(where, "kernel_backend", "device", device_type))
        _triton_ops(where, "kernel_backend")


def _check_backend_name(op: str, name: str, backend: object) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"{op}: `{name}={backend!r}` is not one of {_BACKENDS}.")


def _triton_runs_on(device_type: str) -> bool:
    return device_type == "cuda" or (device_type == "cpu" and interpreting())


def _refusal(op: str, name: str, what: str, device_type: str) -> str:
    return (
        f'{op}: `{name}="triton"` needs CUDA {what}s, but got a {device_type} {what} (on the CPU, Triton runs only'
        ' under TRITON_INTERPRET=1, set before triton is imported); use "auto" or "torch".'
    )


def _triton_ops(op: str, name: str):
    try:
        from . import triton_ops
    except ImportError as err:  # triton is a Linux x86-64 dependency only
        raise ImportError(
            f'{op}: `{name}="triton"` needs the triton package ({err}); install it or use "torch".'
        ) from err
    return triton_ops


def _impl(op: str, backend: Backend, device: torch.device):
    """The module whose functions implement the ops on ``device`` under ``backend`` (already checked)."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return reference
    if not _triton_runs_on(device.type):
        raise ValueError(_refusal(op, "backend", "tensor", device.type))
    return _triton_ops(op, "backend")


# ------------------------------------------------------------------------------------------------------------------
# The ops: each takes its input tensor, its spec's arguments (``specs``: declared, documented and checked there) and
# ``backend``


def _signature_of(spec: type):
    """Gives a public op the signature it accepts, for ``help`` and documentation: its tensor, ``spec``'s fields,
    then ``backend``."""

    def decorate(fn):
        signature = inspect.signature(fn)
        tensor, _, backend, _ = signature.parameters.values()
        fields = inspect.signature(spec).parameters.values()
        fn.__signature__ = signature.replace(parameters=[tensor, *fields, backend])
        return fn

    return decorate


# Called as ``observer(tensor, spec)`` after every op, in the order added: the compile gate's step capture
# (``lightning_zeropp.testing.capture``) records what the Triton launchers would launch for each call a training
# step makes. Empty otherwise.
observers: list[Callable[[torch.Tensor, object], None]] = []


def _run(tensor: torch.Tensor, spec, backend: Backend) -> torch.Tensor:
    """Checks the call in full, then runs it on the implementation ``backend`` picks for ``tensor``'s device."""
    op = spec.op
    _check_backend_name(op, "backend", backend)
    spec.check(tensor)
    impl = _impl(op, backend, tensor.device)
    out = getattr(impl, spec.name)(tensor, spec)
    for observe in observers:
        observe(tensor, spec)
    return out


@_signature_of(QuantizeSpec)
def quantize(x: torch.Tensor, *args, backend: Backend = "auto", **kwargs) -> torch.Tensor:
    """Block-quantizes ``x`` to a uint8 wire buffer (``layout`` describes the format).

    Args:
        x: fp32, bf16 or fp16; 1-D (one row, returns ``(wire,)``) or 2-D (each row quantized on its own, returns
            ``(rows, wire)``).
        bits, block_size, stochastic, seed, blocks, residual, decay: see :class:`~.specs.QuantizeSpec`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
    """
    return _run(x, QuantizeSpec(*args, **kwargs), backend)


@_signature_of(DequantizeSpec)
def dequantize(buf: torch.Tensor, *args, backend: Backend = "auto", **kwargs) -> torch.Tensor:
    """Inverse of :func:`quantize`.

    Args:
        buf: the wire buffer: ``(wire,)`` (returns ``(numel,)``) or ``(rows, wire)`` (returns ``(rows, numel)``).
        numel, bits, block_size, dtype, out, blocks: see :class:`~.specs.DequantizeSpec`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
    """
    return _run(buf, DequantizeSpec(*args, **kwargs), backend)


@_signature_of(SwizzleQuantizeSpec)
def swizzle_quantize(x: torch.Tensor, *args, backend: Backend = "auto", **kwargs) -> torch.Tensor:
    """qgZ step 1, fused: piece ``stage`` of each of the W = N*K chunks of ``x``, in swizzled slot order, quantized.

    Args:
        x: fp32, bf16 or fp16, 1-D, W equal chunks (``numel == N * K * chunk``).
        ranks_per_node, num_nodes, stages, stage, bits, block_size, stochastic, seed, blocks: see
            :class:`~.specs.SwizzleQuantizeSpec`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``(W, wire_size(piece))``: rows ``[l*K, (l+1)*K)`` are for local peer ``l``.
    """
    return _run(x, SwizzleQuantizeSpec(*args, **kwargs), backend)


@_signature_of(DequantizeReduceQuantizeSpec)
def dequantize_reduce_quantize(buf: torch.Tensor, *args, backend: Backend = "auto", **kwargs) -> torch.Tensor:
    """qgZ step 3, fused: K pieces from each of N peers, dequantized, summed over the peers in fp32, re-quantized.

    Args:
        buf: ``(N, K, wire_size(numel, in_bits, block_size))`` uint8, N >= 1.
        numel, in_bits, out_bits, block_size, stochastic, seed, blocks, residual, decay: see
            :class:`~.specs.DequantizeReduceQuantizeSpec`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``(K, wire_size(numel, out_bits, block_size))``.
    """
    return _run(buf, DequantizeReduceQuantizeSpec(*args, **kwargs), backend)


@_signature_of(DequantizeReduceSpec)
def dequantize_reduce(buf: torch.Tensor, *args, backend: Backend = "auto", **kwargs) -> torch.Tensor:
    """qgZ step 5, fused: the fp32 sum of M dequantized rows times ``multiplier``, rounded once to the output dtype.

    Args:
        buf: ``(M, wire_size(numel, bits, block_size))`` uint8, M >= 1.
        numel, bits, block_size, multiplier, out, dtype, blocks: see :class:`~.specs.DequantizeReduceSpec`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
    """
    return _run(buf, DequantizeReduceSpec(*args, **kwargs), backend)


__all__ = [
    "QMAX",
    "RECIPROCAL_QMAX",
    "Backend",
    "Blocks",
    "check_backend",
    "cut_pieces",
    "dequantize",
    "dequantize_reduce",
    "dequantize_reduce_quantize",
    "interpreting",
    "payload_bytes",
    "quantize",
    "scale_offset",
    "stage_bounds",
    "swizzle_order",
    "swizzle_quantize",
    "wire_size",
]
