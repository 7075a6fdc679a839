"""The launchers' own host time per kernel call, with the launch stubbed: what our Python costs before Triton's
dispatch (checking the call, working out its tiling, allocating the output), on any machine, no GPU needed.

    python benchmarks/host_cost.py [--numel 6324480] [--reps 2000] [--json benchmarks/data/kernels/host_cost.json]

Each row is one kernel of ``benchmarks/kernels.py``'s table at ``--numel`` elements (default: a Llama-2-7B decoder
layer's shard on one of 32 ranks, 4 nodes x 8 GPUs): the first call (which works out the shape's launch metadata
once) and the median and minimum of ``--reps`` calls after it, inside ``compat.triton.stub_launches`` (the kernel's
``[grid](...)`` returns at once). Triton's own dispatch is not in these figures: ``benchmarks/kernels.py`` measures
the whole host time per call on a GPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kernels  # noqa: E402  (beside this script; imports neither torch nor triton)
import record  # noqa: E402


def measure(numel: int, reps: int) -> list[dict]:
    """One row per kernel of the table (see the module docstring)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the launchers take CPU tensors only under the interpreter
    from lightning_zeropp.compat import triton as compat

    rows = []
    with compat.stub_launches():
        for name, fns, _ in kernels.cases(numel, "cpu"):
            fn = fns["triton"]
            t = time.perf_counter()
            fn()
            first = time.perf_counter() - t
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            rows.append({"kernel": name, "numel": numel, "first_call_us": 1e6 * first,
                         "median_us": 1e6 * statistics.median(times), "min_us": 1e6 * min(times)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=6_324_480)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = measure(args.numel, args.reps)
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; launch stubbed")
    print("| kernel | first call us | us / call (median) | us / call (min) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['first_call_us']:.0f} | {r['median_us']:.1f} | {r['min_us']:.1f} |")
    if args.json:
        data = {"machine": platform.machine(), "numel": args.numel, "rows": rows}
        record.write(args.json, data, None if argv is None else [__file__, *argv], indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
