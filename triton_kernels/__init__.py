"""Quantization kernels for ZeRO++ and the one dispatch point between Triton and the pure-torch twins.

Every public op takes ``backend``: ``"auto"`` runs Triton on CUDA tensors and the torch twin elsewhere; ``"torch"``
always runs the twin; ``"triton"`` always runs Triton (on a CPU tensor only under ``TRITON_INTERPRET=1``).
Importing this package never imports triton.

Every op checks all its arguments here, before it dispatches, with one message per fault (the argument, its value,
what is allowed). The twins (``reference``) and the launchers (``triton_ops``) only ever see valid calls, so a call
fails the same way on every backend and device, and the check is written once.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Literal

import torch

from . import reference
from .layout import QMAX, Blocks, check_format, payload_bytes, scale_offset, stage_bounds, swizzle_order, wire_size

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOATS = "float32, bfloat16 or float16"
_SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes any seed below it; the kernels reduce it mod 2**31 - 1


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
# Argument checks: each raises for one fault, naming the argument, its value and what is allowed


def _describe(t: torch.Tensor) -> str:
    return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tensor(op: str, name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}.")


def _check_float_input(op: str, name: str, x: object, ranks: tuple[int, ...]) -> None:
    _check_tensor(op, name, x)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: `{name}` is {_describe(x)}; use a {_FLOATS} tensor.")
    if x.dim() not in ranks:
        allowed = "a 1-D tensor" if ranks == (1,) else "a 1-D tensor or 2-D rows"
        raise ValueError(f"{op}: `{name}` is {_describe(x)}; use {allowed}.")


def _check_wire(
    op: str, buf: object, rank: tuple[int, ...], layout: str, numel: int, bits: int, block: int, blocks=None
) -> None:
    """``buf``: uint8, ``rank`` dimensions (``layout`` names them), rows of ``wire_size(numel, bits, block)`` bytes
    (or ``blocks.wire_size(bits)``)."""
    _check_tensor(op, "buf", buf)
    if buf.dtype != torch.uint8:
        raise TypeError(f"{op}: `buf` is {_describe(buf)}; use the uint8 wire buffer quantize returns.")
    if buf.dim() not in rank:
        raise ValueError(f"{op}: `buf` is {_describe(buf)}; use {layout}.")
    if blocks is not None:
        expected = blocks.wire_size(bits)
        if buf.shape[-1] != expected:
            raise ValueError(
                f"{op}: `buf` is {_describe(buf)}, but a row of {blocks} at {bits} bits takes {expected} bytes; use"
                f" rows of blocks.wire_size(bits) = {expected} bytes (the buffer quantize returned with these blocks)."
            )
        return
    expected = wire_size(numel, bits, block)
    if buf.shape[-1] != expected:
        raise ValueError(
            f"{op}: `buf` is {_describe(buf)}, but a row of `numel={numel}` elements at {bits} bits in blocks of"
            f" {block} takes {expected} bytes; use rows of wire_size(numel, bits, block_size) = {expected} bytes."
        )


def _check_count(op: str, name: str, value: object, minimum: int) -> None:
    if not _is_int(value):
        raise TypeError(f"{op}: `{name}={value!r}` is not an int; use an int >= {minimum}.")
    if value < minimum:
        raise ValueError(f"{op}: `{name}={value!r}` is not allowed; use an int >= {minimum}.")


def _check_flag(op: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: `{name}={value!r}` is not allowed; use True or False.")


def _check_seed(op: str, seed: object) -> None:
    if seed is None:
        return
    allowed = "use None (a fresh seed) or an int in [0, 2**63)"
    if not _is_int(seed):
        raise TypeError(f"{op}: `seed={seed!r}` is not an int; {allowed}.")
    if not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"{op}: `seed={seed!r}` is not allowed; {allowed}.")


def _check_dtype(op: str, name: str, dtype: object, *, optional: bool = False) -> None:
    if dtype not in _FLOAT_DTYPES and not (optional and dtype is None):
        allowed = "torch.float32, torch.bfloat16 or torch.float16" + (" (or None)" if optional else "")
        raise TypeError(f"{op}: `{name}={dtype!r}` is not allowed; use {allowed}.")


def _check_out(op: str, out: object, shapes: list[tuple[int, ...]], device: torch.device, dtype) -> None:
    """``out``: exactly one of ``shapes``, of ``dtype`` (or any float dtype when None), on ``device``, contiguous."""
    _check_tensor(op, "out", out)
    allowed = " or ".join(str(s) for s in shapes)
    if tuple(out.shape) not in shapes:
        raise ValueError(f"{op}: `out` is {_describe(out)}; use shape {allowed}.")
    if dtype is None and out.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: `out` is {_describe(out)}; use a {_FLOATS} tensor.")
    if dtype is not None and out.dtype != dtype:
        raise TypeError(f"{op}: `out` is {_describe(out)}, but `dtype={dtype}`; pass dtype=out.dtype.")
    if out.device != device:
        raise ValueError(f"{op}: `out` is {_describe(out)}, but the input is on {device}; use one device.")
    if not out.is_contiguous():
        raise ValueError(f"{op}: `out` is {_describe(out)} with strides {out.stride()}; use a contiguous tensor.")


def _check_blocks(op: str, blocks: object, numel: int, block_size: int, what: str) -> None:
    """``blocks``: None, or a :class:`~lightning_zeropp.kernels.layout.Blocks` of ``numel`` elements (``what``
    says whose) whose blocks are no longer than ``block_size``."""
    if blocks is None:
        return
    if not isinstance(blocks, Blocks):
        raise TypeError(f"{op}: `blocks` must be None or a layout.Blocks, got {type(blocks).__name__}.")
    if blocks.numel != numel:
        raise ValueError(
            f"{op}: `blocks` covers {blocks.numel} elements, but {what} has {numel}; build the blocks for this row"
            " (Blocks.of_segments of its segment lengths)."
        )
    if blocks.longest > block_size:
        raise ValueError(
            f"{op}: `blocks` has a block of {blocks.longest} elements, longer than `block_size={block_size}`; build"
            " them with Blocks.of_segments(segments, block_size)."
        )


def _check_feedback(op: str, residual: object, shape: tuple[int, ...], device: torch.device, decay: object) -> None:
    """``residual``: None, or a contiguous fp32 tensor of ``shape`` on ``device``; ``decay``: a finite float."""
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not math.isfinite(decay):
        raise ValueError(f"{op}: `decay={decay!r}` is not allowed; use a finite float (0.8, say).")
    if residual is None:
        return
    _check_tensor(op, "residual", residual)
    if residual.dtype != torch.float32 or tuple(residual.shape) != shape:
        raise ValueError(
            f"{op}: `residual` is {_describe(residual)}; use a float32 tensor of shape {shape} (one value per element"
            " quantized)."
        )
    if residual.device != device or not residual.is_contiguous():
        raise ValueError(f"{op}: `residual` is {_describe(residual)}; use a contiguous tensor on {device}.")


def _check_rounding(op: str, stochastic: object, seed: object) -> None:
    _check_flag(op, "stochastic", stochastic)
    _check_seed(op, seed)


def _extras(blocks: Blocks | None, residual: torch.Tensor | None, decay: float) -> dict:
    """The optional arguments an implementation gets only when used (so a call without them is the original call)."""
    extras = {}
    if blocks is not None:
        extras["blocks"] = blocks
    if residual is not None:
        extras["residual"], extras["decay"] = residual, float(decay)
    return extras


# ------------------------------------------------------------------------------------------------------------------
# The ops


def quantize(
    x: torch.Tensor,
    bits: int,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    blocks: Blocks | None = None,
    residual: torch.Tensor | None = None,
    decay: float = 1.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Block-quantizes ``x`` to a uint8 wire buffer (``layout`` describes the format).

    Args:
        x: fp32, bf16 or fp16; 1-D (one row, returns ``(wire,)``) or 2-D (each row quantized on its own, returns
            ``(rows, wire)``).
        bits: 8 or 4.
        block_size: elements per fp32 scale (even for 4 bits).
        stochastic: round stochastically (unbiased) instead of to the nearest (half to even).
        seed: the noise's seed (a non-negative int below 2**63); None draws a fresh one.
        blocks: parameter-aligned blocks of a row (:class:`~lightning_zeropp.kernels.layout.Blocks`, none longer
            than ``block_size``) instead of uniform blocks of ``block_size``.
        residual: error feedback: a float32 tensor shaped like ``x``; ``x + decay * residual`` is quantized, and
            ``residual`` is overwritten with what that quantization lost.
        decay: the factor the residual is carried over with.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
    """
    op = "lightning_zeropp.kernels.quantize"
    _check_backend_name(op, "backend", backend)
    _check_float_input(op, "x", x, (1, 2))
    check_format(bits, block_size, op=op)
    _check_rounding(op, stochastic, seed)
    _check_blocks(op, blocks, x.shape[-1], block_size, "a row of `x`")
    _check_feedback(op, residual, tuple(x.shape), x.device, decay)
    return _impl(op, backend, x.device).quantize(
        x, bits, block_size, stochastic=stochastic, seed=seed, **_extras(blocks, residual, decay)
    )


def dequantize(
    buf: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    blocks: Blocks | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Inverse of :func:`quantize`.

    Args:
        buf: the wire buffer: ``(wire,)`` (returns ``(numel,)``) or ``(rows, wire)`` (returns ``(rows, numel)``).
        numel: elements per row.
        bits, block_size: the format ``buf`` was quantized with.
        dtype: the output dtype: fp32, bf16 or fp16.
        out: written instead of a new tensor: contiguous, ``dtype``, on ``buf``'s device, of the shape returned or
            (2-D ``buf``) its flat ``(rows * numel,)`` (FSDP's all-gather output is flat).
        blocks: the blocks ``buf`` was quantized in (None: uniform).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
    """
    op = "lightning_zeropp.kernels.dequantize"
    _check_backend_name(op, "backend", backend)
    _check_count(op, "numel", numel, 0)
    check_format(bits, block_size, op=op)
    _check_blocks(op, blocks, numel, block_size, "`numel`")
    _check_wire(op, buf, (1, 2), "a 1-D row (wire,) or 2-D rows (rows, wire)", numel, bits, block_size, blocks)
    _check_dtype(op, "dtype", dtype)
    if out is not None:
        shapes = [(numel,)] if buf.dim() == 1 else [(buf.shape[0], numel), (buf.shape[0] * numel,)]
        _check_out(op, out, shapes, buf.device, dtype)
    return _impl(op, backend, buf.device).dequantize(
        buf, numel, bits, block_size, dtype, out=out, **_extras(blocks, None, 1.0)
    )


def swizzle_quantize(
    x: torch.Tensor,
    ranks_per_node: int,
    num_nodes: int,
    stages: int,
    stage: int,
    bits: int,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    blocks: Blocks | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """qgZ step 1, fused: piece ``stage`` of each of the W = N*K chunks of ``x``, in swizzled slot order, quantized.

    Args:
        x: fp32, bf16 or fp16, 1-D, W equal chunks (``numel == N * K * chunk``).
        ranks_per_node, num_nodes: N and K, each >= 1.
        stages, stage: the pipeline's piece count (>= 1) and this piece (``0 <= stage < stages``); see
            :func:`~lightning_zeropp.kernels.layout.stage_bounds`.
        bits, block_size, stochastic, seed, backend: as :func:`quantize`.
        blocks: the parameter-aligned blocks of a whole chunk; the pieces are then ``blocks.stages(stages)``.

    Returns:
        ``(W, wire_size(piece))``: rows ``[l*K, (l+1)*K)`` are for local peer ``l``.
    """
    op = "lightning_zeropp.kernels.swizzle_quantize"
    _check_backend_name(op, "backend", backend)
    _check_float_input(op, "x", x, (1,))
    _check_count(op, "ranks_per_node", ranks_per_node, 1)
    _check_count(op, "num_nodes", num_nodes, 1)
    _check_count(op, "stages", stages, 1)
    _check_count(op, "stage", stage, 0)
    if stage >= stages:
        raise ValueError(f"{op}: `stage={stage}` is not allowed; use 0 <= stage < stages={stages}.")
    W = ranks_per_node * num_nodes
    if x.numel() % W:
        raise ValueError(
            f"{op}: `x` is {_describe(x)}, which is not {W} equal chunks (ranks_per_node={ranks_per_node} x"
            f" num_nodes={num_nodes}); use numel == ranks_per_node * num_nodes * chunk."
        )
    check_format(bits, block_size, op=op)
    _check_rounding(op, stochastic, seed)
    _check_blocks(op, blocks, x.numel() // W, block_size, "a chunk of `x`")
    return _impl(op, backend, x.device).swizzle_quantize(
        x, ranks_per_node, num_nodes, stages, stage, bits, block_size, stochastic=stochastic, seed=seed,
        **_extras(blocks, None, 1.0),
    )  # fmt: skip


def dequantize_reduce_quantize(
    buf: torch.Tensor,
    numel: int,
    in_bits: int,
    out_bits: int,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    blocks: Blocks | None = None,
    residual: torch.Tensor | None = None,
    decay: float = 1.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """qgZ step 3, fused: K pieces from each of N peers, dequantized, summed over the peers in fp32, re-quantized.

    Args:
        buf: ``(N, K, wire_size(numel, in_bits, block_size))`` uint8, N >= 1.
        numel: elements per piece.
        in_bits, out_bits: the received and the returned bit width (8 or 4).
        block_size, stochastic, seed, backend: as :func:`quantize` (the rounding is the re-quantization's).
        blocks: the pieces' blocks (both bit widths), as :func:`quantize`.
        residual, decay: error feedback on the re-quantization, as :func:`quantize`; ``residual`` is ``(K, numel)``.

    Returns:
        ``(K, wire_size(numel, out_bits, block_size))``.
    """
    op = "lightning_zeropp.kernels.dequantize_reduce_quantize"
    _check_backend_name(op, "backend", backend)
    _check_count(op, "numel", numel, 0)
    check_format(in_bits, block_size, op=op, bits_name="in_bits")
    check_format(out_bits, block_size, op=op, bits_name="out_bits")
    _check_blocks(op, blocks, numel, block_size, "`numel`")
    _check_wire(op, buf, (3,), "(N, K, wire): K pieces from each of N peers", numel, in_bits, block_size, blocks)
    if buf.shape[0] == 0:
        raise ValueError(f"{op}: `buf` is {_describe(buf)}, pieces from no peer; use N >= 1 rows of pieces.")
    _check_rounding(op, stochastic, seed)
    if buf.dim() == 3:
        _check_feedback(op, residual, (buf.shape[1], numel), buf.device, decay)
    return _impl(op, backend, buf.device).dequantize_reduce_quantize(
        buf, numel, in_bits, out_bits, block_size, stochastic=stochastic, seed=seed,
        **_extras(blocks, residual, decay),
    )  # fmt: skip


def dequantize_reduce(
    buf: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    *,
    multiplier: float = 1.0,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    blocks: Blocks | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """qgZ step 5, fused: the fp32 sum of M dequantized rows times ``multiplier``, rounded once to the output dtype.

    Args:
        buf: ``(M, wire_size(numel, bits, block_size))`` uint8, M >= 1.
        numel, bits, block_size: as :func:`dequantize`.
        multiplier: a finite number the sum is scaled by (in fp32).
        out: written instead of a new tensor: ``(numel,)``, contiguous, fp32/bf16/fp16, on ``buf``'s device.
        dtype: the output dtype (fp32, bf16 or fp16; None: ``out``'s, or fp32); with ``out``, None or ``out.dtype``.
        blocks: the blocks ``buf`` was quantized in (None: uniform).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
    """
    op = "lightning_zeropp.kernels.dequantize_reduce"
    _check_backend_name(op, "backend", backend)
    _check_count(op, "numel", numel, 0)
    check_format(bits, block_size, op=op)
    _check_blocks(op, blocks, numel, block_size, "`numel`")
    _check_wire(op, buf, (2,), "2-D rows (M, wire)", numel, bits, block_size, blocks)
    if buf.shape[0] == 0:
        raise ValueError(f"{op}: `buf` is {_describe(buf)}, no rows to sum; use M >= 1 rows.")
    if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real) or not math.isfinite(multiplier):
        raise ValueError(f"{op}: `multiplier={multiplier!r}` is not allowed; use a finite float.")
    _check_dtype(op, "dtype", dtype, optional=True)
    if out is not None:
        _check_out(op, out, [(numel,)], buf.device, dtype)
    return _impl(op, backend, buf.device).dequantize_reduce(
        buf, numel, bits, block_size, multiplier=float(multiplier), out=out, dtype=dtype,
        **_extras(blocks, None, 1.0),
    )  # fmt: skip


__all__ = [
    "QMAX",
    "Backend",
    "Blocks",
    "check_backend",
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
