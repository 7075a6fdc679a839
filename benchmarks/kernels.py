"""Kernel bandwidth: each Triton kernel's device time and host time per call (two columns, measured apart:
``benchmarks/device_timer.py``), its GB/s by device time (bytes read + written / device time) as a fraction of the
device's measured copy bandwidth (the same timer), and the speedup over the torch twins by device time (eager and
torch.compile).

    python benchmarks/kernels.py [--sizes-mb 12.65 64 256 404.8 1024] [--json benchmarks/data/kernels/kernels.json]

The default sizes (MB of the op's bf16 input) include a 7B model's real pieces: Llama-2-7B (hidden 4096, MLP 11008)
has 202.4M parameters per decoder layer (one unit); on 4 nodes x 8 GPUs a rank's shard of it is 6.3M elements,
12.65 MB in bf16 (qwZ's quantize input, the INT4 dequantize-reduce's output), and the whole layer is 404.8 MB (qwZ's
dequantize output, qgZ's swizzle-quantize input).
    python benchmarks/kernels.py --static [--arch 90] [--json benchmarks/data/kernels/kernels_static.json]

The bandwidth table needs a CUDA device. ``--smoke`` runs tiny sizes on the CPU under TRITON_INTERPRET=1 to check
the script itself (its figures mean nothing).

``--static`` needs no GPU: it compiles every configuration the strategy launches for a GPU target
(``lightning_zeropp.kernels.aot``) and reads the code: registers, occupancy, SASS instructions per element on a full
tile, the operation's minimum bytes per element, and the instruction-issue ceiling (4 warp-instructions per clock per SM
at boost clock, as bytes per second) against H100 (3.35 TB/s) and H200 (4.8 TB/s) HBM bandwidth. A ceiling >= 100%
means the SMs can issue the kernel's instructions faster than HBM can feed it: it can be memory-bound. It is an
upper bound, not a measurement: it ignores latency, dual-issue limits and slower pipes (the int -> float conversions
of dequantization run at a quarter of the FP32 rate).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_timer
import record

ROOT = Path(__file__).resolve().parents[1]

N, K = 8, 4  # qgZ shapes: 8 ranks per node, 4 nodes


LLAMA7B_LAYER = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # attention, MLP and the two norms
SIZES_MB = [round(LLAMA7B_LAYER / (N * K) * 2 / 1e6, 2), 64, 256, round(LLAMA7B_LAYER * 2 / 1e6, 1), 1024]


class CpuStream:
    """The CPU smoke run's stand-in for a device stream: the host is the device, so every figure is host time (and
    every row is flagged as starved: no hold can put the work ahead of the host)."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: float, end: float) -> float:
        return end - start

    def flush(self) -> None:
        pass

    def hold(self, seconds: float) -> None:
        pass

    def synchronize(self) -> None:
        pass


def cases(numel: int, device: str):
    """(name, {impl: callable}, bytes moved) for one input size."""
    import torch

    from lightning_zeropp import kernels as tk
    from lightning_zeropp.kernels import reference, specs

    x = torch.randn(numel, device=device, dtype=torch.bfloat16)
    q8 = tk.quantize(x, 8, 256, backend="torch")
    wire8 = q8.numel()
    # qgZ: a gradient of numel elements over N*K ranks; one stage
    g = torch.randn(numel - numel % (N * K), device=device, dtype=torch.bfloat16)
    chunk = g.numel() // (N * K)
    sq = tk.swizzle_quantize(g, N, K, 1, 0, 8, 128, backend="torch")
    piece = chunk  # after the intra hop a rank holds N x K pieces of one chunk each
    recv = tk.quantize(torch.randn(N * K, piece, device=device), 8, 128, backend="torch").view(N, K, -1)
    rail = tk.quantize(torch.randn(K, piece, device=device), 4, 128, backend="torch")
    out = torch.empty(piece, device=device, dtype=torch.bfloat16)

    spec_of = {s.name: s for s in (specs.QuantizeSpec, specs.DequantizeSpec, specs.SwizzleQuantizeSpec,
                                   specs.DequantizeReduceQuantizeSpec, specs.DequantizeReduceSpec)}  # fmt: skip

    def impls(fn_name: str, tensor, *args, **kwargs):
        """The public op on Triton (what the strategy calls: the call checked, then launched), and the twins."""
        twin, op = getattr(reference, fn_name), getattr(tk, fn_name)
        spec = spec_of[fn_name](*args, **kwargs)
        compiled = torch.compile(twin, dynamic=False)
        return {
            "triton": lambda: op(tensor, *args, backend="triton", **kwargs),
            "torch": lambda: twin(tensor, spec),
            "torch.compile": lambda: compiled(tensor, spec),
        }

    yield "quantize int8", impls("quantize", x, 8, 256), x.numel() * 2 + wire8
    yield "quantize int4", impls("quantize", x, 4, 256), x.numel() * 2 + tk.wire_size(numel, 4, 256)
    yield "dequantize int8", impls("dequantize", q8, numel, 8, 256, torch.bfloat16), wire8 + numel * 2
    yield "swizzle_quantize int8", impls("swizzle_quantize", g, N, K, 1, 0, 8, 128), g.numel() * 2 + sq.numel()
    yield (
        "dequantize_reduce_quantize 8->4",
        impls("dequantize_reduce_quantize", recv, piece, 8, 4, 128),
        recv.numel() + K * tk.wire_size(piece, 4, 128),
    )
    yield "dequantize_reduce int4", impls("dequantize_reduce", rail, piece, 4, 128, out=out), rail.numel() + piece * 2
    # parameter-aligned blocks (a transformer layer's shard: odd parameter sizes) and error feedback
    sizes = [numel // 3, 1, numel // 5, 3, numel // 7]
    blocks = tk.Blocks.of_segments(sizes + [numel - sum(sizes)], 256)
    qb = tk.quantize(x, 8, 256, blocks=blocks, backend="torch")
    yield "quantize int8 param-blocks", impls("quantize", x, 8, 256, blocks=blocks), x.numel() * 2 + qb.numel()
    yield (
        "dequantize int8 param-blocks",
        impls("dequantize", qb, numel, 8, 256, torch.bfloat16, blocks=blocks),
        qb.numel() + numel * 2,
    )
    residual = torch.zeros(K, piece, device=device)
    yield (
        "dequantize_reduce_quantize 8->4 feedback",
        impls("dequantize_reduce_quantize", recv, piece, 8, 4, 128, residual=residual, decay=0.9),
        recv.numel() + K * tk.wire_size(piece, 4, 128) + 8 * residual.numel(),
    )
    codes = torch.zeros(K, piece, dtype=torch.int8, device=device)  # the default: an INT8 residual, a scale per block
    scales = torch.zeros(K, -(-piece // 128), device=device)
    yield (
        "dequantize_reduce_quantize 8->4 feedback int8",
        impls("dequantize_reduce_quantize", recv, piece, 8, 4, 128, residual=codes, residual_scales=scales, decay=0.9),
        recv.numel() + K * tk.wire_size(piece, 4, 128) + 2 * (codes.numel() + 4 * scales.numel()),
    )
    # rotated blocks (gradient_rotation="hadamard"): the same passes, the Walsh-Hadamard transform in registers
    rot4 = tk.quantize(torch.randn(K, piece, device=device), 4, 128, rotation_seed=7, backend="torch")
    yield (
        "quantize int4 rotated",
        impls("quantize", g, 4, 128, rotation_seed=7),
        g.numel() * 2 + tk.wire_size(g.numel(), 4, 128),
    )
    yield (
        "dequantize_reduce_quantize 8->4 rotated",
        impls("dequantize_reduce_quantize", recv, piece, 8, 4, 128, rotation_seed=7),
        recv.numel() + K * tk.wire_size(piece, 4, 128),
    )
    yield (
        "dequantize_reduce int4 rotated",
        impls("dequantize_reduce", rot4, piece, 4, 128, out=out, rotation_seed=7),
        rot4.numel() + piece * 2,
    )


def copy_bandwidth(device: str, stream, reps: int) -> float:
    """Bytes per second of a device-to-device copy of 1 GB (read + write), by device time."""
    import torch

    src = torch.empty(1 << 30 if device == "cuda" else 1 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = device_timer.measure(lambda: dst.copy_(src), stream, reps, attempts=1 if device == "cpu" else 3)
    return 2 * src.numel() / timing.device_s


def _static_name(c: dict) -> str:
    k, sig = c["constexprs"], c["signature"]
    rounding = "stochastic" if k.get("STOCHASTIC") == "True" else "nearest"
    variant = (
        (" param-blocks" if k.get("ALIGNED") == "True" else "")
        + (f" feedback{k['FEEDBACK']}" if k.get("FEEDBACK") not in (None, "0") else "")
        + (" rotated" if k.get("ROTATE") == "True" else "")
    )
    if c["kernel"] == "_quantize_kernel":
        return f"quantize {sig['x_ptr'][1:]} -> int{k['BITS']} {rounding}{variant}"
    if c["kernel"] == "_dequantize_kernel":
        what = "dequantize" if k["ROWS"] == "1" else f"dequantize_reduce M={k['ROWS']}"
        return f"{what} int{k['BITS']} -> {sig['out_ptr'][1:]}{variant}"
    return f"dequantize_reduce_quantize N={k['N']} int{k['IN_BITS']} -> int{k['OUT_BITS']} {rounding}{variant}"


def _default_path(c: dict) -> bool:
    """Whether the strategy's defaults launch this specialization: parameter-aligned blocks, bf16 compute, nearest
    rounding, no error feedback; qwZ's INT8 weights (quantize, dequantize to bf16), qgZ's INT8 intra-node hop (the
    swizzle-quantize) and INT4 inter-node hop (INT8 -> INT4 re-quantization, the INT4 dequantize-reduce to bf16)."""
    k, sig = c["constexprs"], c["signature"]
    if k.get("ALIGNED") != "True" or k.get("STOCHASTIC") == "True" or k.get("FEEDBACK") not in (None, "0"):
        return False
    if k.get("ROTATE") == "True":
        return False
    if c["kernel"] == "_quantize_kernel":
        return sig["x_ptr"] == "*bf16" and k["BITS"] == "8"
    if c["kernel"] == "_dequantize_kernel":
        return sig["out_ptr"] == "*bf16" and k["BITS"] == ("8" if k["ROWS"] == "1" else "4")
    return k["IN_BITS"] == "8" and k["OUT_BITS"] == "4"


SECTIONS = ("default path (parameter-aligned, bf16, INT8 weights, INT8 -> INT4 gradients, nearest)",
            "other parameter-aligned specializations", "uniform blocks (block_alignment='flat')",
            "rotated blocks (gradient_rotation='hadamard'), either layout")  # fmt: skip
# the kernels that move a quantized tensor (the sign table's kernel, a few hundred bytes a launch, is left out)
BANDWIDTH_KERNELS = ("_quantize_kernel", "_dequantize_kernel", "_requantize_kernel")


def _section(c: dict) -> int:
    k = c["constexprs"]
    if k.get("ROTATE") == "True":
        return 3
    return 0 if _default_path(c) else 1 if k.get("ALIGNED") == "True" else 2


def static_table(archs: list[int], json_path: Path | None, command: list[str] | None = None) -> None:
    """The static performance table from the compiled code (see the module docstring): what the defaults run first,
    then every other parameter-aligned specialization, then the uniform ones, then the rotated ones (both
    layouts). ``command``: the argv its manifest entry records (``record.write``; ``None``: ``sys.argv``)."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    from lightning_zeropp.kernels import aot

    report = aot.report(archs, os.cpu_count() or 1)
    failed = [c for c in report["compiled"] if c["error"]]
    if failed:
        sys.exit(f"{len(failed)} configurations failed to compile; run pytest tests/test_compile_gate.py")
    rows = []
    for c in report["compiled"]:
        if c["kernel"] not in BANDWIDTH_KERNELS:
            continue
        section = _section(c)
        payload = [a["bytes"] for a in c["accesses"] if a["tag"] == "payload"]
        rows.append(dict(aot.static_row(c), name=_static_name(c), block=int(c["constexprs"]["BS"]),
                         aligned=c["aligned"], section=SECTIONS[section], spills=c["spill_instructions"],
                         payload_access_bytes=f"{min(payload, default=0)}-{max(payload, default=0)}"))  # fmt: skip
    print("| kernel | block | sm | registers | occupancy | SASS instr / element / thread | bytes / element |"
          " payload bytes / access | issue ceiling vs H100 HBM | vs H200 HBM |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    shown = set()
    order = {name: i for i, name in enumerate(SECTIONS)}
    current = None
    for r in sorted(rows, key=lambda r: (order[r["section"]], r["arch"], r["kernel"], r["name"], r["block"])):
        key = (r["arch"], r["name"], r["block"])
        if not r["aligned"] or key in shown:  # one row per configuration: aligned sizes (the others in the JSON)
            continue
        if r["section"] != current:
            current = r["section"]
            print(f"| **{current}** |||||||||")
        shown.add(key)
        print(
            f"| {r['name']} | {r['block']} | {r['arch']} | {r['registers']} | {100 * r['occupancy']:.0f}% |"
            f" {r['instructions_per_thread_element']:.1f} | {r['bytes_per_element']:.2f} |"
            f" {r['payload_access_bytes']} |"
            f" {100 * r['issue_ceiling_vs_H100_hbm']:.0f}% | {100 * r['issue_ceiling_vs_H200_hbm']:.0f}% |"
        )
    if json_path:
        record.write(json_path, {"archs": report["archs"], "rows": rows}, command, indent=1)
        print(f"wrote {json_path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=SIZES_MB)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile column (its compiles)")
    parser.add_argument(
        "--no-eager", action="store_true", help="leave out the eager twins' column (slow at large sizes)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1")
    parser.add_argument(
        "--kernels", nargs="+", default=None, metavar="NAME", help="only these rows (as the table names them)"
    )
    parser.add_argument("--static", action="store_true", help="the static table from compiled code (no GPU)")
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="with --static: compute capabilities")
    args = parser.parse_args(argv)
    command = None if argv is None else [__file__, *argv]  # the manifest's (record.write; None: sys.argv)
    if args.static:
        static_table(args.arch, args.json, command)
        return
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("benchmarks/kernels.py needs a CUDA device (or --smoke for a CPU check of the script).")
    sizes = [0.01] if args.smoke else args.sizes_mb  # the smoke run checks the script, one tiny size does
    reps = 2 if args.smoke else args.reps
    stream = device_timer.CudaStream() if device == "cuda" else CpuStream()
    copy = copy_bandwidth(device, stream, reps)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}; device-to-device copy: {copy / 1e9:.0f} GB/s (device time)")
    print("| kernel | MB (bf16 input) | device us | host us / call | GB/s (device) | % of copy | x eager | x compile |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    document = {"device": name, "copy_GBps": copy / 1e9, "timer": "device_timer (device and host time apart)",
                "rows": rows}  # fmt: skip
    for mb in sizes:
        numel = int(mb * 1e6 / 2)
        for kernel, fns, nbytes in cases(numel, device):
            if args.kernels is not None and kernel not in args.kernels:
                continue
            timings = {}
            for impl, fn in fns.items():
                if ((args.smoke or args.no_compile) and impl == "torch.compile") or (args.no_eager and impl == "torch"):
                    continue
                timings[impl] = device_timer.measure(
                    fn, stream, reps, 1 if args.smoke else 3, attempts=1 if args.smoke else 3
                )
            ours = timings["triton"]
            row = {
                "kernel": kernel, "size_mb": mb, "numel": numel, "bytes_moved": nbytes, "device_s": ours.device_s,
                "host_s": ours.host_s, "starved": ours.starved, "GBps": nbytes / ours.device_s / 1e9,
                "fraction_of_copy": nbytes / ours.device_s / copy,
                "speedup_vs_eager": timings["torch"].device_s / ours.device_s if "torch" in timings else None,
                "speedup_vs_compile": (timings["torch.compile"].device_s / ours.device_s
                                       if "torch.compile" in timings else None),
                "device": name,
            }  # fmt: skip
            rows.append(row)
            if args.json:  # after every row: a run stopped at a time limit keeps what it measured
                record.write(args.json, document, command)
            compiled = f"{row['speedup_vs_compile']:.1f}" if row["speedup_vs_compile"] else "-"
            eager = f"{row['speedup_vs_eager']:.1f}" if row["speedup_vs_eager"] else "-"
            flag = " (starved)" if ours.starved else ""
            print(
                f"| {kernel} | {mb:g} | {1e6 * ours.device_s:.1f}{flag} | {1e6 * ours.host_s:.1f} |"
                f" {row['GBps']:.0f} | {100 * row['fraction_of_copy']:.0f}% | {eager} |"
                f" {compiled} |"
            )
    if args.json:
        record.write(args.json, document, command)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
