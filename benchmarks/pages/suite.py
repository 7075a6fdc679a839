"""The test suite's time on the development machine, by tier (``suite_time.py``)."""

from __future__ import annotations

from pages import Source, table

TITLE = "The test suite's time"
QUESTION = """How long do the README's test command and its fast tier take on a 2-core machine?

`benchmarks/suite_time.py` runs `python -m pytest tests -n 3` (the full suite, CI's command) or its fast tier
(`-m "not slow"`) and records the counts, the wall time, the CPU time of all its processes, the machine's load average
before and after, the slowest tests and each test module's seconds."""

SOURCES = ["suite/suite_time.json"]

BUDGET_S = {"full": 15 * 60, "fast": 3 * 60}
"""The project's budgets: the full suite within 15 minutes, the fast tier within 3."""

MODULES_SHOWN = 15
HEADER = ["run", "tier", "passed", "skipped", "failed", "wall", "CPU busy", "load before / after", "Triton cache", ""]

QUIET_LOAD = 1.0
"""A run is quiet when the load average before it was below this (nothing else running on the 2 cores)."""


def _quiet(r: dict) -> bool:
    return r["load_before"] < QUIET_LOAD


def minutes_text(seconds: float) -> str:
    """``14 min 59.5 s``: whole minutes and the seconds to a tenth (rounded once, so never ``60 s``)."""
    tenths = round(seconds * 10)
    return f"{tenths // 600} min {tenths % 600 / 10:g} s"


def _latest(runs: list[dict], tier: str, quiet: bool = True) -> dict | None:
    found = [r for r in runs if r["tier"] == tier and (_quiet(r) or not quiet)]
    return found[-1] if found else None


def _failures(r: dict) -> str:
    if not r.get("failed"):
        return ""
    names = ", ".join(f"`{f}`" for f in r.get("failures", [])) or "not recorded"
    note = f" ({r['failures_note']})" if r.get("failures_note") else ""
    return f"; {r['failed']} failed: {names}{note}"


def _busy(r: dict, cpus: int) -> str:
    """The run's CPU time over its wall time and the machine's CPUs (not recorded before the column existed)."""
    return f"{r['cpu_seconds'] / (r['wall_seconds'] * cpus):.0%}" if "cpu_seconds" in r else "-"


def _cache(r: dict) -> str:
    return r.get("triton_cache", "not recorded")


def _verdict(runs: list[dict], tier: str) -> str:
    r = _latest(runs, tier)
    if r is None:
        return "no quiet run recorded"
    met = r["wall_seconds"] <= BUDGET_S[tier]
    verdict = "met" if met else "NOT met"
    return (f"**{verdict}** ({minutes_text(r['wall_seconds'])}, {r.get('passed', 0)} passed{_failures(r)};"
            f" Triton cache {_cache(r)})")  # fmt: skip


def render(sources: dict[str, Source]) -> str:
    data = sources[SOURCES[0]].data
    runs = data["runs"]
    rows = [
        [i + 1, r["tier"], r.get("passed", 0), r.get("skipped", 0), r.get("failed", 0), minutes_text(r["wall_seconds"]),
         _busy(r, data["cpus"]), f"{r['load_before']:.1f} / {r['load_after']:.1f}", _cache(r),
         "quiet" if _quiet(r) else "beside other work"]
        for i, r in enumerate(runs)
    ]  # fmt: skip
    goals = "\n".join(f"- {tier}: within {BUDGET_S[tier] // 60} min: {_verdict(runs, tier)}" for tier in BUDGET_S)
    parts = [
        f"On a machine with {data['cpus']} CPUs. A run is quiet when the load average before it was below"
        f" {QUIET_LOAD:g}; a run beside other work shows what the suite survives, not what it costs. CPU busy is"
        " the CPU time of the run's processes over its wall time and the CPUs, a lower bound: a process its parent"
        " never waits for (a fork server's ranks may be such) is not counted. Triton cache: cold, the run started"
        " with an empty one, as a fresh CI machine does (the compile gate compiles every kernel it checks); warm, it"
        " used this machine's; not recorded before the column existed.",
        table(HEADER, rows),
        f"## Budgets, by the latest quiet run of each tier\n\n{goals}",
    ]
    full = [r for r in runs if r["tier"] == "full" and r.get("module_seconds")]
    if full:
        modules = list(full[-1]["module_seconds"].items())
        rows = [[f"`{m}`", f"{s:.0f}"] for m, s in modules[:MODULES_SHOWN]]
        rest = sum(s for _, s in modules[MODULES_SHOWN:])
        rows.append([f"the other {len(modules) - MODULES_SHOWN} modules", f"{rest:.0f}"])
        parts.append(
            f"## The longest modules (run {runs.index(full[-1]) + 1}, the latest full run)\n\nSeconds of their tests,"
            " summed over both workers. The suite gives modules out in this order (`tests/conftest.py`), the kernel"
            " modules last and one test at a time.\n\n" + table(["module", "s"], rows)
        )
    for tier in BUDGET_S:
        r = _latest(runs, tier, quiet=False)
        if r and r["slowest"]:
            slow = [[f"{s:.1f}", phase, f"`{test}`"] for s, phase, test in r["slowest"]]
            parts.append(f"## The slowest {tier}-tier tests (latest run)\n\n" + table(["s", "phase", "test"], slow))
    return "\n\n".join(parts)


HEADLINES = {"suite/suite_time.json": [("the full suite, newest run", "full")]}
"""Per data file, the figures ``benchmarks/RESULTS.md`` shows beside its newest run (snippet names)."""


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    runs = sources[SOURCES[0]].data["runs"]
    out = {}
    for tier in BUDGET_S:
        r = _latest(runs, tier) or _latest(runs, tier, quiet=False)
        if r is None:
            out[tier] = "not measured yet"
            continue
        where = "quiet" if _quiet(r) else "beside other work, not a quiet run"
        failed = f", {r['failed']} failed (see the page)" if r.get("failed") else ""
        counts = f"{r.get('passed', 0)} passed, {r.get('skipped', 0)} skipped{failed}"
        out[tier] = f"{minutes_text(r['wall_seconds'])} ({counts}; {where}; budget {BUDGET_S[tier] // 60} min)"
    return out
