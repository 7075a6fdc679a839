"""Does ZeRO++ train as well as ZeRO-3? The example GPT on the standard-library corpus, same seed and data order.

Runs the CPU demo configuration (4 processes as 2 nodes x 2, bf16-mixed) through LightningCLI for each of
ZeRO-3, qwZ + hpZ, and all three techniques, and compares the validation loss curves.

    python benchmarks/convergence.py [--steps 240] [--json benchmarks/convergence.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "gpt" / "configs" / "cpu_demo.yaml"

RUNS = {
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "qwz+hpz": dict(quantize_weights=True, hpz_partition_size="auto", quantize_gradients=False),
    "zeropp": dict(quantize_weights=True, hpz_partition_size="auto", quantize_gradients=True),
}


def run(name: str, strategy: dict, steps: int, evals: int, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "fit", "--config", str(CONFIG)]
    for key, value in strategy.items():
        cmd += [f"--trainer.strategy.init_args.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    cmd += [
        "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps // evals),
        "--trainer.limit_val_batches", "1.0", "--data.val_windows", "512", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(out / name), "--model.decay_steps", str(steps),
        "--trainer.log_every_n_steps", "10",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    (metrics,) = (out / name).glob("lightning_logs/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    val = [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]
    train = [(int(r["step"]), float(r["train/loss"])) for r in rows if r.get("train/loss")]
    return {"config": name, "seconds": time.perf_counter() - start, "val_curve": val, "train_curve": train}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--evals", type=int, default=4, help="validation points along the run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(name, strategy, args.steps, args.evals, Path(tmp)) for name, strategy in RUNS.items()]
    base = results[0]["val_curve"][-1][1]
    print(f"| config | final val loss (step {args.steps}) | gap vs zero3 | val curve | minutes |")
    print("|---|---|---|---|---|")
    for r in results:
        final = r["val_curve"][-1][1]
        r["final_val_loss"], r["relative_gap"] = final, (final - base) / base
        curve = ", ".join(f"{v:.4f}" for _, v in r["val_curve"])
        print(f"| {r['config']} | {final:.4f} | {r['relative_gap']:+.3%} | {curve} | {r['seconds'] / 60:.1f} |")
    gaps = {r["config"]: r["relative_gap"] for r in results}
    print(f"\ngoal qwz+hpz within 0.2% of zero3: {abs(gaps['qwz+hpz']) <= 0.002}")
    print(f"goal zeropp within 1% of zero3: {abs(gaps['zeropp']) <= 0.01}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
