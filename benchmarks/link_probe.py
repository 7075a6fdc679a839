"""What the emulated cluster's link delivers to each of gloo's collectives, measured alone, without training.

The training layout (2 nodes x 2 ranks; rank ``node * 2 + local``): per collective the step uses across nodes, one call
after another on its own group, at two message sizes, as nccl-tests characterizes a real cluster's fabric:

- ``all_gather``: ``all_gather_into_tensor`` over all 4 ranks (FSDP's and qwZ's weight all-gathers);
- ``reduce_scatter``: ``reduce_scatter_tensor`` of bf16 over all 4 ranks (FSDP's gradient reduce-scatter);
- ``all_to_all``: ``all_to_all_single`` on the two rails (ranks 0 and 2, 1 and 3) at once (qgZ's inter-node hop,
  weight deltas);
- ``all_reduce``: ``all_reduce`` of bf16 on the two rails at once (HSDP's gradient all-reduce).

``size`` is one rank's contribution in bytes (an all-to-all's whole send buffer, an all-reduce's buffer). Rank 0
prints one JSON line: per collective, ``[[size, seconds per call], ...]``. ``benchmarks/plan_check.py --cluster``
turns each collective's two points into the link's rate and latency as the planner's model of that collective sees
them (``lightning_zeropp.prediction.collective_seconds``); the training step is then predicted from those, its bytes
and its compute, never from its own time.

Run by ``benchmarks/cluster.py --probe-link`` inside each namespace, with ``RANK``, ``WORLD_SIZE=4``,
``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` set.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


def _call(kind: str, size: int, world, rail):
    """A closure running one call of ``kind`` with ``size`` bytes per rank."""
    if kind == "all_gather":
        send, out = torch.zeros(size, dtype=torch.uint8), torch.empty(4 * size, dtype=torch.uint8)
        return lambda: dist.all_gather_into_tensor(out, send, group=world)
    if kind == "reduce_scatter":
        full = torch.zeros(4 * (size // 2), dtype=torch.bfloat16)
        out = torch.empty(size // 2, dtype=torch.bfloat16)
        return lambda: dist.reduce_scatter_tensor(out, full, group=world)
    if kind == "all_to_all":
        send, recv = torch.zeros(2 * (size // 2), dtype=torch.uint8), torch.empty(2 * (size // 2), dtype=torch.uint8)
        return lambda: dist.all_to_all_single(recv, send, group=rail)
    buffer = torch.zeros(size // 2, dtype=torch.bfloat16)
    return lambda: dist.all_reduce(buffer, group=rail)


def timed(call, seconds: float, world) -> float:
    """Seconds per call: two warm-up calls, then as many as fit in ``seconds`` (rank 0 decides, all ranks run them)."""
    dist.barrier(group=world)
    started = time.perf_counter()
    for _ in range(2):
        call()
    rounds = torch.tensor([max(3, int(seconds / ((time.perf_counter() - started) / 2)))])
    dist.broadcast(rounds, src=0, group=world)
    dist.barrier(group=world)
    started = time.perf_counter()
    for _ in range(int(rounds)):
        call()
    elapsed = time.perf_counter() - started
    return elapsed / int(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs=2, default=[50_000, 400_000], help="bytes per rank, two sizes")
    parser.add_argument("--seconds", type=float, default=2.0, help="per collective and size (after the warm-up)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=4)
    world = dist.group.WORLD
    rails = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rail = rails[rank % 2]
    out = {kind: [[size, timed(_call(kind, size, world, rail), args.seconds, world)] for size in args.sizes]
           for kind in args.kinds}  # fmt: skip
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
