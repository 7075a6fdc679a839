"""Bytes per training step, inside and across nodes, for ZeRO-3, HSDP, quantized HSDP and each ZeRO++ technique (from
the ledger).

Two optimizer steps of the example GPT (the CPU demo's shape) in bf16-mixed, on gloo ranks emulating
``nodes x ranks_per_node``; the figures are the second step's (the steady state: with weight deltas the first step
fills the node copies exactly; its bytes are reported separately). The ledger's accounting is logical per peer
(docs/index.md, "How ZeRO++ maps onto FSDP2"), so the figures are exact and repeatable; ``benchmarks/cluster.py``
measures what a real link carries. Each row keeps every rank's bytes by kind and persistent memory (``per_rank``:
ranks differ where shards or quantized HSDP's rail pieces split unevenly); ``tests/test_costs.py`` checks the planner
against each.

    python benchmarks/comm_volume.py [--topologies 2x2 3x2 4x2] [--json benchmarks/data/bytes_per_step/comm_volume.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
EXAMPLE = ROOT / "examples" / "gpt"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402

CONFIGS = {
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "hsdp": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=False),
    "qhsdp": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True),
    "qhsdp_bf16": dict(
        sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True, hsdp_gather_bits=16
    ),
    "qhsdp_ef": dict(
        sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True, gradient_error_feedback=True
    ),
    "qhsdp_int4": dict(
        sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=True, hsdp_gather_bits=4
    ),
    "qwz": dict(quantize_weights=True, hpz_partition_size=1, quantize_gradients=False),
    "hpz": dict(quantize_weights=False, hpz_partition_size="auto", quantize_gradients=False),
    "qgz": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=True),
    "zeropp": dict(),
    "zeropp_ef": dict(gradient_error_feedback=True),
    "zeropp_deltas": dict(weight_deltas=True),
    "zeropp_deltas8": dict(weight_deltas=True, weight_delta_bits=8),
}
MODEL = dict(block_size=128, n_layer=4, n_head=4, n_embd=256)


def quiet() -> None:
    """Keeps a benchmark's output to its table: Lightning's per-rank banners and known warnings off."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_zeropp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _one_step(rank: int, world_size: int, per_node: int, strategy_kwargs: dict) -> dict:
    quiet()
    import torch
    from lightning.pytorch import Callback, Trainer
    from model import GPTModule
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, MODEL["block_size"] + 1))
    strategy = ZeroPPStrategy(ranks_per_node=per_node, **strategy_kwargs)
    first: list[int] = []
    persistent: dict[str, int] = {}

    class PerStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 1:
                first.append(strategy.comm_ledger.step().inter_node_bytes)
            strategy.comm_ledger.start_step()

        def on_train_end(self, trainer, pl_module) -> None:  # before teardown frees the weight deltas' copies
            persistent.update(strategy.persistent_memory)

    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, precision="bf16-mixed", max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[PerStep()],
    )  # fmt: skip
    trainer.fit(GPTModule(**MODEL), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8))
    ledger = strategy.comm_ledger
    per_kind = {k: [t.intra_node_bytes, t.inter_node_bytes] for k, t in ledger.by_kind(step=True).items()}
    params = sum(p.numel() for p in trainer.lightning_module.parameters())
    return {
        "intra": ledger.step().intra_node_bytes,
        "inter": ledger.step().inter_node_bytes,
        "first_step_inter": first[0],
        "per_kind": per_kind,
        "params": params,
        "persistent_memory": persistent,
    }


def measure(topologies: list[tuple[int, int]]) -> list[dict]:
    from lightning_zeropp.spawn import run_local_ranks

    rows = []
    for nodes, per_node in topologies:
        world = nodes * per_node
        base = None
        for name, kwargs in CONFIGS.items():
            results = run_local_ranks(_one_step, world, per_node, kwargs, sys_path=[str(EXAMPLE)], timeout=900)
            inter = max(r["inter"] for r in results)  # ranks differ only by padding; report the busiest
            first = max(r["first_step_inter"] for r in results)
            intra = max(r["intra"] for r in results)
            base = inter if name == "zero3" else base
            per_kind = results[0]["per_kind"]
            rows.append(
                {
                    "config": name,
                    "nodes": nodes,
                    "ranks_per_node": per_node,
                    "params": results[0]["params"],
                    "inter_node_bytes_per_step": inter,
                    "first_step_inter_node_bytes": first,
                    "intra_node_bytes_per_step": intra,
                    "ratio_vs_zero3": inter / base,
                    "backward_all_gather_inter_node_bytes": per_kind.get("weight_all_gather_secondary", [0, 0])[1]
                    + per_kind.get("weight_all_gather_backward", [0, 0])[1],
                    "per_kind": per_kind,
                    "persistent_memory": results[0]["persistent_memory"],
                    "per_rank": [
                        {"per_kind": r["per_kind"], "persistent_memory": r["persistent_memory"]} for r in results
                    ],
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| nodes x ranks | config | inter-node MB/step | intra-node MB/step | inter ratio vs zero3"
        " | backward AG inter MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['nodes']}x{r['ranks_per_node']} | {r['config']} | {r['inter_node_bytes_per_step'] / 1e6:.3f} |"
            f" {r['intra_node_bytes_per_step'] / 1e6:.3f} | {r['ratio_vs_zero3']:.4f} |"
            f" {r['backward_all_gather_inter_node_bytes'] / 1e6:.3f} |"
        )
    return "\n".join(lines)


def _row(rows: list[dict], config: str, like: dict) -> dict:
    """The row of ``config`` at ``like``'s topology."""
    return next(
        r
        for r in rows
        if (r["config"], r["nodes"], r["ranks_per_node"]) == (config, like["nodes"], like["ranks_per_node"])
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", nargs="+", default=["2x2", "4x2"], help="NODESxRANKS_PER_NODE")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    topologies = [tuple(int(v) for v in t.split("x")) for t in args.topologies]
    rows = measure(topologies)
    print(table(rows))
    zeropp = [r for r in rows if r["config"] == "zeropp"]
    hpz = [r for r in rows if r["config"] == "hpz"]
    ratios = ", ".join(f"{r['ratio_vs_zero3']:.4f}" for r in zeropp)
    hpz_zero = all(r["backward_all_gather_inter_node_bytes"] == 0 for r in hpz)
    print(f"\ngoal zeropp inter ratio <= 0.26: {all(r['ratio_vs_zero3'] <= 0.26 for r in zeropp)} ({ratios})")
    print(f"goal hpz backward all-gather inter-node bytes == 0: {hpz_zero}")
    deltas = [r for r in rows if r["config"] == "zeropp_deltas"]
    ratios = ", ".join(f"{r['ratio_vs_zero3']:.4f}" for r in deltas)
    print(f"goal zeropp_deltas inter ratio <= 0.12: {all(r['ratio_vs_zero3'] <= 0.12 for r in deltas)} ({ratios})")
    for name, goal in (("qhsdp", 0.3), ("qhsdp_bf16", None)):
        vs_hsdp = [r["inter_node_bytes_per_step"] / _row(rows, "hsdp", r)["inter_node_bytes_per_step"]
                   for r in rows if r["config"] == name]  # fmt: skip
        ratios = ", ".join(f"{v:.4f}" for v in vs_hsdp)
        head = f"goal {name} inter ratio vs hsdp <= {goal}: {all(v <= goal for v in vs_hsdp)}" if goal else name
        print(f"{head} ({ratios} of hsdp's cross-node bytes)")
    if args.json:
        record.write(args.json, rows, None if argv is None else [__file__, *argv])
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
