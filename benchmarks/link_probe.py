"""The rate the emulated cluster's link delivers to gloo: one process per node, an all-gather of a unit-sized buffer
between them, repeated; node 0 prints the bytes that crossed per second, as Mbit/s (one JSON line).

Run by ``benchmarks/cluster.py --probe-link`` inside each namespace, with ``RANK``, ``WORLD_SIZE=2``,
``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` set. The buffer is the size of one unit's all-gather
contribution in the cluster's runs (``--mbytes``); what a step's collectives achieve on top of this (their gaps, the
ring's dependencies) is for the planner to predict, not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mbytes", type=float, default=1.6, help="each rank's buffer, MB")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long to measure (after one warm-up)")
    args = parser.parse_args()
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
    n = int(args.mbytes * 1e6)
    send = torch.zeros(n, dtype=torch.uint8)
    out = torch.empty(2 * n, dtype=torch.uint8)
    started = time.perf_counter()
    for _ in range(3):  # warm-up, and how long a round takes: both ranks then run the rounds rank 0 chose
        dist.all_gather_into_tensor(out, send)
    plan = torch.tensor([max(3, int(args.seconds / ((time.perf_counter() - started) / 3)))])
    dist.broadcast(plan, src=0)
    rounds, started = int(plan), time.perf_counter()
    for _ in range(rounds):
        dist.all_gather_into_tensor(out, send)
    elapsed = time.perf_counter() - started
    if dist.get_rank() == 0:
        print(json.dumps({"mbit_per_s": rounds * n * 8 / elapsed / 1e6, "rounds": rounds, "bytes": n}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
