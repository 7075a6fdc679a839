"""Peak host memory of each rank while the Trainer sets up a model built on the meta device, and in its first step.

The example GPT widened (default: 20 blocks of width 2048, 1.01B parameters) is built under
``trainer.init_module(empty_init=True)`` on every rank, then ``trainer.fit`` shards it and materializes each rank's
shards (``reset_parameters``), and trains one step. Each rank reports its peak resident set size (``ru_maxrss``)
before the model exists (the process baseline: Python, torch, Lightning, the process group), at the start of training
(setup done), and after the first step; against its shard of the fp32 weights (parameters / ranks x 4 bytes). A rank
that held the whole model at any point would show it: 4x the shard at 4 ranks. The step uses SGD (gradients: one
more shard; AdamW's two moments would add two) on one sequence of 64 tokens, ZeRO++ defaults at 2 nodes x 2.

    python benchmarks/init_memory.py [--n-layer 20 --n-embd 2048] [--ranks 4] \\
        [--json benchmarks/data/setup_memory/init_memory.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
EXAMPLE = ROOT / "examples" / "gpt"
MB = 1 << 20
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402


def measure(world: int, n_layer: int, n_embd: int, config: str = "zeropp", steps: int = 1) -> list[dict]:
    from lightning_zeropp.spawn import run_local_ranks
    from lightning_zeropp.testing.memory import measure_rank

    return run_local_ranks(measure_rank, world, n_layer, n_embd, config, steps, sys_path=[str(EXAMPLE)], timeout=3000)


def table(rows: list[dict]) -> str:
    lines = [
        "| rank | shard MB | baseline MB | setup peak MB | setup - baseline (x shard) | first step peak MB |"
        " first step - baseline (x shard) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shard = r["local_bytes"]
        lines.append(
            f"| {r['rank']} | {shard / MB:.0f} | {r['baseline'] / MB:.0f} | {r['setup'] / MB:.0f} |"
            f" {(r['setup'] - r['baseline']) / MB:.0f} ({(r['setup'] - r['baseline']) / shard:.2f}) |"
            + (
                f" {r['first_step'] / MB:.0f} | {(r['first_step'] - r['baseline']) / MB:.0f}"
                f" ({(r['first_step'] - r['baseline']) / shard:.2f}) |"
                if "first_step" in r
                else " - | - |"
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=20)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--config", choices=["zeropp", "zero3"], default="zeropp")
    parser.add_argument("--steps", type=int, default=1, help="0: setup alone")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = measure(args.ranks, args.n_layer, args.n_embd, args.config, args.steps)
    params = rows[0]["params"]
    print(f"{params / 1e9:.3f}B parameters ({params * 4 / MB:.0f} MB in fp32) on {args.ranks} ranks, {args.config}\n")
    print(table(rows))
    worst = max((r["setup"] - r["baseline"]) / r["local_bytes"] for r in rows)
    print(f"\ngoal setup peak <= 1.5 x shard + baseline: {worst <= 1.5} (worst rank {worst:.2f} x shard)")
    if args.json:
        data = {"params": params, "ranks": args.ranks, "config": args.config, "steps": args.steps, "rows": rows}
        record.write(args.json, data, None if argv is None else [__file__, *argv])
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
