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

With tensor parallelism (a Llama under torch's usual plan, t ranks of each node splitting every layer), against the
exact 2-D run, which sends what ModelParallelStrategy sends on the same mesh:

    python benchmarks/comm_volume.py --topologies 2x4t2 2x4t4 --json benchmarks/data/bytes_per_step/comm_volume_2d.json
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
    "zeropp_matrices": dict(gradient_quantization_scope="matrices"),
    "zeropp_ef": dict(gradient_error_feedback=True),
    "zeropp_deltas": dict(weight_deltas=True),
    "zeropp_deltas8": dict(weight_deltas=True, weight_delta_bits=8),
}
MODEL = dict(block_size=128, n_layer=4, n_head=4, n_embd=256)

# With tensor parallelism (topologies NODESxRANKSxtT, e.g. 2x4t2): a Llama under torch's usual plan, written for
# ModelParallelStrategy (``testing.models.LlamaModule``); its exact configuration runs the same collectives as
# ModelParallelStrategy on the same mesh (tests/test_tensor_parallel_llama.py: bit-identical), so it is the baseline.
TENSOR_PARALLEL_CONFIGS = {
    "exact_2d": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "qwz": dict(quantize_weights=True, hpz_partition_size=1, quantize_gradients=False),
    "hpz": dict(quantize_weights=False, hpz_partition_size="auto", quantize_gradients=False),
    "qgz": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=True),
    "zeropp": dict(),  # since 2026-12-07 19:10 norm gains and biases exact ("auto" with t > 1)
    "zeropp_quantized_vectors": dict(gradient_quantization_scope="all"),  # every gradient: the defaults until then
    "zeropp_matrices": dict(gradient_quantization_scope="matrices"),  # set outright: the defaults' 2-D reduction
}
LLAMA_MODEL = dict(vocab_size=256, n_layer=4, dim=128, n_head=8, n_kv_head=4, ffn_hidden=344, max_seq_len=64)


def quiet() -> None:
    """Keeps a benchmark's output to its table: Lightning's per-rank banners and known warnings off."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_zeropp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _two_steps(world_size: int, strategy, module, loader) -> dict:
    """Fits ``module`` for two steps with ``strategy`` in bf16-mixed: the second step's bytes by the ledger, the
    first step's cross-node bytes, the persistent memory at the end, the model's parameter count."""
    from lightning.pytorch import Callback, Trainer

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
    trainer.fit(module, loader)
    ledger = strategy.comm_ledger
    per_kind = {k: [t.intra_node_bytes, t.inter_node_bytes] for k, t in ledger.by_kind(step=True).items()}
    return {
        "intra": ledger.step().intra_node_bytes,
        "inter": ledger.step().inter_node_bytes,
        "first_step_inter": first[0],
        "per_kind": per_kind,
        "params": sum(p.numel() for p in module.parameters()),  # whole parameters (a DTensor's global size)
        "persistent_memory": persistent,
    }


def _one_step(rank: int, world_size: int, per_node: int, strategy_kwargs: dict) -> dict:
    quiet()
    import torch
    from model import GPTModule
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, MODEL["block_size"] + 1))
    strategy = ZeroPPStrategy(ranks_per_node=per_node, **strategy_kwargs)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    return _two_steps(world_size, strategy, GPTModule(**MODEL), loader)


def _one_step_2d(rank: int, world_size: int, per_node: int, t: int, strategy_kwargs: dict) -> dict:
    """Two steps of the Llama with ``tensor_parallel_size=t``: the second step's data-parallel bytes (the ledger
    counts the strategy's collectives; the activations' all-reduces of the model's plan stay inside the node and are
    not in it)."""
    quiet()
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy
    from lightning_zeropp.testing.models import LlamaModule, make_batches

    torch.set_num_threads(1)
    tokens, targets = make_batches(2 * 2 * (world_size // t), LLAMA_MODEL["max_seq_len"], LLAMA_MODEL["vocab_size"])
    strategy = ZeroPPStrategy(ranks_per_node=per_node, tensor_parallel_size=t, **strategy_kwargs)
    loader = DataLoader(TensorDataset(tokens, targets), batch_size=2)
    return _two_steps(world_size, strategy, LlamaModule(model=LLAMA_MODEL), loader) | {
        "describe": strategy.comms.describe()
    }


def parse_topology(text: str) -> tuple[int, int, int]:
    """``NODESxRANKS`` or ``NODESxRANKStT`` (tensor-parallel size T inside each node) as (nodes, ranks, t)."""
    shape, _, t = text.partition("t")
    nodes, per_node = (int(v) for v in shape.split("x"))
    return nodes, per_node, int(t) if t else 1


def measure(topologies: list[tuple[int, int, int]]) -> list[dict]:
    from lightning_zeropp.spawn import run_local_ranks

    rows = []
    for nodes, per_node, t in topologies:
        world = nodes * per_node
        base = None
        configs = CONFIGS if t == 1 else TENSOR_PARALLEL_CONFIGS
        for name, kwargs in configs.items():
            if t == 1:
                results = run_local_ranks(_one_step, world, per_node, kwargs, sys_path=[str(EXAMPLE)], timeout=900)
            else:
                results = run_local_ranks(_one_step_2d, world, per_node, t, kwargs, timeout=900)
            inter = max(r["inter"] for r in results)  # ranks differ only by padding; report the busiest
            first = max(r["first_step_inter"] for r in results)
            intra = max(r["intra"] for r in results)
            base = inter if name in ("zero3", "exact_2d") else base
            per_kind = results[0]["per_kind"]
            rows.append(
                {
                    "config": name,
                    "nodes": nodes,
                    "ranks_per_node": per_node,
                    **({"tensor_parallel_size": t, "describe": results[0]["describe"]} if t > 1 else {}),
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
        t = r.get("tensor_parallel_size", 1)
        shape = f"{r['nodes']}x{r['ranks_per_node']}" + (f" t={t}" if t > 1 else "")
        lines.append(
            f"| {shape} | {r['config']} | {r['inter_node_bytes_per_step'] / 1e6:.3f} |"
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


def goals(rows: list[dict]) -> None:
    """Prints each goal the rows bear on: the 1-D rows' against ZeRO-3 and HSDP, the 2-D rows' against the exact
    2-D run."""
    two_d = [r for r in rows if r.get("tensor_parallel_size", 1) > 1 and r["config"] == "zeropp"]
    if two_d:
        ratios = ", ".join(f"{r['nodes']}x{r['ranks_per_node']} t={r['tensor_parallel_size']}:"
                           f" {r['ratio_vs_zero3']:.4f}" for r in two_d)  # fmt: skip
        print(f"\ngoal zeropp inter ratio vs the exact 2-D run (ModelParallelStrategy's collectives) <= 0.3:"
              f" {all(r['ratio_vs_zero3'] <= 0.3 for r in two_d)} ({ratios})")  # fmt: skip
    rows = [r for r in rows if r.get("tensor_parallel_size", 1) == 1]
    if not rows:
        return
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--topologies",
        nargs="+",
        default=["2x2", "4x2"],
        help="NODESxRANKS_PER_NODE, or NODESxRANKStT (tensor parallel)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    topologies = [parse_topology(t) for t in args.topologies]
    rows = measure(topologies)
    print(table(rows))
    goals(rows)
    if args.json:
        record.write(args.json, rows, None if argv is None else [__file__, *argv])
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
