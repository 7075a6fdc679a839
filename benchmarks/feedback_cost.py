"""What error feedback adds to qgZ's re-quantization (step 3: the node's INT8 pieces summed, re-quantized to INT4 for
the inter-node hop), on the torch twin a CPU rank runs.

One process, one CPU thread: one rank of ``--nodes`` x ``--per-node`` holding the example GPT's units, laid out as
the strategy lays a unit's gradient chunk (each parameter's padded shard, parameter-aligned blocks). For every unit
and pipeline stage (``qgz.Reduction``), the ``(N, K, wire)`` INT8 pieces a rank receives from its node are summed and
re-quantized, without a residual and with one of each width (INT8 codes with block scales: the default; bf16; fp32),
the residual carried from repeat to repeat as in training. Per way the best of ``--repeats`` passes over all units;
the ways interleaved within each repeat, so a busy machine slows them alike.

    python benchmarks/feedback_cost.py [--n-embd 256] [--n-layer 4] [--nodes 2] [--per-node 2] [--repeats 15] \
        [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_zeropp import kernels as tk
from lightning_zeropp import qgz
from lightning_zeropp.commplan import two_hop
from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.costs import gpt_units
from lightning_zeropp.feedback import ErrorFeedback
from lightning_zeropp.topology import Topology

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402

WAYS = ("none", "int8", "bf16", "fp32")
_BITS = {"int8": 8, "bf16": 16, "fp32": 32}


def _calls(n_embd: int, n_layer: int, nodes: int, per_node: int):
    """Per way, the list of zero-argument calls that re-quantize every unit's stages once; the elements they cover
    (the K pieces of every stage, the residual's size: M / N over the model); and, per width, the residuals."""
    torch.manual_seed(0)
    world = nodes * per_node
    config = ZeroPPConfig()
    topology = Topology(world, per_node, 0, per_node)
    feedback = {way: ErrorFeedback(1.0, 0, bits) for way, bits in _BITS.items()}
    calls: dict[str, list] = {way: [] for way in WAYS}
    elements = 0
    for unit in gpt_units(256, 128, n_layer, n_embd):
        blocks = tk.Blocks.of_segments(unit.shards(world), config.gradient_block_size)
        reduction = qgz.Reduction.of(topology, two_hop(config), blocks.numel, dist.ReduceOp.AVG, None, blocks=blocks)
        g = reduction.gradients
        pieces = [(stage.size, stage.block_count(g.block_size)) for stage in reduction.stages]
        residuals = {way: fb.pieces(unit.name, nodes, pieces, torch.device("cpu"), 0) for way, fb in feedback.items()}
        for stage in reduction.busy:
            values = torch.randn(per_node * nodes, stage.size) * 1e-3
            buf = tk.quantize(values, g.intra_bits, g.block_size, blocks=stage.blocks).view(per_node, nodes, -1)
            elements += nodes * stage.size

            def call(buf=buf, stage=stage, residuals=residuals, g=g, way="none"):
                extra = residuals[way][stage.index].arguments(1.0) if way != "none" else {}
                tk.dequantize_reduce_quantize(buf, stage.size, g.intra_bits, g.inter_bits, g.block_size,
                                              blocks=stage.blocks, backend="torch", **extra)  # fmt: skip

            for way in WAYS:
                calls[way].append(lambda call=call, way=way: call(way=way))
    return calls, elements, feedback


def measure(n_embd: int, n_layer: int, nodes: int, per_node: int, repeats: int) -> dict:
    """Best-of-``repeats`` seconds per way for one pass over every unit's stages (ways interleaved)."""
    calls, elements, _ = _calls(n_embd, n_layer, nodes, per_node)
    best = {way: float("inf") for way in WAYS}
    for _ in range(repeats):
        for way in WAYS:
            start = time.perf_counter()
            for call in calls[way]:
                call()
            best[way] = min(best[way], time.perf_counter() - start)
    row = dict(n_embd=n_embd, n_layer=n_layer, nodes=nodes, per_node=per_node, elements=elements,
               calls=len(calls["none"]), repeats=repeats)  # fmt: skip
    for way in WAYS:
        row[f"{way}_ms"] = best[way] * 1e3
    for way in _BITS:
        row[f"{way}_extra_ms"] = row[f"{way}_ms"] - row["none_ms"]
        row[f"{way}_ratio"] = row[f"{way}_ms"] / row["none_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-embd", type=int, nargs="+", default=[256])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(n, args.n_layer, args.nodes, args.per_node, args.repeats) for n in args.n_embd]
    print("| n_embd | elements (K pieces, all units) | no feedback ms | INT8 residual ms | bf16 ms | fp32 ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r['none_ms']:.2f}"] + [f"{r[f'{w}_ms']:.2f} ({r[f'{w}_ratio']:.2f}x)" for w in _BITS]
        print(f"| {r['n_embd']} | {r['elements']:,} | " + " | ".join(cells) + " |")
    if args.json:
        command = " ".join(["python benchmarks/feedback_cost.py", *sys.argv[1:]])
        record.write(args.json, {"command": command, "rows": rows}, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
