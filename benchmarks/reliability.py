"""How the job ends when something goes wrong: each fault injected for real, timed, with the first line a user sees.

Four gloo ranks as 2 nodes x 2 train TinyLM with qwZ, hpZ and qgZ on, and one scenario at a time goes wrong: a rank
freezes (SIGSTOP) or dies mid-step, the launcher and the Trainer disagree on the job's shape, a YAML value is out
of range. A row holds what is expected, what happened, and how long after the fault every other rank had raised.
The checkpoint scenarios (a save killed at every point, a full disk, another optimizer, a truncated shard) are
tests of their own: ``tests/test_checkpoint_paths.py`` and ``tests/test_checkpoint_errors.py``.

    python benchmarks/reliability.py [--timeout 20] [--json benchmarks/data/reliability/reliability.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_zeropp.spawn import run_local_ranks
from lightning_zeropp.testing.faults import fault_worker, launch_worker

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
EXAMPLE = ROOT / "examples" / "gpt"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:110] if text.strip() else ""


def rank_fault(fault: str, timeout_s: float) -> dict:
    """The last rank freezes or dies at step 2; seconds until every survivor raised, and their first line."""
    with tempfile.TemporaryDirectory() as out:
        start = time.time()
        try:
            run_local_ranks(fault_worker, 4, out, fault, timeout_s, 2, ranks_per_machine=2, timeout=timeout_s + 120)
        except RuntimeError:
            pass
        ended = time.time() - start
        reports = [json.loads(p.read_text()) for p in sorted(Path(out).glob("survivor*.json"))]
    raised = [r for r in reports if r["error"]]
    observed = f"{len(raised)} of 3 survivors raised" + (f": {_first_line(raised[0]['error'])}" if raised else "")
    return {
        "scenario": f"a rank {'freezes (SIGSTOP)' if fault == 'freeze' else 'dies (exit)'} at step 2,"
        f" timeout={timeout_s:g}s",
        "expected": "every survivor raises within timeout + 30 s" if fault == "freeze" else "every survivor raises",
        "observed": observed,
        "seconds": max((r["after_fault_s"] for r in raised), default=ended),
        "ok": len(raised) == 3 and max(r["after_fault_s"] for r in raised) < timeout_s + 30,
    }


def launch_mismatch(ranks_per_machine: int, num_nodes: int, devices: int) -> dict:
    """The launcher places 4 ranks ``ranks_per_machine`` per machine; the Trainer says ``num_nodes`` x ``devices``."""
    start = time.time()
    try:
        results = run_local_ranks(launch_worker, 4, num_nodes, devices, ranks_per_machine=ranks_per_machine)
        errors = [r["error"] for r in results]
    except RuntimeError as err:
        errors = [str(err)]
    refused = [e for e in errors if e.startswith("ZeroPPStrategy: the launcher and the Trainer")]
    return {
        "scenario": f"launcher {4 // ranks_per_machine} x {ranks_per_machine}, Trainer {num_nodes} x {devices}",
        "expected": "every rank refuses before any group exists, both shapes named",
        "observed": f"{len(refused)} of 4 ranks refused: {_first_line(errors[0])}",
        "seconds": time.time() - start,
        "ok": len(refused) == 4,
    }


def bad_yaml(key: str, value: str) -> dict:
    """A LightningCLI config with an out-of-range strategy value: the line of stderr that names the key."""
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "bad.yaml"
        strategy = "class_path: lightning_zeropp.ZeroPPStrategy\n    init_args:\n"
        bad.write_text(f"trainer:\n  strategy:\n    {strategy}      {key}: {value}\n")
        config = EXAMPLE / "configs" / "cpu_demo.yaml"
        start = time.time()
        cmd = [sys.executable, str(EXAMPLE / "train.py"), "fit", "--config", str(config), "--config", str(bad)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = proc.stderr[proc.stderr.find("error:") :].splitlines()
    at = next((i + 1 for i, line in enumerate(lines) if f'"{key}"' in line), None)
    return {
        "scenario": f"YAML `{key}: {value}`",
        "expected": "refused at parse time, the key named, no traceback",
        "observed": f"exit {proc.returncode}; key on error line {at}; traceback: {'Traceback' in proc.stderr}",
        "seconds": time.time() - start,
        "ok": proc.returncode != 0 and at is not None and "Traceback" not in proc.stderr,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=20, help="the strategy's timeout for the rank faults (s)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    rows = [
        rank_fault("freeze", args.timeout),
        rank_fault("die", args.timeout),
        launch_mismatch(2, 1, 2),
        launch_mismatch(4, 2, 2),
        bad_yaml("gradient_block_size", "0"),
        bad_yaml("gradient_pieces", "0"),
    ]
    print(f"| {'scenario':<48} | {'expected':<52} | seconds | ok | observed")
    for r in rows:
        print(f"| {r['scenario']:<48} | {r['expected']:<52} | {r['seconds']:7.1f} | {r['ok']!s:<2} | {r['observed']}")
    if args.json:
        record.write(args.json, rows, indent=1)


if __name__ == "__main__":
    main()
