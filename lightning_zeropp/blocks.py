"""Parameter-aligned quantization blocks for each sharded unit.

FSDP2 hands qwZ and qgZ one flat buffer per unit, every rank's chunk laid out the same way: each parameter's padded
shard, in the unit's order. Blocks of a fixed size laid over that buffer straddle parameters, and a block's one scale
is set by its largest element: a LayerNorm gradient sharing a block with an attention bias gradient 100x larger is
below half an INT4 step and arrives as exactly 0, every step. So the blocks follow the parameters instead
(:class:`~lightning_zeropp.kernels.layout.Blocks`): whole blocks from each parameter's start, one shorter tail block.

Which parameters a buffer holds:

- the weight all-gather holds every parameter of the unit;
- the gradient reduce-scatter holds those that received a gradient this step (FSDP2 leaves out frozen parameters
  and parameters the step did not use). The frozen ones are known; when the sizes show that some other parameter is
  missing too, the unit's blocks cannot be placed for this call, and it falls back to flat blocks with one warning.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from . import kernels as tk
from .compat.torch import unit_fsdp_parameters, unit_parameters


class UnitBlocks:
    """The blocks of one sharded unit's chunks, for weights and gradients, made once and reused by every call.

    Args:
        module: the unit (an ``FSDPModule``).
        name: its module path ("" for the root).
        aligned: blocks follow the parameters (the job plan's ``block_alignment="parameter"``); False: flat blocks.
        weight_block_size: the plan's forward gather's block size (None where it gathers exactly: no weight blocks
            are asked for).
        gradient_block_size: the plan's gradient reduction's block size (None where it reduces exactly).
    """

    def __init__(
        self,
        module: nn.Module,
        name: str,
        *,
        aligned: bool,
        weight_block_size: int | None,
        gradient_block_size: int | None,
    ) -> None:
        self.module = module
        self.name = name or "<root>"
        self.aligned = aligned
        self.weight_block_size = weight_block_size
        self.gradient_block_size = gradient_block_size
        self._layout: list[tuple[int, bool]] | None = None
        self._blocks: dict[tuple[int, int], tk.Blocks | None] = {}
        self._vectors: dict[int, tuple[tuple[int, int], ...] | None] = {}
        self.unaligned: list[str] = []  # the buffers that fell back to flat blocks (what, elements per rank)
        self._warned = False

    def _segments(self) -> list[tuple[int, bool]]:
        if self._layout is None:
            self._layout = unit_parameters(self.module)
        return self._layout

    def weights(self, chunk: int) -> tk.Blocks | None:
        """Blocks for a weight all-gather chunk of ``chunk`` elements; None: flat blocks."""
        if not self.aligned:
            return None
        key = (0, chunk)
        if key not in self._blocks:
            segments = [n for n, _ in self._segments()]
            self._blocks[key] = self._checked(segments, chunk, self.weight_block_size, "weight all-gather")
        return self._blocks[key]

    def gradients(self, chunk: int) -> tk.Blocks | None:
        """Blocks for a gradient reduce-scatter chunk of ``chunk`` elements; None: flat blocks."""
        if not self.aligned:
            return None
        key = (1, chunk)
        if key not in self._blocks:
            segments = [n for n, trained in self._segments() if trained]
            self._blocks[key] = self._checked(segments, chunk, self.gradient_block_size, "gradient reduction")
        return self._blocks[key]

    def vector_spans(self, chunk: int) -> tuple[tuple[int, int], ...] | None:
        """For a gradient reduce-scatter chunk of ``chunk`` elements: the ``(start, stop)`` spans of the parameters of
        fewer than two dimensions (norm gains, biases; judged by the parameter's global shape), adjacent ones merged;
        ``()`` where there are none, None where the chunk's layout is not known (a parameter received no gradient:
        :meth:`gradients`)."""
        if chunk not in self._vectors:
            params = unit_fsdp_parameters(self.module)
            spans: list[tuple[int, int]] | None = []
            start = 0
            for param, size in params:
                if param.dim() < 2 and size:
                    if spans and spans[-1][1] == start:
                        spans[-1] = (spans[-1][0], start + size)
                    else:
                        spans.append((start, start + size))
                start += size
            self._vectors[chunk] = tuple(spans) if start == chunk else None
        return self._vectors[chunk]

    def _checked(self, segments: list[int], chunk: int, block_size: int, what: str) -> tk.Blocks | None:
        if sum(segments) == chunk:
            return tk.Blocks.of_segments(segments, block_size)
        self.unaligned.append(f"{what} of {chunk}")
        if not self._warned:
            self._warned = True
            rank_zero_warn(
                f"ZeroPPStrategy: the {what} of unit {self.name!r} holds {chunk} elements per rank, not the"
                f" {sum(segments)} its parameters take (some parameter received no gradient in this step?). Its"
                " quantization blocks cannot follow the parameters there, so that call uses flat blocks, where a small"
                " parameter can share a block with a large one."
            )
        return None
