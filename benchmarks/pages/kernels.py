"""The Triton kernels: what their compiled code can do (``kernels.py --static``) and what one H200 measured."""

from __future__ import annotations

from collections import defaultdict

from pages import Source, table

TITLE = "Kernels"
QUESTION = """How fast can the Triton kernels be, by their compiled code and on a GPU, and are they bit-exact there?

Two kinds of evidence. The static model compiles every kernel specialization the strategy launches for a GPU target on
a machine without one and reads the code (no timing). The GPU check ran the kernels' tests, a smoke script and the
bandwidth table on one GPU; its bandwidth figures count the Python launcher in every kernel time (below)."""

STATIC = "kernels/kernels_static.json"
SMOKE = "kernels/gpu_check_h200/gpu_smoke.json"
BANDWIDTH = "kernels/gpu_check_h200/kernels_256mb.json"
SOURCES = [STATIC, SMOKE, BANDWIDTH]

LOGS = "../../benchmarks/data/kernels/gpu_check_h200"
RAW_LOGS = {
    "summary.txt": "each step of `benchmarks/gpu_check.sh`: its exit status and seconds",
    "device.txt": "the GPU, its clock, memory and driver, and the torch / Triton / Lightning versions",
    "kernels_gpu.txt": "`tests/test_kernels_gpu.py` and `tests/test_kernels_rotation.py` on the GPU (the later run)",
    "kernels_gpu_run1.txt": "the same tests, the first run",
    "kernels.txt": "`benchmarks/kernels.py` at 256 MB: the bandwidth table above was parsed from it",
    "kernels_16mb_run1.txt": "`benchmarks/kernels.py` at 16 MB, the first run",
    "gpu_smoke.txt": "`benchmarks/gpu_smoke.py`: its log, the smoke JSON at the end",
}

SECTIONS = [
    "default path (parameter-aligned, bf16, INT8 weights, INT8 -> INT4 gradients, nearest)",
    "other parameter-aligned specializations",
    "rotated blocks (gradient_rotation='hadamard'), either layout",
    "uniform blocks (block_alignment='flat')",
]
SHORT = {
    SECTIONS[0]: "default path",
    SECTIONS[1]: "other parameter-aligned",
    SECTIONS[2]: 'rotated (`gradient_rotation="hadamard"`)',
    SECTIONS[3]: 'uniform (`block_alignment="flat"`)',
}
OPERATIONS = ["quantize", "dequantize", "dequantize_reduce", "dequantize_reduce_quantize"]

LEGEND = [
    ["registers, occupancy", "registers per thread, and the share of an SM's warps that can be resident with them"],
    ["SASS instr / element / thread", "instructions a thread executes per element on a full tile: the shortest path"
     " to exit without masked accesses in the control-flow graph"],
    ["bytes / element", "the operation's minimum bytes per element: inputs read once, outputs written once (wire"
     " padding ignored)"],
    ["payload bytes / access", "the narrowest and the widest payload access; 16 is a full vector access"],
    ["issue ceiling vs HBM", "the bytes per second the SMs could move if issuing instructions were the only limit, as"
     " a share of the GPU's HBM bandwidth (the constants are `benchmarks/kernels.py`'s). At or above 100% the kernel"
     " can be memory-bound; below, instruction issue is the bottleneck. An upper bound, not a prediction: latency,"
     " dual issue and slower pipes are ignored"],
    ["sizes", "buffer sizes that are multiples of 16 elements, or odd ones (where the compiler can prove less"
     " alignment)"],
    ["launched as", "the strategy's launches the specialization serves"],
]  # fmt: skip

NEAREST_GOAL, STOCHASTIC_GOAL = 1.0, 0.6
"""The goals set when the kernels were audited: an instruction-issue ceiling of at least this share of H200 HBM
bandwidth, for nearest and for stochastic rounding."""


def _sections(rows: list[dict]) -> list[str]:
    extra = sorted({r["section"] for r in rows} - set(SECTIONS))
    return [s for s in SECTIONS if any(r["section"] == s for r in rows)] + extra


def _stochastic(row: dict) -> bool:
    return "stochastic" in row["name"]


def _meets(row: dict) -> bool:
    return row["issue_ceiling_vs_H200_hbm"] >= _goal_of(row["name"])


def _span(values: list[float], fmt: str = "{:.0f}", scale: float = 1.0, unit: str = "") -> str:
    lo, hi = fmt.format(scale * min(values)) + unit, fmt.format(scale * max(values)) + unit
    return lo if lo == hi else f"{lo}-{hi}"


def _pcts(values: list[float], digits: int = 0) -> str:
    return _span(values, f"{{:.{digits}f}}", 100, "%")


def _roles(rows: list[dict]) -> str:
    roles = []
    for r in rows:
        for part in r["label"].split(" | "):
            words = part.split()
            cut = next((i for i, w in enumerate(words) if w in ("aligned", "odd")), len(words))
            role = " ".join(words[:cut])
            if role and role not in roles:
                roles.append(role)
    return ", ".join(roles)


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**NOT met**"


def _count(rows: list[dict]) -> str:
    return f"{sum(_meets(r) for r in rows)} of {len(rows)}" if rows else "-"


def _summary(rows: list[dict]) -> str:
    out = []
    for s in _sections(rows):
        rs = [r for r in rows if r["section"] == s]
        nearest = [r for r in rs if not _stochastic(r)]
        stochastic = [r for r in rs if _stochastic(r)]
        out.append([SHORT.get(s, s), len(rs), _count(nearest), _count(stochastic),
                    _pcts([r["issue_ceiling_vs_H200_hbm"] for r in rs]), _span([r["registers"] for r in rs]),
                    _pcts([r["occupancy"] for r in rs]), sum(r["spills"] for r in rs)])  # fmt: skip
    return table(["layout", "specializations", f"nearest >= {NEAREST_GOAL:.0%}", f"stochastic >= {STOCHASTIC_GOAL:.0%}",
                  "issue ceiling vs H200 HBM", "registers", "occupancy", "spills"], out)  # fmt: skip


def _goals(rows: list[dict]) -> str:
    default = [r for r in rows if r["section"] == SECTIONS[0]]
    aligned = [r for r in rows if r["section"] in SECTIONS[:2]]
    nearest = [r for r in rows if not _stochastic(r)]
    stochastic = [r for r in rows if _stochastic(r)]
    spills = [r for r in rows if r["spills"]]
    lines = [
        f"- No register spills in any specialization: {_verdict(not spills)} ({len(rows) - len(spills)} of {len(rows)}"
        " without one).",
        f"- Every default-path kernel's issue ceiling >= {NEAREST_GOAL:.0%} of H200 HBM: "
        f"{_verdict(all(_meets(r) for r in default))} ({_count(default)},"
        f" {_pcts([r['issue_ceiling_vs_H200_hbm'] for r in default])}).",
        f"- Parameter-aligned specializations (the default layout, default path included) meeting their goal: "
        f"{_count(aligned)} ({_count([r for r in aligned if not _stochastic(r)])} with nearest rounding, "
        f"{_count([r for r in aligned if _stochastic(r)])} stochastic).",
        f"- Every nearest-rounding specialization >= {NEAREST_GOAL:.0%}: {_verdict(all(map(_meets, nearest)))}"
        f" ({_count(nearest)}); every stochastic one >= {STOCHASTIC_GOAL:.0%}:"
        f" {_verdict(all(map(_meets, stochastic)))} ({_count(stochastic)}).",
    ]  # fmt: skip
    return "\n".join(lines)


def _misses(rows: list[dict]) -> str:
    missing: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        if not _meets(r):
            missing[(r["section"], r["name"])].append(r["issue_ceiling_vs_H200_hbm"])
    order = _sections(rows)
    misses = [
        [SHORT.get(s, s), name, f"{_goal_of(name):.0%}", _pcts(v, 1), len(v)]
        for (s, name), v in sorted(missing.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1]))
    ]
    if not misses:
        return "Every specialization meets its goal."
    return table(["layout", "kernel", "goal", "issue ceiling vs H200 HBM", "rows"], misses)


def _goal_of(name: str) -> float:
    return STOCHASTIC_GOAL if "stochastic" in name else NEAREST_GOAL


def _default_path(rows: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["section"] == SECTIONS[0]:
            groups[(r["name"], r["block"], r["aligned"])].append(r)
    out = []
    for (name, block, aligned), rs in groups.items():
        out.append([name, _roles(rs), block, "multiples of 16" if aligned else "odd",
                    _span([r["registers"] for r in rs]), _pcts([r["occupancy"] for r in rs]),
                    _span([r["instructions_per_thread_element"] for r in rs], "{:.1f}"),
                    _span([r["bytes_per_element"] for r in rs], "{:.2f}"), rs[0]["payload_access_bytes"],
                    _pcts([r["issue_ceiling_vs_H100_hbm"] for r in rs]),
                    _pcts([r["issue_ceiling_vs_H200_hbm"] for r in rs])])  # fmt: skip
    out.sort(key=lambda row: (OPERATIONS.index(row[0].split()[0]) if row[0].split()[0] in OPERATIONS else 9, row[0]))
    header = ["kernel", "launched as", "block", "sizes", "registers", "occupancy", "SASS instr / element / thread",
              "bytes / element", "payload bytes / access", "issue ceiling vs H100 HBM", "vs H200 HBM"]  # fmt: skip
    return table(header, out)


def _by_operation(rows: list[dict]) -> str:
    out = []
    for s in _sections(rows):
        for op in OPERATIONS:
            rs = [r for r in rows if r["section"] == s and r["name"].split()[0] == op]
            if not rs:
                continue
            out.append([SHORT.get(s, s), op, len(rs), _span([r["registers"] for r in rs]),
                        _pcts([r["occupancy"] for r in rs]),
                        _span([r["instructions_per_thread_element"] for r in rs], "{:.1f}"),
                        _span([r["bytes_per_element"] for r in rs], "{:.2f}"),
                        _pcts([r["issue_ceiling_vs_H100_hbm"] for r in rs]),
                        _pcts([r["issue_ceiling_vs_H200_hbm"] for r in rs]), _count(rs)])  # fmt: skip
    return table(["layout", "operation", "specializations", "registers", "occupancy", "SASS instr / element / thread",
                  "bytes / element", "issue ceiling vs H100 HBM", "vs H200 HBM", "meeting the goal"], out)  # fmt: skip


def _smoke(smoke: dict) -> str:
    k, t = smoke["kernels"], smoke["training"]
    losses = t["final_loss"]
    same = len(set(losses.values())) == 1
    lines = [
        "- qgZ's three kernels at production shapes, bit for bit against the torch twins:"
        f" {_verdict(k['qgz_bit_exact'])}",
        f"- qwZ INT8 over several ranks' rows, bit for bit: {_verdict(k['qwz_int8_bit_exact'])}",
        f"- qwZ INT4, bit for bit: {_verdict(k['qwz_int4_bit_exact'])}",
        "- A short training run on one GPU, the same final loss with either backend: "
        f"{_verdict(same and t['finite'])} (" + ", ".join(f"{b} {v:.4f}" for b, v in losses.items()) + ")",
    ]
    if not t["triton_kernel_calls"]:
        lines.append(
            "- But the training run recorded no Triton kernel call: on one rank nothing crosses nodes, so no quantized"
            " collective ran. It checks the strategy's GPU path, not the kernels."
        )
    else:
        calls = ", ".join(f"{name} {n}" for name, n in t["triton_kernel_calls"].items())
        lines.append(f"- Triton kernel calls in the training run: {calls}")
    return "\n".join(lines)


def _bandwidth(bw: dict) -> str:
    copy = bw["copy_GBps"]
    rows = [[r["kernel"], f"{r['size_mb']:.0f}", f"{r['triton_GBps']:.0f}", f"{r['triton_GBps'] / copy:.0%}",
             f"{r['speedup_vs_eager']:.1f}", f"{r['speedup_vs_compile']:.1f}"] for r in bw["rows"]]  # fmt: skip
    shares = [r["triton_GBps"] / copy for r in bw["rows"]]
    slower = [r["kernel"] for r in bw["rows"] if r["speedup_vs_compile"] < 1]
    worst = min(bw["rows"], key=lambda r: r["triton_GBps"])
    notes = [
        f"- Launcher included, the kernels move {_pcts(shares)} of the device-to-device copy's bandwidth; the lowest,"
        f" `{worst['kernel']}`, {worst['triton_GBps'] / copy:.0%}. The static model's ceilings (below) are upper bounds"
        " from instruction counts, not evidence of speed; a launcher-inclusive time is longer than the kernel's own,"
        " so a kernel alone moves at least these figures.",
    ]
    if slower:
        notes.append(
            "- Slower than the `torch.compile` twin (launcher included on both sides): "
            + ", ".join(f"`{k}`" for k in slower)
            + "."
        )
    return f"""On one {bw["device"]} (torch {bw["torch"]}, Triton {bw["triton"]}); the device-to-device copy measured
{copy:.0f} GB/s (bytes read + written). Each figure: bytes read + written by the operation over the time, the median
of the timed calls after warm-ups. The data's own note: {bw["source"]}.

**These are not device times.** The table was timed with the Python launcher inside each repeat: an event on each
side of one launcher call on an idle stream, a synchronize after each repeat. The start event fires at once, and the
kernel starts only when the launcher (tiling, allocation, Triton's dispatch) has returned, so every figure is launcher
+ kernel; for small inputs the launcher is most of it. `benchmarks/kernels.py` now times with
`benchmarks/device_timer.py` (host time per call and device time, measured apart); its table replaces this one when a
device run is made (`bash benchmarks/gpu_check.sh`).

{table(["kernel (qgZ at N = 8, K = 4)", "MB of bf16 input", "launcher-inclusive GB/s, not device time",
        "share of copy", "x eager twin", "x torch.compile twin"], rows)}

{chr(10).join(notes)}"""  # fmt: skip


def _sizes(bw: dict) -> str:
    return " and ".join(f"{m:g} MB" for m in sorted({r["size_mb"] for r in bw["rows"]}))


def _compiler(source: Source) -> str:
    versions = [e["versions"].get("triton") for e in source.runs if e.get("versions")]
    versions = [v for v in versions if v]
    return f"Triton {', '.join(versions)}" if versions else "a Triton version its manifest does not record"


def render(sources: dict[str, Source]) -> str:
    static = sources[STATIC].data
    rows = static["rows"]
    archs = ", ".join(f"sm_{a}" for a in static["archs"])
    smoke = sources[SMOKE].data
    bw = sources[BANDWIDTH].data
    exact = all(smoke["kernels"][k] for k in ("qgz_bit_exact", "qwz_int8_bit_exact", "qwz_int4_bit_exact"))
    copy = bw["copy_GBps"]
    logs = "\n".join(f"- [{name}]({LOGS}/{name}): {what}" for name, what in RAW_LOGS.items())
    return f"""## Summary

The static model: {len(rows)} compiled specializations ({archs}), by layout. A specialization's goal is an
instruction-issue ceiling of at least {NEAREST_GOAL:.0%} of H200 HBM bandwidth with nearest rounding and
{STOCHASTIC_GOAL:.0%} with stochastic rounding.

{_summary(rows)}

On a GPU ({smoke["device"]}): {"every smoke check bit-exact against the torch twins" if exact else
"a smoke check NOT bit-exact"}; with the launcher counted in, the kernels moved
{_pcts([r["triton_GBps"] / copy for r in bw["rows"]])} of the copy bandwidth at {_sizes(bw)} (not device time: below).

## Goals

{_goals(rows)}

The specializations below their goal are listed at the end of the static section.

## On a GPU: bit-exactness and a smoke run

`benchmarks/gpu_smoke.py` on one {smoke["device"]}:

{_smoke(smoke)}

The kernels' test suites ran on the same machine; their logs are [below](#raw-logs-of-the-gpu-check) (raw, not
parsed here).

## On a GPU: bandwidth, launcher included

{_bandwidth(bw)}

## The static model, kernel by kernel

`python benchmarks/kernels.py --static` compiles every configuration the strategy launches for the GPU target (the
real launchers run on CPU tensors with the launch captured, then Triton's own specialization and compiler; here
{_compiler(sources[STATIC])}) and reads the compiled code. No GPU runs; nothing is timed.

{table(["", ""], LEGEND)}

### The default path

Parameter-aligned blocks, bf16, INT8 weights, INT8 -> INT4 gradients, nearest rounding: what runs unless an argument
says otherwise.

{_default_path(rows)}

### Every specialization, by operation

Ranges over the specializations of each layout and operation; every row (odd sizes, block sizes, launch shapes) is
in `benchmarks/data/{STATIC}`.

{_by_operation(rows)}

### Below their goal

By kernel, the rows of each (block sizes, buffer sizes, launch shapes) pooled.

{_misses(rows)}

## Raw logs of the GPU check

{logs}"""  # fmt: skip


def snippets(sources: dict[str, Source]) -> dict[str, str]:
    bw = sources[BANDWIDTH].data
    rotated = [r for r in sources[STATIC].data["rows"] if r["section"] == SECTIONS[2]]
    return {
        "h200_copy_share": f"{_pcts([r['triton_GBps'] / bw['copy_GBps'] for r in bw['rows']])} at {_sizes(bw)}",
        "rotated_meeting_goal": f"{_count(rotated)} rotated specializations",
    }
