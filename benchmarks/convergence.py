"""Does ZeRO++ train as well as ZeRO-3? The example GPT on the standard-library corpus, same seed and data order.

Runs the CPU demo configuration (``examples/gpt/configs/cpu_demo.yaml``: bf16-mixed, AdamW, batch 8 x 128 bytes per
rank) through LightningCLI on ``--nodes x --ranks-per-node`` CPU processes of this machine, emulated as that many
nodes (``devices=nodes*ranks_per_node``, ``num_nodes=1``, the strategy's ``ranks_per_node``), once per configuration:

    zero3            ZeRO-3: no quantization, no secondary partition (the baseline)
    zeropp           ZeRO++ defaults: INT8 weights, hpZ, qgZ (INT8 intra-node, INT4 inter-node), parameter-aligned
    zeropp+ef        ... with error feedback on the quantized gradients
    zeropp-int4w     ... with INT4 weights
    zeropp-int4w+ef  ... with INT4 weights and gradient error feedback
    reference-like   the ablation, the reference implementation's choices: INT4 on both gradient hops, blocks over
                     each unit's flat buffer (a block may hold elements of two parameters), INT8 weights, no EF

Every run also carries ``ZeroGradientMonitor``: a parameter whose reduced gradient was exactly zero at some step
(rounded away inside a quantization block shared with larger values) counts as starved. Goals: the defaults within
0.1% of ZeRO-3's final validation loss; INT4 weights with error feedback within 0.2%.

Precision: the demo's bf16-mixed where the CPU multiplies bf16 natively; otherwise (AVX2-only CPUs: PyTorch's bf16
matmul there is ~50x slower than fp32, ~36 s a step on 8 ranks) ``32-true`` (``--precision`` overrides).

Duration: on 2 shared cores, 8 ranks, fp32, a ZeRO++ step took ~3.2 s, a validation of 512 windows ~8.5 s and a
run's start-up ~55 s, so the default 100 steps x 6 configurations take about 40-45 minutes. Results: a table on
stdout, ``--json`` (rewritten after every run; ``val_curve``: ``[steps done, loss]``) and ``--png``.

    python benchmarks/convergence.py [--steps 100] [--configs zero3 zeropp] [--json benchmarks/convergence.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "gpt" / "configs" / "cpu_demo.yaml"
sys.path.insert(0, str(ROOT / "benchmarks"))

from plots import convergence_png, try_plot  # noqa: E402

RUNS = {
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "zeropp": dict(),
    "zeropp+ef": dict(gradient_error_feedback=True),
    "zeropp-int4w": dict(weight_bits=4),
    "zeropp-int4w+ef": dict(weight_bits=4, gradient_error_feedback=True),
    "reference-like": dict(intra_node_gradient_bits=4, block_alignment="flat", weight_bits=8,
                           gradient_error_feedback=False),
    "zeropp-deltas": dict(weight_deltas=True),
    "zeropp-deltas+ef": dict(weight_deltas=True, gradient_error_feedback=True),
}  # fmt: skip
GOALS = {"zeropp": 0.001, "zeropp-int4w+ef": 0.002}  # |relative gap of the final validation loss vs zero3|
MONITOR = "lightning_zeropp.callback.ZeroGradientMonitor"
# ZeroGradientMonitor's end-of-training line (rank 0): the names of the starved parameters
_STARVED_LINE = re.compile(r"ZeroGradientMonitor: \d+ parameter\(s\) had an all-zero gradient at some step: (.*)")


def command(name: str, args: argparse.Namespace, save_dir: Path) -> list[str]:
    """The LightningCLI command line of one configuration."""
    cmd = [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "fit", "--config", str(CONFIG)]
    strategy = dict(RUNS[name], ranks_per_node=args.ranks_per_node)
    for key, value in strategy.items():
        cmd += [f"--trainer.strategy.init_args.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    cmd += [
        "--trainer.devices", str(args.nodes * args.ranks_per_node), "--trainer.num_nodes", "1",
        "--trainer.precision", args.precision,
        "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(max(1, args.steps // args.evals)),
        "--trainer.check_val_every_n_epoch", "null", "--trainer.limit_val_batches", "1.0",
        "--data.val_windows", str(args.val_windows), "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(save_dir), "--model.decay_steps", str(args.steps),
        "--trainer.log_every_n_steps", "1",  # every step: the starved count of the last step is in the CSV
        f"--trainer.callbacks+={MONITOR}",
    ]  # fmt: skip
    return cmd


def run(name: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = command(name, args, out / name)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    (metrics,) = (out / name).glob("lightning_logs/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    # the CSV's step is the 0-based index of the last optimizer step; the curves count the steps done
    val = [(int(r["step"]) + 1, float(r["val/loss"])) for r in rows if r.get("val/loss")]
    train = [(int(r["step"]) + 1, float(r["train/loss"])) for r in rows if r.get("train/loss")]
    starved = [float(r["zeropp/starved_parameters"]) for r in rows if r.get("zeropp/starved_parameters")]
    if not starved:
        raise RuntimeError(f"{name}: no zeropp/starved_parameters in {metrics}; was {MONITOR} added?")
    names = next((m.group(1).split(", ") for m in map(_STARVED_LINE.search, (proc.stdout + proc.stderr).splitlines())
                  if m), [])  # fmt: skip
    return {
        "config": name,
        "strategy": RUNS[name],
        "seconds": seconds,
        "val_curve": val,
        "train_curve": train,
        "starved_parameters": int(max(starved)),
        "starved_names": names,
    }


def cpu_bf16_is_fast(ratio: float = 4.0) -> bool:
    """Whether this CPU multiplies bf16 matrices at least ``1/ratio`` as fast as fp32. Without native bf16
    (AVX512-BF16, AMX) PyTorch falls back to a scalar path about 50x slower than fp32, and bf16-mixed training of
    the demo takes ~36 s a step on 8 ranks instead of ~3 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(256, 256, dtype=dtype), torch.randn(256, 256, dtype=dtype)
            a @ b
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            seconds[dtype] = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return seconds[torch.bfloat16] <= ratio * seconds[torch.float32]


def _gap(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3%}"


def report(results: list[dict], steps: int) -> None:
    base = next((r for r in results if r["config"] == "zero3" and "val_curve" in r), None)
    base_final = base["val_curve"][-1][1] if base and base["val_curve"] else None
    last_step = base["val_curve"][-1][0] if base_final else steps
    print(f"| config | final val loss (step {last_step}) | gap vs zero3 | starved parameters | val curve | minutes |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r or not r["val_curve"]:
            print(f"| {r['config']} | failed | n/a | n/a | n/a | {r.get('seconds', 0) / 60:.1f} |")
            continue
        final = r["val_curve"][-1][1]
        r["final_val_loss"] = final
        r["relative_gap"] = None if base_final is None else (final - base_final) / base_final
        curve = ", ".join(f"{v:.4f}" for _, v in r["val_curve"])
        print(f"| {r['config']} | {final:.4f} | {_gap(r['relative_gap'])} | {r['starved_parameters']} | {curve}"
              f" | {r['seconds'] / 60:.1f} |")  # fmt: skip
    gaps = {r["config"]: r.get("relative_gap") for r in results}
    print()
    for name, goal in GOALS.items():
        if name in gaps:
            gap = gaps[name]
            verdict = "n/a" if gap is None else ("met" if abs(gap) <= goal else "NOT met")
            print(f"goal {name} within {goal:.1%} of zero3: {verdict} ({_gap(gap)})")
    if "reference-like" in gaps:
        print(f"ablation reference-like (INT4 intra-node, flat blocks) gap vs zero3: {_gap(gaps['reference-like'])}")
    for r in results:
        if r.get("starved_names"):
            print(f"{r['config']} starved: {', '.join(r['starved_names'])}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4, help="emulated nodes")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="CPU processes per emulated node")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per configuration")
    parser.add_argument("--evals", type=int, default=4, help="validation points along the run")
    parser.add_argument("--val-windows", type=int, default=512, help="validation windows of 128 bytes (all ranks)")
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16-mixed", "32-true"],
        help="auto: bf16-mixed (the demo's) where the CPU has fast bf16 matmuls, else 32-true",
    )
    parser.add_argument("--configs", nargs="+", default=list(RUNS), choices=list(RUNS), help="subset, in this order")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (after every run)")
    parser.add_argument("--png", type=Path, default=ROOT / "benchmarks" / "convergence.png")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.evals < 1 or args.evals > args.steps:
        parser.error("need 1 <= --evals <= --steps")
    if args.steps % args.evals:
        parser.error("--steps must be a multiple of --evals (the last validation is at the last step)")
    if args.precision == "auto":
        args.precision = "bf16-mixed" if cpu_bf16_is_fast() else "32-true"
        if args.precision == "32-true":
            print("precision: 32-true (this CPU has no fast bf16 matmul; --precision bf16-mixed to force it)")
    meta = {
        "command": " ".join(["python", "benchmarks/convergence.py", *(sys.argv[1:] if argv is None else argv)]),
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "steps": args.steps,
        "evals": args.evals,
        "val_windows": args.val_windows,
        "precision": args.precision,
    }
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="zpp-convergence-") as tmp:
        for name in args.configs:
            started = time.perf_counter()
            try:
                results.append(run(name, args, Path(tmp)))
            except RuntimeError as err:  # keep the other configurations' results
                print(err, file=sys.stderr)
                results.append({"config": name, "error": str(err)[-3000:], "seconds": time.perf_counter() - started})
            print(f"{name}: {(time.perf_counter() - started) / 60:.1f} min", file=sys.stderr)
            if args.json:
                args.json.write_text(json.dumps({"meta": meta, "rows": results}, indent=2))
    report(results, args.steps)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": results}, indent=2))
        print(f"wrote {args.json}")
    plotted = [r for r in results if r.get("val_curve")]
    if args.png and plotted and try_plot(convergence_png, {"meta": meta, "rows": plotted}, args.png):
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
