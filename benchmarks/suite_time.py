"""The test suite's time: runs the README's test command (or its fast tier) and records what it took.

    python benchmarks/suite_time.py --tier fast --json benchmarks/data/suite/suite_time.json   # -m "not slow"
    python benchmarks/suite_time.py --tier full --json benchmarks/data/suite/suite_time.json   # the README's command

Each run adds a row to the file: the tier, passed / skipped / failed, the wall time, the CPU time of all its
processes (ranks included; over the wall time and the CPUs, how busy the run kept the machine), the machine's load
average before and after (a run beside other work is not a quiet run, and the page says so), the slowest tests by
pytest's ``--durations``, and each test module's seconds (the suite gives the longest modules out first, from the
latest full run: ``tests/conftest.py``). The budgets (the full suite within 15 minutes, the fast tier within 3, on a
2-core machine) are judged on the page from the latest quiet run of each tier.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
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

TIERS = {"full": [], "fast": ["-m", "not slow"]}
SUMMARY = re.compile(
    r"^=*\s*(?P<body>\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|warnings?|deselected)\b.*?"
    r"\bin (?P<seconds>[\d.]+)s\b.*?)\s*=*\s*$",
    re.M,
)
"""pytest's closing line, with ``=`` around it or without (``-q``)."""
DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S+)", re.M)


def summary(output: str) -> dict:
    """pytest's closing line as counts and seconds: ``{"passed": 3, "skipped": 1, "seconds": 12.5, ...}``."""
    matches = list(SUMMARY.finditer(output))
    if not matches:
        raise SystemExit("no pytest summary line in the output: did the run start?\n" + output[-2000:])
    body = matches[-1]["body"]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed)", body)}
    return {**counts, "pytest_seconds": float(matches[-1]["seconds"])}


def module_seconds(output: str) -> dict[str, float]:
    """Each test module's seconds (setup, call and teardown of its tests, as ``--durations=0`` lists them; phases
    under 5 ms are not listed), the longest first: what ``tests/conftest.py`` orders the modules by."""
    totals: dict[str, float] = {}
    for m in DURATION.finditer(output):
        module = m["test"].split("::", 1)[0]
        totals[module] = totals.get(module, 0.0) + float(m["seconds"])
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def slowest(output: str, n: int = 10) -> list[list]:
    """The ``n`` longest phases ``--durations`` listed: [seconds, phase, test]."""
    rows = [[float(m["seconds"]), m["phase"], m["test"]] for m in DURATION.finditer(output)]
    return sorted(rows, reverse=True)[:n]


def settle(limit_s: float, quiet: float = 1.0) -> float:
    """Waits until the 1-minute load average falls below ``quiet`` (what another job left fades from it), at most
    ``limit_s`` seconds; returns the load average then."""
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] >= quiet and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def environment(triton_cache: str, empty: str) -> dict[str, str]:
    """The run's environment: this one, with Triton's cache in the empty folder ``empty`` when ``triton_cache`` is
    ``"cold"`` (as on a fresh CI machine: every kernel the compile gate checks is compiled anew)."""
    if triton_cache not in ("cold", "warm"):
        raise ValueError(f"triton_cache={triton_cache!r}: give 'cold' or 'warm'")
    return {**os.environ, "TRITON_CACHE_DIR": empty} if triton_cache == "cold" else dict(os.environ)


def run(tier: str, workers: int, keep_output: Path | None = None, triton_cache: str = "cold") -> dict:
    cmd = [sys.executable, "-m", "pytest", "tests", "-n", str(workers), *TIERS[tier], "-q", "--durations=0",
           "-p", "no:cacheprovider"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="suite-triton-cache-") as empty:
        env = environment(triton_cache, empty)
        load_before = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the run, ranks included, once reaped
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    output = done.stdout + done.stderr
    if keep_output is not None:
        keep_output.write_text(output)
    return {
        "tier": tier,
        "command": f"python -m pytest tests -n {workers}" + (' -m "not slow"' if tier == "fast" else ""),
        "exit": done.returncode,
        "triton_cache": triton_cache,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        **summary(output),
        "failures": sorted(set(re.findall(r"^FAILED (\S+)", output, re.M))),
        "error_tests": sorted(set(re.findall(r"^ERROR (\S+)", output, re.M))),
        "slowest": slowest(output),
        "module_seconds": module_seconds(output),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=list(TIERS), default="fast")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument(
        "--settle",
        type=float,
        default=0,
        help="first wait up to this many seconds for the 1-minute load average to fall below 1 (a quiet start)",
    )
    parser.add_argument("--triton-cache", choices=["cold", "warm"], default="cold",
                        help="cold (the default, as on a fresh CI machine): the run gets an empty Triton cache, so the "
                        "compile gate compiles every kernel; warm: the cache this machine has")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="add the run to this file (benchmarks/record.py)")
    parser.add_argument("--output", type=Path, default=None, help="also write pytest's whole output to this file")
    args = parser.parse_args(argv)
    if args.settle:
        print(f"load average {settle(args.settle):.2f}")
    row = run(args.tier, args.workers, args.output, args.triton_cache)
    print(json.dumps({k: v for k, v in row.items() if k != "slowest"}))
    if args.json:
        rows = json.loads(args.json.read_text())["runs"] if args.json.is_file() else []
        record.write(args.json, {"cpus": os.cpu_count(), "runs": [*rows, row]},
                     [str(HERE / "suite_time.py"), *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
