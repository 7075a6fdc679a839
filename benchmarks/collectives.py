"""Time of one FSDP unit's collectives, exact vs ZeRO++, on local gloo ranks (CPU: the pure-torch quantizers).

Calls the strategy's own functions (``exact_reduce_scatter``, ``qgz.quantized_reduce_scatter``, the exact
all-gather, ``qwz.quantized_all_gather`` and the weight deltas' exchange and node-copy gather) on a bf16 buffer the size
of one unit, ``--reps`` times, and reports the mean per call on rank 0 (ranks synchronise before and after). On
loopback this measures the CPU cost the quantizers add; bytes are not the bottleneck here. Also the one collective the
strategy adds per step boundary under SLURM auto-requeue (24 bytes; ``100 x --reps`` calls).

    python benchmarks/collectives.py [--params 800000] [--world 4] [--per-node 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402


def _worker(rank: int, world: int, per_node: int, params: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from lightning_zeropp import kernels as tk
    from lightning_zeropp import qgz, qwz
    from lightning_zeropp.collectives import all_gather_flat
    from lightning_zeropp.comm import exact_reduce_scatter
    from lightning_zeropp.commplan import ForwardGather, two_hop
    from lightning_zeropp.config import ZeroPPConfig
    from lightning_zeropp.deltas import WeightDeltas, _UnitCopy
    from lightning_zeropp.feedback import ErrorFeedback
    from lightning_zeropp.ledger import CommLedger
    from lightning_zeropp.topology import ProcessGroups, Topology

    dist.init_process_group("gloo")
    topo = Topology(world, per_node, rank, per_node)
    groups = ProcessGroups.build(topo)
    ledger = CommLedger(topo)
    chunk = params // world
    grads = torch.randn(world * chunk).bfloat16()
    shard = torch.randn(chunk).bfloat16()
    gathered = torch.empty(world * chunk, dtype=torch.bfloat16)
    out = torch.empty(chunk, dtype=torch.bfloat16)
    avg, ranks = dist.ReduceOp.AVG, list(range(world))
    # weight deltas on a copy filled once exactly; flat blocks, so no sharded module is needed for the layout
    deltas = WeightDeltas(ForwardGather("node_copy", "world", bits=4, block_size=256, refresh=1000), topo, ledger)
    unit, copy = SimpleNamespace(name="unit", weights=lambda numel: None), _UnitCopy()
    deltas._refresh(copy, shard, groups)
    hpz = groups.group("hpz")
    qwz_int8 = ForwardGather("quantized", "world", bits=8, block_size=256)  # qwZ's defaults

    def qgz_with_feedback(bits: int):
        """qgZ (2 stages) with error feedback at residual width ``bits``, as ``comm.py`` calls it."""
        config = ZeroPPConfig(gradient_error_feedback=True, error_feedback_bits=bits)
        feedback = ErrorFeedback(config.error_feedback_decay, 0, bits)
        reduction = qgz.Reduction.of(topo, two_hop(config), chunk, avg, None)
        pieces = [(stage.size, stage.block_count(config.gradient_block_size)) for stage in reduction.stages]

        def call():
            stages = feedback.pieces("unit", topo.num_nodes, pieces, grads.device, 0)
            residuals = [stage.arguments(feedback.decay) for stage in stages]
            qgz.quantized_reduce_scatter(out, grads.clone(), reduction, groups, ledger, residuals)

        return call

    # a transformer block's layout, scaled to the unit (width e: 12 e^2 + 13 e parameters), for parameter-aligned blocks
    # with and without its norm gains and biases carried exactly (gradient_quantization_scope="matrices")
    e = int((params / 12) ** 0.5)
    shapes = [(e,), (e,), (e, 3 * e), (3 * e,), (e, e), (e,), (e,), (e,), (e, 4 * e), (4 * e,), (4 * e, e), (e,)]
    segments = [-(-torch.Size(shape).numel() // world) for shape in shapes]
    starts = [sum(segments[:i]) for i in range(len(segments))]
    spans = tuple((a, a + n) for a, n, shape in zip(starts, segments, shapes) if len(shape) < 2)
    blocks, aligned_chunk = tk.Blocks.of_segments(segments, 128), sum(segments)
    aligned_grads, aligned_out = torch.randn(world * aligned_chunk).bfloat16(), torch.empty(aligned_chunk).bfloat16()

    def qgz_aligned(vectors: tuple[tuple[int, int], ...]):
        reduction = qgz.Reduction.of(topo, two_hop(ZeroPPConfig()), aligned_chunk, avg, None, blocks=blocks)
        return lambda: qgz.quantized_reduce_scatter(aligned_out, aligned_grads.clone(), reduction, groups, ledger,
                                                    vectors=vectors)  # fmt: skip

    cases = {
        "reduce-scatter exact": lambda: exact_reduce_scatter(out, grads.clone(), avg, None, groups, ledger),
        "reduce-scatter qgZ (2 stages)": lambda: qgz.quantized_reduce_scatter(
            out, grads.clone(), qgz.Reduction.of(topo, two_hop(ZeroPPConfig()), chunk, avg, None), groups, ledger
        ),
        "reduce-scatter qgZ (2 stages), a block's parameter-aligned layout": qgz_aligned(()),
        "reduce-scatter qgZ (2 stages), the same + norm gains and biases carried exactly": qgz_aligned(spans),
        "reduce-scatter qgZ (2 stages) + error feedback, INT8 residual": qgz_with_feedback(8),
        "reduce-scatter qgZ (2 stages) + error feedback, fp32 residual": qgz_with_feedback(32),
        "reduce-scatter qgZ (1 stage)": lambda: qgz.quantized_reduce_scatter(
            out,
            grads.clone(),
            qgz.Reduction.of(topo, two_hop(ZeroPPConfig(gradient_pieces=1)), chunk, avg, None),
            groups,
            ledger,
        ),
        "all-gather exact": lambda: all_gather_flat(gathered, shard, groups.world),
        "all-gather qwZ INT8": lambda: qwz.quantized_all_gather(
            gathered, shard, groups.world, ranks, ledger, qwz_int8, "weight_all_gather", False
        ),
        "weight deltas: INT4 delta exchange + node-copy gather": lambda: (
            deltas._send_delta(copy, shard, unit, groups),
            all_gather_flat(gathered, copy.slice, hpz),
        ),
        "weight deltas: INT4 delta exchange alone": lambda: deltas._send_delta(copy, shard, unit, groups),
        "weight deltas: node-copy gather alone (nothing changed)": lambda: all_gather_flat(gathered, copy.slice, hpz),
        # what the strategy adds per step boundary under SLURM auto-requeue (lightning_zeropp/preemption.py)
        "preemption agreement: all-reduce MAX of 3 int64": lambda: dist.all_reduce(
            torch.zeros(3, dtype=torch.int64), op=dist.ReduceOp.MAX, group=groups.world
        ),
    }
    # for comparison: what Lightning's training loop already does at every batch of a multi-rank run
    cases["Lightning's SIGTERM flag: broadcast of 1 int64 (every batch, any strategy)"] = lambda: dist.broadcast(
        torch.zeros(1, dtype=torch.int64), src=0
    )
    many = {name: 100 for name in list(cases)[-2:]}  # tiny: more calls for a stable mean
    times = {}
    for name, call in cases.items():
        call()
        dist.barrier()
        calls = reps * many.get(name, 1)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        dist.barrier()
        times[name] = (time.perf_counter() - start) / calls
    dist.destroy_process_group()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=800_000, help="parameters in the unit")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from lightning_zeropp.spawn import run_local_ranks

    times = run_local_ranks(_worker, args.world, args.per_node, args.params, args.reps, timeout=900)[0]
    print(f"{args.params} parameters, {args.world} ranks as {args.world // args.per_node} nodes x {args.per_node}")
    print("| collective | ms per call |\n|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.1f} |" if seconds >= 1e-3 else f"| {name} | {seconds * 1e3:.3f} |")
    if args.json:
        data = {"args": vars(args) | {"json": str(args.json)}, "seconds": times}
        record.write(args.json, data, None if argv is None else [__file__, *argv])


if __name__ == "__main__":
    main()
