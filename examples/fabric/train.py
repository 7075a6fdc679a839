"""Train the byte-level GPT of ``examples/gpt`` in a plain Lightning Fabric loop with ZeRO++.

    python examples/fabric/train.py                      # 4 CPU processes acting as 2 nodes x 2 ranks
    python examples/fabric/train.py --strategy zero3     # the plain ZeRO-3 baseline, same loop

The loop is what a Fabric user writes anyway; ZeRO++ is the ``strategy=`` line. It shows the parts a sharded
strategy touches: the optimizer built before ``fabric.setup`` (the strategy points it at the sharded parameters),
gradient accumulation under ``fabric.no_backward_sync``, ``fabric.clip_gradients``, evaluation under
``torch.no_grad``, per-step bytes with ``fabric.log_dict(strategy.comm_ledger.step_metrics())``, and checkpoints
with ``fabric.save`` / ``fabric.load`` (``--checkpoint``, ``--resume``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))

from data import ByteWindows, load_corpus
from model import GPT

from lightning_zeropp.fabric import ZeroPPStrategy

STRATEGIES = {
    "zeropp": {},  # qwZ (INT8 weights) + hpZ + qgZ (INT4 gradients across nodes)
    "zero3": {"quantize_weights": False, "hpz_partition_size": 1, "quantize_gradients": False},
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="zeropp")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=4, help="processes per machine")
    p.add_argument("--num-nodes", type=int, default=1, help="machines")
    p.add_argument("--ranks-per-node", default="2", help="'auto' (the machine) or fewer, to emulate more nodes")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per micro-batch")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus bytes (the standard library's source)")
    p.add_argument("--val-every", type=int, default=30)
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument("--log-dir", default="runs/fabric_demo")
    p.add_argument("--checkpoint", help="save a checkpoint here at the end (sharded folder)")
    p.add_argument("--resume", help="resume from this checkpoint")
    p.add_argument("--summary", help="write a JSON summary here (rank 0)")
    return p.parse_args(argv)


def build_gpt(args: argparse.Namespace) -> torch.nn.Module:
    """The example GPT of ``examples/gpt`` (bytes in, a head tied to the embedding)."""
    return GPT(256, args.block_size, args.n_layer, args.n_head, args.n_embd, dropout=0.0)


def main(argv: list[str] | None = None, build_model: Callable[[argparse.Namespace], torch.nn.Module] = build_gpt):
    """Parses ``argv`` and trains the model ``build_model(args)`` returns (a 256-token vocabulary: bytes)."""
    args = parse(argv)
    per_node = args.ranks_per_node if args.ranks_per_node == "auto" else int(args.ranks_per_node)
    strategy = ZeroPPStrategy(ranks_per_node=per_node, **STRATEGIES[args.strategy])
    fabric = Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        loggers=CSVLogger(args.log_dir, name=args.strategy),
    )
    fabric.launch()
    fabric.seed_everything(1234)

    corpus = load_corpus(max_bytes=args.max_bytes)
    split = int(corpus.numel() * 0.95)
    train_set = ByteWindows(corpus[:split], args.block_size)
    val_set = Subset(ByteWindows(corpus[split:], args.block_size), range(args.val_windows))
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(train_set, args.batch_size, shuffle=True, drop_last=True), DataLoader(val_set, args.batch_size)
    )

    with fabric.init_module():
        model = build_model(args)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    model, optimizer = fabric.setup(model, optimizer)  # shards the model; the optimizer follows its parameters

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} at step {state['step']}")

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    def validate() -> float:
        model.eval()
        with torch.no_grad():
            losses = torch.stack([loss_of(batch) for batch in val_loader])
        model.train()
        return float(fabric.all_reduce(losses.mean(), reduce_op="mean"))

    ledger = strategy.comm_ledger
    ledger.start_step()
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    batches = iter(train_loader)
    while state["step"] < args.steps:
        for micro in range(args.accumulate):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(train_loader)
                batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = loss_of(batch)
                fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=args.clip) if args.clip > 0 else None
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        metrics = {"train/loss": loss.item(), **ledger.step_metrics()}  # this step's bytes; the next starts here
        if norm is not None:
            metrics["train/grad_norm"] = float(norm)
        if state["step"] % args.val_every == 0 or state["step"] == args.steps:
            metrics["val/loss"] = validate()
        fabric.log_dict(metrics, step=state["step"])
        history.append(metrics)
        if state["step"] % 10 == 0 or state["step"] == args.steps:
            inter, intra = metrics["comm/inter_node_MB"], metrics["comm/intra_node_MB"]
            fabric.print(
                f"step {state['step']:4d}  loss {metrics['train/loss']:.3f}"
                f"  inter-node {inter:.2f} MB  intra-node {intra:.2f} MB"
            )
    seconds = time.perf_counter() - start
    if args.checkpoint:
        fabric.save(args.checkpoint, state)
    fabric.logger.finalize("success")
    if fabric.is_global_zero and history:
        summary = {
            "strategy": args.strategy,
            "world_size": fabric.world_size,
            "nodes": strategy.topology.num_nodes,
            "steps": state["step"],
            "steps_this_run": len(history),
            "first_loss": history[0]["train/loss"],
            "last_loss": history[-1]["train/loss"],
            "val_loss": next((h["val/loss"] for h in reversed(history) if "val/loss" in h), math.nan),
            "inter_node_MB_per_step": sum(h["comm/inter_node_MB"] for h in history) / len(history),
            "intra_node_MB_per_step": sum(h["comm/intra_node_MB"] for h in history) / len(history),
            "seconds": seconds,
        }
        print(json.dumps(summary, indent=1))
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
