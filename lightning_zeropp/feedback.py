"""Error feedback for qgZ: what the INT4 inter-node hop's quantization lost, carried into the next reduction.

A rank's residual for a unit covers what it sends across nodes: the K pieces of its node-summed chunks, M / N
elements per rank over the whole model, in fp32. A reduction quantizes ``sum + decay * residual`` and leaves what that
lost in ``residual`` (LoCo, arXiv 2407.04480, with the reference implementation's defaults: decay 0.8, reset every
1024 steps). Only a call that reduces touches a residual, and residuals are zeroed every ``reset`` optimizer steps.
"""

from __future__ import annotations

from typing import Any

import torch


class ErrorFeedback:
    """The residuals of one model, by unit name, and the reset period each was last used in (the optimizer step
    count itself belongs to :class:`~lightning_zeropp.comm.ZeroPPComms`, which passes it in)."""

    def __init__(self, decay: float, reset: int) -> None:
        self.decay = decay
        self.reset = reset
        self._residuals: dict[str, torch.Tensor] = {}
        self._periods: dict[str, int] = {}

    def pieces(
        self, unit: str, rows: int, chunk: int, stages: list[tuple[int, int]], device: torch.device, step: int
    ) -> list[torch.Tensor]:
        """The residual of ``unit`` as one contiguous float32 ``(rows, size)`` view per ``(start, size)`` stage
        (stage s at offset ``rows * start``), zeroed when new, when its shape changed, and at each reset period
        (every ``reset`` optimizer steps; ``step``: the optimizer steps taken so far)."""
        residual = self._residuals.get(unit)
        if residual is not None and residual.device != device:  # restored from a checkpoint on the CPU
            residual = self._residuals[unit] = residual.to(device)
        if residual is None or residual.numel() != rows * chunk:
            residual = torch.zeros(rows * chunk, dtype=torch.float32, device=device)
            self._residuals[unit] = residual
        period = step // self.reset if self.reset else 0
        if self._periods.setdefault(unit, period) != period:
            residual.zero_()
            self._periods[unit] = period
        return [residual[rows * start : rows * (start + size)].view(rows, size) for start, size in stages]

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def state_dict(self) -> dict[str, Any]:
        """The residuals (this rank's, by unit) and their periods."""
        return {
            "residuals": {unit: r for unit, r in self._residuals.items()},
            "periods": dict(self._periods),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What :meth:`state_dict` returned (residuals may be on another device: each moves at its first use)."""
        self._residuals = {unit: r.clone() for unit, r in state["residuals"].items()}
        self._periods = dict(state["periods"])

    def clear(self) -> None:
        self._residuals.clear()
        self._periods.clear()
