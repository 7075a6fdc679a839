"""Quantization kernels for ZeRO++ and the one dispatch point between Triton and the pure-torch twins.

Every public op takes ``backend``: ``"auto"`` runs Triton on CUDA tensors and the torch twin elsewhere; ``"torch"``
always runs the twin; ``"triton"`` always runs Triton (on a CPU tensor only under ``TRITON_INTERPRET=1``).
Importing this package never imports triton.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from . import reference
from .layout import (
    QMAX,
    check_format,
    generalized_swizzle_slot,
    num_blocks,
    payload_bytes,
    scale_offset,
    stage_bounds,
    swizzle_order,
    wire_size,
)

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_ops():
    try:
        from . import triton_ops
    except ImportError as err:  # triton is a Linux x86-64 dependency only
        raise ImportError(
            f'lightning_zeropp.kernels: backend "triton" needs the triton package ({err}); install it or use'
            ' backend "torch".'
        ) from err
    return triton_ops


def _impl(backend: Backend, tensor: torch.Tensor):
    """The module whose functions implement the ops for ``tensor`` under ``backend``."""
    if backend not in _BACKENDS:
        raise ValueError(f"lightning_zeropp.kernels: `backend={backend!r}` is not one of {_BACKENDS}.")
    if backend == "torch" or (backend == "auto" and not tensor.is_cuda):
        return reference
    if not tensor.is_cuda and not _interpreting():
        raise ValueError(
            f'lightning_zeropp.kernels: backend "triton" got a {tensor.device.type} tensor; Triton runs on CUDA'
            ' tensors, or on the CPU under TRITON_INTERPRET=1 (set before triton is imported). Use backend "auto" or'
            ' "torch".'
        )
    return _triton_ops()


def quantize(
    x: torch.Tensor,
    bits: int,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Block-quantizes ``x`` (fp32, bf16 or fp16; 1-D, or 2-D with rows quantized independently) to a uint8 buffer."""
    return _impl(backend, x).quantize(x, bits, block_size, stochastic=stochastic, seed=seed)


def dequantize(
    buf: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Inverse of :func:`quantize`, in ``dtype``, or written straight into ``out`` (contiguous, rows x numel)."""
    return _impl(backend, buf).dequantize(buf, numel, bits, block_size, dtype, out=out)


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
    backend: Backend = "auto",
) -> torch.Tensor:
    """qgZ step 1, fused: the pieces of stage ``stage`` of the W chunks of ``x``, swizzled and quantized."""
    return _impl(backend, x).swizzle_quantize(
        x, ranks_per_node, num_nodes, stages, stage, bits, block_size, stochastic=stochastic, seed=seed
    )


def dequantize_reduce_quantize(
    buf: torch.Tensor,
    numel: int,
    in_bits: int,
    out_bits: int,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """qgZ step 3, fused: ``(N, K, wire_in)`` -> ``(K, wire_out)``, summed over N in fp32."""
    return _impl(backend, buf).dequantize_reduce_quantize(
        buf, numel, in_bits, out_bits, block_size, stochastic=stochastic, seed=seed
    )


def dequantize_reduce(
    buf: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    *,
    multiplier: float = 1.0,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """qgZ step 5, fused: ``(M, wire)`` -> the fp32 sum of the M rows times ``multiplier``, in the output dtype."""
    return _impl(backend, buf).dequantize_reduce(
        buf, numel, bits, block_size, multiplier=multiplier, out=out, dtype=dtype
    )


__all__ = [
    "QMAX",
    "check_format",
    "dequantize",
    "dequantize_reduce",
    "dequantize_reduce_quantize",
    "generalized_swizzle_slot",
    "num_blocks",
    "payload_bytes",
    "quantize",
    "scale_offset",
    "stage_bounds",
    "swizzle_order",
    "swizzle_quantize",
    "wire_size",
]
