"""Error feedback for qgZ: what the INT4 inter-node hop's quantization lost, carried into the next reduction.

A rank's residual for a unit covers what it sends across nodes: the K pieces of its node-summed chunks, M / N
elements per rank over the whole model. A reduction quantizes ``sum + decay * residual`` and leaves what that lost in
``residual``. Only a call that reduces touches a residual, and residuals are zeroed every ``reset`` optimizer steps.

Over T reductions this sends ``sum(g) - r_T - (1 - decay) * sum(r_t, t < T)``: with ``decay = 1`` (classic error
feedback) the error of the summed gradients is the last residual alone, bounded; with ``decay < 1`` a fraction ``1 -
decay`` of every residual is never sent, and an element whose residual settles under half a quantization step (``g / (1
- decay)``) is never sent at all. The default is 1. Neither is LoCo's rule (arXiv 2407.04480; its authors' reference
kernels, DeepSpeed #6730, whose ``err_beta=0.8`` an earlier 0.8 default was taken from): LoCo adds the whole carried
error and keeps a moving average of the errors, ``e = beta * e + (1 - beta) * (h - Q(h))`` with ``h = g + e``, which is
bounded too. docs/error_feedback.md compares the two; tests/test_feedback_telescoping.py measures them.

The residual is kept in ``error_feedback_bits``: 32 (fp32, 4 bytes per element), 16 (bf16, 2) or 8 (the default, as
LoCo: the error block-quantized to INT8 codes with one fp32 scale per block, in the blocks the gradient itself uses on
that hop, about 1 + 4 / gradient_block_size bytes per element). The kernels read and rewrite it in their fused pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

_DTYPES = {32: torch.float32, 16: torch.bfloat16, 8: torch.int8}
_ALIGN = 16  # bytes: an INT8 residual's rows start 16-byte aligned, so the kernels move its codes in vectors


class Residual(NamedTuple):
    """One pipeline stage's residual, as the kernels take it: ``values`` ``(K, size)`` (fp32, bf16, or int8 codes
    whose rows are padded to 16 bytes) and, for int8, ``scales`` ``(K, blocks)`` fp32 (None otherwise)."""

    values: torch.Tensor
    scales: torch.Tensor | None

    def arguments(self, decay: float) -> dict[str, Any]:
        """The error feedback keywords of ``kernels.quantize`` / ``kernels.dequantize_reduce_quantize``."""
        if self.scales is None:
            return {"residual": self.values, "decay": decay}
        return {"residual": self.values, "residual_scales": self.scales, "decay": decay}


def _row_stride(size: int, bits: int) -> int:
    return -(-size // _ALIGN) * _ALIGN if bits == 8 else size


class ErrorFeedback:
    """The residuals of one model, by unit name, and the reset period each was last used in (the optimizer step
    count itself belongs to :class:`~lightning_zeropp.comm.ZeroPPComms`, which passes it in).

    Args:
        decay: the residual's carry-over factor.
        reset: zero the residuals every this many optimizer steps (0: never).
        bits: the residual's width: 32 (fp32), 16 (bf16) or 8 (INT8 codes and one fp32 scale per block).
    """

    def __init__(self, decay: float, reset: int, bits: int = 8) -> None:
        if bits not in _DTYPES:
            raise ValueError(f"ErrorFeedback: `bits={bits!r}` is not allowed; use 8, 16 or 32.")
        self.decay = decay
        self.reset = reset
        self.bits = bits
        self._values: dict[str, torch.Tensor] = {}  # by unit: every stage's rows, one after another
        self._scales: dict[str, torch.Tensor] = {}  # by unit, 8 bits only: every stage's rows of block scales
        self._elements: dict[str, int] = {}  # by unit: the elements the residual holds a value for
        self._periods: dict[str, int] = {}

    def pieces(
        self, unit: str, rows: int, stages: list[tuple[int, int]], device: torch.device, step: int
    ) -> list[Residual]:
        """The residual of ``unit`` as one :class:`Residual` per ``(size, blocks)`` stage (``rows`` rows of ``size``
        elements in ``blocks`` quantization blocks), zeroed when new, when its shape changed, and at each reset period
        (every ``reset`` optimizer steps; ``step``: the optimizer steps taken so far)."""
        strides = [_row_stride(size, self.bits) for size, _ in stages]
        numel = rows * sum(strides)
        scale_count = rows * sum(blocks for _, blocks in stages) if self.bits == 8 else 0
        values, scales = self._values.get(unit), self._scales.get(unit)
        if values is not None and values.device != device:  # restored from a checkpoint on the CPU
            values = self._values[unit] = values.to(device)
            if scales is not None:
                scales = self._scales[unit] = scales.to(device)
        if values is None or values.numel() != numel or (scales.numel() if scales is not None else 0) != scale_count:
            values = self._values[unit] = torch.zeros(numel, dtype=_DTYPES[self.bits], device=device)
            scales = torch.zeros(scale_count, dtype=torch.float32, device=device) if self.bits == 8 else None
            if scales is not None:
                self._scales[unit] = scales
        self._elements[unit] = rows * sum(size for size, _ in stages)
        period = step // self.reset if self.reset else 0
        if self._periods.setdefault(unit, period) != period:
            values.zero_()
            if scales is not None:
                scales.zero_()
            self._periods[unit] = period
        out, at, scale_at = [], 0, 0
        for (size, blocks), stride in zip(stages, strides):
            stage_scales = None
            if scales is not None:
                stage_scales = scales[scale_at : scale_at + rows * blocks].view(rows, blocks)
                scale_at += rows * blocks
            out.append(Residual(values[at : at + rows * stride].view(rows, stride)[:, :size], stage_scales))
            at += rows * stride
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the residuals take on this rank (codes and scales for 8 bits)."""
        return sum(t.numel() * t.element_size() for t in (*self._values.values(), *self._scales.values()))

    @property
    def numel(self) -> int:
        """Elements the residuals hold a value for (those used since they were made or loaded)."""
        return sum(self._elements.values())

    def state_dict(self) -> dict[str, Any]:
        """The residuals (this rank's, by unit; for 8 bits the int8 codes and, under ``scales``, their fp32 block
        scales), their width and periods."""
        state: dict[str, Any] = {
            "bits": self.bits,
            "residuals": dict(self._values),
            "periods": dict(self._periods),
        }
        if self.bits == 8:
            state["scales"] = dict(self._scales)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What :meth:`state_dict` returned (residuals may be on another device: each moves at its first use); one of
        another width is refused (the layout check of :class:`~lightning_zeropp.comm.ZeroPPComms` drops those)."""
        bits = int(state.get("bits", 32))  # written before the width was an argument: fp32
        if bits != self.bits:
            raise ValueError(
                f"ErrorFeedback: the state holds {bits}-bit residuals, but this job keeps {self.bits}-bit ones."
            )
        self._values = {unit: r.clone() for unit, r in state["residuals"].items()}
        self._scales = {unit: s.clone() for unit, s in state.get("scales", {}).items()}
        self._elements = {}
        self._periods = dict(state["periods"])

    def clear(self) -> None:
        self._values.clear()
        self._scales.clear()
        self._elements.clear()
        self._periods.clear()
