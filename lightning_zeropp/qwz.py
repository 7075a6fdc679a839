"""qwZ: the forward weight all-gather in block-quantized INT8 (or INT4).

::

    FSDP's all-gather output (W slots, this rank's input aliases its own slot)
    [ shard 0 | shard 1 | ... | shard W-1 ]           dtype: compute dtype (fp32 / bf16)
          |  quantize own shard (payload + fp32 scales in ONE uint8 buffer)
          v
    [ q0 | q1 | ... | qW-1 ]  one all-gather of uint8 buffers (1 byte/elem + 4 bytes/block at INT8)
          |  dequantize every slot, own included
          v
    [ shard 0' | shard 1' | ... ]                      every rank now holds bit-identical weights

The own slot is overwritten with its dequantized value too, so every rank computes with the same weights. The
quantizer is deterministic (round half to even), so re-gathering the same shards (backward without hpZ) gives the
same weights as forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import kernels as tk
from .collectives import all_gather_flat
from .commplan import ForwardGather
from .ledger import CommLedger


class _FinishOnWait(dist.Work):
    """A Work that, once the all-gather finished, dequantizes into FSDP's output before reporting completion."""

    def __init__(self, inner: dist.Work, finish) -> None:
        super().__init__()
        self._inner, self._finish = inner, finish

    def wait(self, timeout=None) -> bool:
        if self._finish is not None:
            self._inner.wait()
            self._finish()
            self._finish = None
        return True


def quantized_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    ranks: list[int],
    ledger: CommLedger,
    gather: ForwardGather,
    kind: str,
    async_op: bool,
    blocks: tk.Blocks | None = None,
    backend: str = "auto",
) -> dist.Work | None:
    """Quantizes this rank's shard, all-gathers the quantized buffers and dequantizes them into ``output``, in the
    bits and blocks of ``gather`` (the job plan's quantized forward gather). The caller sends units whose flat buffer
    is not floating point (FSDP's raw bytes for mixed dtypes) exactly. ``blocks``: the shard's parameter-aligned
    blocks (the same in every rank's shard); None: flat blocks. ``backend``: the kernels'."""
    bits, block = gather.bits, gather.block_size
    numel, world = input.numel(), len(ranks)
    packed = tk.quantize(input, bits, block, blocks=blocks, backend=backend)
    gathered = torch.empty(world * packed.numel(), dtype=torch.uint8, device=input.device)
    ledger.record_all_gather(kind, ranks, packed.numel())
    work = all_gather_flat(gathered, packed, group, async_op)
    # Streams (CUDA): ``packed`` and ``gathered`` are made on the stream FSDP runs the all-gather on, which is the
    # current stream here. Without async_op, everything below runs on that stream too. With async_op, FSDP calls
    # ``wait()`` later, possibly on another stream: ``finish`` then reads ``gathered`` there, so it is recorded on
    # that stream, or the caching allocator could hand its memory to the next all-gather while the dequantize kernel
    # still reads it. ``output`` is FSDP's and FSDP orders its use after ``wait()``.
    made_on = torch.cuda.current_stream() if gathered.is_cuda else None

    def finish() -> None:
        if made_on is not None and torch.cuda.current_stream() != made_on:
            gathered.record_stream(torch.cuda.current_stream())
        # straight into FSDP's output (own slot included): no temporary, no copy
        tk.dequantize(
            gathered.view(world, -1), numel, bits, block, output.dtype, out=output, blocks=blocks, backend=backend
        )

    if async_op:
        return _FinishOnWait(work, finish)
    finish()
    return None
