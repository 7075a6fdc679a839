"""hpZ: a secondary weight partition inside each node, so the backward all-gather stays inside the node.

FSDP2 already has the mechanism: ``fully_shard(reshard_after_forward=R)`` keeps, after a module's forward, a 1/R
slice of the *unsharded* weights on each rank, and the backward all-gather then runs among R consecutive ranks
instead of the whole world. With R = ranks per node (or a divisor of it) those R ranks share a node; other R are
allowed, with a warning. Because the slice is cut from the forward's all-gather output, it holds exactly the
(dequantized, under qwZ) weights the forward used, so the secondary all-gather stays exact in the compute dtype:
re-quantizing it would cost accuracy and save no inter-node bytes.

The slice is dropped by FSDP at the end of every backward (root post-backward callback), before the optimizer
step changes the primary shards, so it can never go stale across steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .ledger import CommLedger


def secondary_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    ranks: list[int],
    ledger: CommLedger,
    async_op: bool,
) -> dist.Work | None:
    ledger.record_all_gather("weight_all_gather_secondary", ranks, input.numel() * input.element_size())
    return all_gather_flat(output, input, group, async_op)
