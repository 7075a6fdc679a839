"""What the second-moment correction costs per optimizer step, next to the AdamW step it corrects.

One process, one CPU thread (or one GPU, ``--device cuda``): one rank's shard of the example GPT (or a larger one)
laid out as the strategy lays a unit's gradient chunk (each parameter's padded shard, parameter-aligned blocks of
``gradient_block_size``), random gradients and noise estimates, AdamW (foreach) with state. Per repeat: the
correction's ``after_backward`` (the norms), ``before_update`` (the lowering of ``exp_avg_sq``), then
``optimizer.step()``; the best of ``--repeats``. The bytes each moves are what it reads and writes of the shard; no
collective is involved (the correction sends nothing).

    python benchmarks/moments_cost.py [--n-embd 256] [--n-layer 4] [--world 4] [--repeats 15] [--json FILE]
    python benchmarks/moments_cost.py --device cuda --both      # a GPU: each way to lower, synchronized
    python benchmarks/moments_cost.py --ops                     # the operators one step dispatches, each way

The example's units (``lightning_zeropp.costs.gpt_units``): vocabulary 256, 128 positions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lightning_zeropp import moments
from lightning_zeropp.compat.torch import TorchDispatchMode
from lightning_zeropp.costs import gpt_units
from lightning_zeropp.kernels.layout import Blocks
from lightning_zeropp.moments import SecondMomentCorrection

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402


def _setup(n_embd: int, n_layer: int, world: int, block: int, alignment: str, device: str = "cpu"):
    """The correction, a step's reductions, AdamW with state (its first step taken) and the parameters, as a rank of
    ``world`` holds the example GPT's units."""
    torch.manual_seed(0)
    correction = SecondMomentCorrection(1 / 12)
    items, params, reductions = [], [], []
    layout = []
    for index, unit in enumerate(gpt_units(256, 128, n_layer, n_embd)):
        lengths = list(unit.shards(world))
        chunk = sum(lengths)
        if alignment == "parameter":
            starts = Blocks.of_segments(lengths, block).starts
        else:
            starts = (*range(0, chunk, block), chunk)
        reduced = SimpleNamespace(name=f"unit{index}")  # what a reduction hands the correction: its unit's name
        reductions.append((reduced, chunk, tuple(starts), torch.rand(len(starts) - 1, device=device)))
        unit_params = []
        for length in lengths:
            param = torch.nn.Parameter(torch.zeros(length, device=device))
            param.grad = torch.randn(length, device=device)
            unit_params.append((param, length))
        params.extend(p for p, _ in unit_params)
        layout.append((reduced, unit_params))
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), foreach=True)
    correction.judge_optimizer(optimizer)  # corrected: AdamW
    for reduced, chunk, starts, _ in reductions:
        correction._wanted[reduced.name] = True  # the units hold its parameters (no sharded module here)
        correction.buffer(reduced, chunk, starts, torch.device(device))
    for reduced, unit_params in layout:
        entry, offset = correction._units[reduced.name], 0
        for param, length in unit_params:
            items.append((entry, param, offset, length))
            offset += length
    correction.reduced_parameters = lambda: iter(items)
    optimizer.step()  # the state exists: every later step is corrected before its update
    return correction, reductions, optimizer, params


def _fresh(correction: SecondMomentCorrection, reductions: list) -> None:
    correction.new_step()
    for reduced, chunk, starts, noise in reductions:  # a step's reductions: each unit's estimates, fresh
        correction.buffer(reduced, chunk, starts, noise.device).copy_(noise)


class _Ops(TorchDispatchMode):
    """Counts the operators that compute (each at least one kernel launch on a GPU); views launch nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def count_ops(n_embd: int, n_layer: int, world: int, block: int, alignment: str, per_parameter: bool) -> dict:
    """The operators a step of the correction dispatches (the norms after the backward, the lowering) once its first
    step is done, lowering one parameter at a time (the CPU's way) or a unit at a time (the GPUs' way), each run on
    this CPU: each operator that computes is at least one kernel launch on a GPU."""
    correction, reductions, optimizer, params = _setup(n_embd, n_layer, world, block, alignment)
    saved = set(moments.PER_PARAMETER)
    moments.PER_PARAMETER.clear()
    moments.PER_PARAMETER.update({"cpu"} if per_parameter else set())
    try:
        for _ in range(2):  # the second step counts: the first builds what later steps reuse (block owners)
            _fresh(correction, reductions)
            correction.backward_done()
            correction.before_update(optimizer, True)
            optimizer.step()
            correction.after_update(optimizer, True)
        _fresh(correction, reductions)
        with _Ops() as ops:
            correction.backward_done()
            correction.before_update(optimizer, True)
    finally:
        moments.PER_PARAMETER.clear()
        moments.PER_PARAMETER.update(saved)
    return dict(n_embd=n_embd, alignment=alignment, parameters=len(params), units=len(reductions),
                lowering="per parameter" if per_parameter else "per unit", ops=ops.count)  # fmt: skip


def measure(
    n_embd: int,
    n_layer: int,
    world: int,
    block: int,
    repeats: int,
    alignment: str,
    device: str = "cpu",
    per_parameter: bool | None = None,
) -> dict:
    """The best of ``repeats`` steps' times of each part; ``per_parameter`` None: the device's own way to lower."""
    correction, reductions, optimizer, params = _setup(n_embd, n_layer, world, block, alignment, device)
    saved = set(moments.PER_PARAMETER)
    if per_parameter is not None:
        moments.PER_PARAMETER.clear()
        moments.PER_PARAMETER.update({torch.device(device).type} if per_parameter else set())
    way = "per parameter" if torch.device(device).type in moments.PER_PARAMETER else "per unit"
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    best = {"norms_ms": float("inf"), "lowering_ms": float("inf"), "adamw_ms": float("inf")}
    try:
        parts = (correction.backward_done, lambda: correction.before_update(optimizer, True), optimizer.step)
        for _ in range(repeats):
            _fresh(correction, reductions)
            for key, part in zip(best, parts, strict=True):
                sync()
                start = time.perf_counter()
                part()
                sync()
                best[key] = min(best[key], (time.perf_counter() - start) * 1e3)
            correction.after_update(optimizer, True)
    finally:
        moments.PER_PARAMETER.clear()
        moments.PER_PARAMETER.update(saved)
    elements = sum(p.numel() for p in params)
    return dict(n_embd=n_embd, n_layer=n_layer, world=world, alignment=alignment, shard_elements=elements,
                device=device, lowering=way,
                parameters=len(params), corrected=correction.corrected, **best,
                ratio=(best["norms_ms"] + best["lowering_ms"]) / best["adamw_ms"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-embd", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ops", action="store_true", help="count the operators of one step instead of timing")
    parser.add_argument("--device", default="cpu", help="where the shard lies (cuda: synchronized around each part)")
    parser.add_argument("--both", action="store_true", help="time both ways to lower (per parameter, per unit)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.ops:
        rows = [
            count_ops(n_embd, args.n_layer, args.world, args.block, alignment, per_parameter)
            for n_embd in args.n_embd
            for alignment in ("parameter", "flat")
            for per_parameter in (True, False)
        ]
        print("| n_embd | blocks | parameters | units | lowering | operators per step |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            cells = (r["n_embd"], r["alignment"], r["parameters"], r["units"], r["lowering"], r["ops"])
            print("| " + " | ".join(str(c) for c in cells) + " |")
        _write(args.json, rows)
        return
    ways = (True, False) if args.both else (None,)
    rows = [
        measure(n_embd, args.n_layer, args.world, args.block, args.repeats, alignment, args.device, way)
        for n_embd in args.n_embd
        for alignment in ("parameter", "flat")
        for way in ways
    ]
    print(f"device: {args.device}")
    print(
        "| n_embd | blocks | lowering | shard elements | norms ms | lowering ms | AdamW step ms | correction / AdamW |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n_embd']} | {r['alignment']} | {r['lowering']} | {r['shard_elements']:,} | {r['norms_ms']:.2f} |"
              f" {r['lowering_ms']:.2f} | {r['adamw_ms']:.2f} | {r['ratio']:.2f} |")  # fmt: skip
    _write(args.json, rows)


def _write(path: str | None, rows: list[dict]) -> None:
    if path:
        command = "python benchmarks/moments_cost.py " + " ".join(sys.argv[1:])
        record.write(path, {"command": command, "rows": rows}, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
