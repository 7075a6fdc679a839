"""The weight error every forward pass computes with: qwZ's weights quantized from scratch against weight deltas.

4 gloo ranks as 2 nodes x 2 train a small transformer (``TinyLM``: 2 blocks, n_embd 128, 4 heads, MLP 512, 64
tokens, 256 symbols; 0.43M parameters) in a Fabric loop, 32-true, qgZ on in every configuration. At every step,
rank 0 gathers the exact weights (``get_model_state_dict``, not through the strategy's collectives) before the
forward and compares them with the weights each module's forward used (FSDP2 swaps the gathered weights in): the
relative L2 error over the whole model. With weight deltas the strategy's own figure (``WeightDeltas.error``: the
owners' ``|w - tracked|``, summed over ranks) is reported beside it; the two must agree.

Two regimes: ``adamw`` (lr 1e-3, weight decay 0.1: how transformers are trained) and ``sgd`` (lr 0.3, momentum 0.9:
the test model's, whose steps move the weights by several percent each).

    python benchmarks/weight_error.py [--steps 60] [--regimes adamw sgd] \\
        [--json benchmarks/data/gradient_error/weight_error.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402

CONFIGS = {
    "zeropp": dict(),
    "zeropp_int4w": dict(weight_bits=4),
    "zeropp_deltas": dict(weight_deltas=True),
    "zeropp_deltas8": dict(weight_deltas=True, weight_delta_bits=8),
}
MODEL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, mlp_hidden=512)
REGIMES = {"adamw": dict(optimizer="adamw", lr=1e-3), "sgd": dict(optimizer="sgd", lr=0.3)}
WORLD, PER_NODE, BATCH = 4, 2, 4
SKIP = 5  # steps left out of the steady-state figures (the first forward is exact with deltas)


def measure(steps: int, regimes: list[str]) -> list[dict]:
    import torch

    from lightning_zeropp.spawn import run_local_ranks
    from lightning_zeropp.testing.deltas import deltas_worker
    from lightning_zeropp.testing.models import TinyLM, make_batches

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = TinyLM(**MODEL)
        model.configure_model()
        init_path, data_path = f"{tmp}/init.pt", f"{tmp}/data.pt"
        torch.save(model.net.state_dict(), init_path)
        torch.save(make_batches(WORLD * BATCH * steps, MODEL["block_size"], MODEL["vocab_size"], 0), data_path)
        params = sum(p.numel() for p in model.parameters())
        for regime in regimes:
            for name, kwargs in CONFIGS.items():
                options = dict(REGIMES[regime], model=MODEL, probe_steps=True)
                results = run_local_ranks(
                    deltas_worker, WORLD, dict(ranks_per_node=PER_NODE, **kwargs), init_path, data_path, BATCH,
                    steps, options, timeout=1800,
                )  # fmt: skip
                measured = results[0]["measured"][SKIP:]
                own = results[0]["errors"][SKIP:]
                row = {
                    "regime": regime,
                    "config": name,
                    "params": params,
                    "steps": steps,
                    "mean_error": statistics.fmean(measured),
                    "max_error": max(measured),
                    "last_error": measured[-1],
                    "strategy_reported_mean": statistics.fmean(own) if own else None,
                    "weight_bytes_inter_per_step": _weight_inter(results[0]["ledger"], steps),
                    "curve": results[0]["measured"],
                }
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _weight_inter(ledger: dict, steps: int) -> float:
    kinds = ("weight_all_gather", "weight_delta_all_to_all", "weight_delta_refresh", "weight_all_gather_node_copy")
    return sum(ledger.get(k, (0, 0, 0))[1] for k in kinds) / steps


def _line(r: dict) -> str:
    own = "n/a" if r["strategy_reported_mean"] is None else f"{r['strategy_reported_mean']:.2e}"
    return (
        f"| {r['regime']} | {r['config']} | {r['mean_error']:.2e} | {r['max_error']:.2e} | {r['last_error']:.2e} |"
        f" {own} | {r['weight_bytes_inter_per_step'] / 1e3:.1f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    print(
        f"| regime | config | forward weight error, mean (steps {SKIP + 1}..{args.steps}) | max | last |"
        " strategy's own figure, mean | weight KB/step to the other node, per rank |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = measure(args.steps, args.regimes)
    for regime in args.regimes:
        by = {r["config"]: r for r in rows if r["regime"] == regime}
        ok = by["zeropp_deltas"]["mean_error"] <= 1e-3
        ratio = by["zeropp"]["mean_error"] / by["zeropp_deltas"]["mean_error"]
        print(f"{regime}: goal weight_deltas error <= 1e-3: {ok}; INT8 weights / INT4 deltas error: {ratio:.1f}x")
    if args.json:
        record.write(args.json, rows, None if argv is None else [__file__, *argv])
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
