"""The README's main job, timed: ``python examples/gpt/train.py fit --config examples/gpt/configs/cpu_demo.yaml``.

Runs the command as a user does (a fresh process; 4 ranks acting as 2 nodes x 2), measures its wall time from start
to exit, and reads the last training and validation losses and the bytes per step from the CSV it logs. The README's
"about N minutes" is quoted from these runs (docs/results/quick_start.md). Run it on a quiet machine: the figure is
what a user with the same cores waits.

    python benchmarks/quick_start.py --json benchmarks/data/quick_start/cpu_demo.json
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import record  # noqa: E402

CONFIG = ROOT / "examples" / "gpt" / "configs" / "cpu_demo.yaml"


def last_values(metrics: Path) -> dict[str, float]:
    """The last logged value of each column of a CSVLogger's ``metrics.csv``."""
    last: dict[str, float] = {}
    with metrics.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None):
                    last[key] = float(value)
    return last


def run_once(config: Path) -> dict:
    """One run of the main job: wall seconds, the last losses and bytes per step, the steps it made."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "fit", "--config", str(config),
               "--trainer.logger.init_args.save_dir", tmp, "--trainer.enable_progress_bar", "false"]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ})
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"the main job failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        (metrics,) = Path(tmp).rglob("metrics.csv")
        last = last_values(metrics)
    return {
        "seconds": seconds,
        "steps": int(last.get("step", 0)) + 1,
        "train_loss": last.get("train/loss"),
        "val_loss": last.get("val/loss"),
        "inter_node_MB": last.get("comm/inter_node_MB"),
        "intra_node_MB": last.get("comm/intra_node_MB"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the runs here (benchmarks/record.py)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more (each repeat runs the main job once)")
    runs = []
    for i in range(args.repeats):
        runs.append(run_once(args.config))
        r = runs[-1]
        print(f"run {i + 1}: {r['seconds']:.0f} s, {r['steps']} steps, train {r['train_loss']}, val {r['val_loss']}")
    if args.json:
        config = args.config.resolve()
        shown = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config
        record.write(args.json, {"config": str(shown), "cpus": os.cpu_count(), "runs": runs},
                     [str(HERE / "quick_start.py"), *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
