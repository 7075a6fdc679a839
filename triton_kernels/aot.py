"""Ahead-of-time compilation of the kernels for NVIDIA GPUs, on a machine without one, and what the code shows.

Triton's interpreter (the CPU tests) skips the compiler's checks, so a kernel can pass every interpreter test and
still not compile. This module compiles exactly what the launchers launch:

1. ``capture`` runs the real launchers on CPU tensors with ``JITFunction.run`` replaced by a recorder, so the
   arguments are the launchers' own (dtypes, alignment, sizes, constexprs, launch options);
2. ``compile_launch`` specializes them with Triton's own binder for a ``GPUTarget`` (the same i32/i64, divisibility
   by 16 and value-1 decisions a real launch makes) and compiles TTIR -> TTGIR -> LLIR -> PTX -> cubin with the
   ptxas the wheel bundles;
3. the result carries registers and local memory (``cuobjdump -res-usage``), spill instructions and the instruction
   count per path of the SASS (``nvdisasm``), and every global load and store of the PTX with its width and the
   source line it came from. Lines of ``_tiles.py`` and ``_rotated.py`` that move wire payload end in ``# payload``,
   and so do the constexpr branches that choose among them (Triton's line info for a masked load may point at its
   branch); the aligned-blocks kernels' loads and stores of float elements (inputs, outputs, residuals) end in
   ``# elements``.

Triton's launch internals that steps 1 and 2 need are in ``lightning_zeropp.compat.triton``, and only this tool
imports it: a Triton upgrade that moves them breaks the gate, never a training run.

Run ``python -m lightning_zeropp.kernels.aot --json FILE`` (without ``TRITON_INTERPRET``) for the report the tests
check.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from lightning_zeropp.compat import triton as compat
from lightning_zeropp.kernels.covering import covering

ARCHS = (80, 90, 100)
FEEDBACK_WIDTHS = (32, 16, 8)  # error feedback residuals: fp32, bf16, INT8 codes with a scale per block
PATH_ARCH = 90  # the SASS is read (paths, spill instructions) for this target; the others report registers/memory


@dataclasses.dataclass
class Launch:
    """One kernel launch as a launcher made it: what Triton would specialize and compile."""

    kernel: object
    args: tuple
    kwargs: dict
    grid: tuple
    label: str = ""


@contextlib.contextmanager
def capture() -> Iterator[list[Launch]]:
    """Records the launches made inside the block instead of running them (nothing reaches a device)."""
    launches: list[Launch] = []
    with compat.record_launches() as recorded:
        yield launches
    launches.extend(Launch(kernel, args, kwargs, grid) for kernel, args, kwargs, grid in recorded)


def _specialize(launch: Launch, arch: int) -> compat.Specialization:
    return compat.specialize(launch.kernel, launch.args, launch.kwargs, arch)


def specialization_key(launch: Launch) -> str:
    """What makes two launches compile to the same code."""
    return _specialize(launch, PATH_ARCH).key


@dataclasses.dataclass
class Access:
    op: str  # "ld" or "st"
    bytes: int  # per thread per instruction
    vector: int  # 1, 2 or 4
    line: int  # source line in _tiles.py or _rotated.py (0 when from elsewhere)
    tag: str  # the line's trailing comment tag ("payload", "elements") or ""


@dataclasses.dataclass
class Compiled:
    kernel: str
    arch: int
    label: str
    signature: dict
    constexprs: dict
    num_warps: int
    aligned: bool  # the sizes and offsets (n, chunk, start) are multiples of 16 in this specialization
    aligned_pointers: list[str]  # the pointer arguments the specialization knows to be 16-byte aligned
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int
    spill_instructions: int
    sass_paths: list[dict]  # each entry-to-exit path of the SASS: instructions, masked global accesses
    accesses: list[Access]
    error: str = ""


_TAGGED_FILES = ("_tiles.py", "_rotated.py")  # the kernels' building blocks, whose accesses carry tags


def _tagged_lines() -> dict[tuple[str, int], str]:
    tags = {}
    for name in _TAGGED_FILES:
        for i, line in enumerate(Path(__file__).with_name(name).read_text().splitlines(), 1):
            m = re.search(r"#\s*(payload|elements)\b", line)
            if m:
                tags[name, i] = m.group(1)
    return tags


_ACCESS = re.compile(r"^\s*(?:@%p\d+\s+)?(ld|st)\.global((?:\.\w+)*)\s")


def _ptx_accesses(ptx: str) -> list[Access]:
    tiles = {}
    files = {}
    for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]*)"(?:,\s*"([^"]*)")?', ptx, re.M):
        files[m.group(1)] = (m.group(3) or "") + "/" + m.group(2) if m.group(3) else m.group(2)
    tiles = {k: name for k, v in files.items() for name in _TAGGED_FILES if v.endswith(name)}
    tags = _tagged_lines()
    # an access is attributed to the source line located last before it (its own statement's line); inside an
    # inline assembly block (a vector load: a register initialized per element, then the load), to the block's first
    # location: the assembler numbers the block's lines from the statement's on, one per instruction
    out, line, name, in_asm, asm_located = [], 0, "", False, False
    for text in ptx.splitlines():
        if "// begin inline asm" in text:
            in_asm, asm_located = True, False
        elif "// end inline asm" in text:
            in_asm = False
        loc = re.match(r"^\s*\.loc\s+(\d+)\s+(\d+)", text)
        if loc:
            if not (in_asm and asm_located):
                name = tiles.get(loc.group(1), "")
                line = int(loc.group(2)) if name else 0
            asm_located = in_asm
            continue
        m = _ACCESS.match(text)
        if not m:
            continue
        mods = m.group(2).split(".")
        vector = 4 if "v4" in mods else 2 if "v2" in mods else 1
        width = next((int(x[1:]) for x in reversed(mods) if re.fullmatch(r"[bsuf](8|16|32|64)", x)), 0)
        out.append(Access(m.group(1), vector * width // 8, vector, line, tags.get((name, line), "")))
    return out


def _sass_paths(cubin: Path) -> tuple[list[dict], int]:
    """Every entry-to-EXIT path through the SASS basic blocks (instructions, and predicated global loads/stores:
    masked accesses), and the spill instructions (local loads/stores)."""
    dot = subprocess.run(
        [compat.toolchain("nvdisasm"), "-bbcfg", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    spills = len(re.findall(r"\b(STL|LDL)\b", dot))
    blocks, edges = {}, {}
    for m in re.finditer(r'^"([^"]+)"\s*\[label="(.*?)"\]\s*$', dot, re.M | re.S):
        body = m.group(2)
        blocks[m.group(1)] = (
            len(re.findall(r"\\ ;\\l", body)),
            len(re.findall(r"@!?U?P\d\\ (?:LDG|STG)", body)),
            bool(re.search(r"\bEXIT\b", body)),
        )
    for m in re.finditer(r'^"([^"]+)"(?::\w+)*\s*->\s*"([^"]+)"', dot, re.M):
        edges.setdefault(m.group(1), []).append(m.group(2))
    targets = {t for ts in edges.values() for t in ts}
    entries = [n for n in blocks if n not in targets]
    paths: list[dict] = []

    def walk(node: str, count: int, masked: int, seen: frozenset) -> None:
        if len(paths) > 256:
            return
        size, predicated, exits = blocks.get(node, (0, 0, False))
        count, masked = count + size, masked + predicated
        if exits:
            paths.append({"instructions": count, "masked_accesses": masked})
        for n in edges.get(node, []):
            if n not in seen:  # a back edge (a loop) is not followed: counts are per pass
                walk(n, count, masked, seen | {n})

    for entry in entries:
        walk(entry, 0, 0, frozenset({entry}))
    paths.extend(_fewest_masked_paths(blocks, edges, entries))
    return paths, spills


def _fewest_masked_paths(blocks: dict, edges: dict, entries: list) -> list[dict]:
    """Per entry, the path to EXIT with the fewest masked accesses and, among those, the fewest instructions, exactly
    (the enumeration above stops at 256 paths, which in kernels with many branches (the IEEE division's slow paths,
    error feedback's second quantization) can end before it reaches the vector tile's path). Back edges (loops) are
    not followed, as above: counts are per pass."""
    back, state = set(), {}

    def classify(node: str) -> None:  # iterative DFS: back edges are those into a node still on the stack
        stack = [(node, iter(edges.get(node, [])))]
        state[node] = 1
        while stack:
            current, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[current] = 2
                stack.pop()
            elif state.get(child) == 1:
                back.add((current, child))
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(edges.get(child, []))))

    for entry in entries:
        if entry not in state:
            classify(entry)
    best: dict = {}

    def cost(node: str):  # (masked, instructions) of the best path from node to an EXIT; None: no EXIT reachable
        if node in best:
            return best[node]
        order, todo = [], [node]
        while todo:  # post-order over the DAG without back edges, so the recursion depth stays 1
            n = todo.pop()
            if n in best or n in order:
                continue
            order.append(n)
            todo.extend(c for c in edges.get(n, []) if (n, c) not in back and c not in best)
        for n in reversed(order):
            size, predicated, exits = blocks.get(n, (0, 0, False))
            options = [best.get(c) for c in edges.get(n, []) if (n, c) not in back]
            options = [o for o in options if o is not None] + ([(0, 0)] if exits else [])
            best[n] = min(((m + predicated, i + size) for m, i in options), default=None)
        return best[node]

    found = [cost(entry) for entry in entries]
    return [{"instructions": i, "masked_accesses": m} for m, i in (f for f in found if f is not None)]


def _described(launch: Launch, arch: int) -> tuple[compat.Specialization, dict]:
    """The specialization for ``arch`` and what a report says of it before compiling (the fields of
    :class:`Compiled` up to ``aligned_pointers``)."""
    spec = _specialize(launch, arch)
    sizes = [name for name in ("n", "chunk", "start") if spec.signature.get(name, "constexpr") != "constexpr"]
    base = dict(kernel=launch.kernel.__name__, arch=arch, label=launch.label,
                signature={k: v for k, v in spec.signature.items() if v != "constexpr"},
                constexprs={k: repr(v) for k, v in spec.constexprs.items()}, num_warps=spec.num_warps,
                aligned=all(name in spec.divisible_by_16 for name in sizes),
                aligned_pointers=sorted(name for name in spec.divisible_by_16
                                        if str(spec.signature.get(name, "")).startswith("*")))  # fmt: skip
    return spec, base


def features(entry: dict) -> dict[str, str]:
    """What a specialization is made of, as parameters of a covering: the kernel, its launch width, each constexpr,
    each argument's type, and which sizes and pointers it knows to be aligned (an entry of a report, or the fields of
    it :func:`_described` gives)."""
    kernel = entry["kernel"]
    out = {"kernel": kernel, "num_warps": str(entry["num_warps"]), "aligned": f"{kernel} {entry['aligned']}",
           "aligned_pointers": f"{kernel} {entry['aligned_pointers']}"}  # fmt: skip
    out.update({f"{kernel} {name}": value for name, value in entry["constexprs"].items()})
    out.update({f"{kernel} {name}:": str(value) for name, value in entry["signature"].items()})
    return out


def compile_launch(launch: Launch, arch: int, sass: bool = True) -> Compiled:
    """Compiles ``launch`` for ``arch`` and reads the code: registers, stack and local memory always; the SASS paths
    and spill instructions for :data:`PATH_ARCH` when ``sass`` (disassembly adds a subprocess per kernel)."""
    spec, base = _described(launch, arch)
    try:
        binary = compat.compile_specialization(spec)
    except Exception as err:  # reported with the configuration; the gate fails on it
        return Compiled(**base, registers=0, stack_bytes=0, local_bytes=0, shared_bytes=0, spill_instructions=0,
                        sass_paths=[], accesses=[], error=_describe(err))  # fmt: skip
    usage = _code_facts(binary.cubin, with_paths=sass and arch == PATH_ARCH)
    return Compiled(
        **base,
        registers=usage["registers"],
        stack_bytes=usage["stack"],
        local_bytes=usage["local"],
        shared_bytes=binary.shared_bytes,
        spill_instructions=usage["spills"],
        sass_paths=usage["paths"],
        accesses=_ptx_accesses(binary.ptx),
    )


def _describe(err: BaseException) -> str:
    """The error and its causes, innermost last (Triton wraps the real cause, e.g. a NameError, in its own)."""
    parts = []
    while err is not None and len(parts) < 4:
        parts.append(f"{type(err).__name__}: {str(err).strip()[-1500:]}")
        err = err.__cause__ or err.__context__
    return " <- caused by: ".join(reversed(parts))


# bumped when what _code_facts reads changes (2: the fewest-masked paths), so cached facts are read again
_FACTS_VERSION = 2


def _code_facts(cubin: bytes, with_paths: bool) -> dict:
    """Registers, stack and local memory of a cubin, and (``with_paths``) its SASS paths and spill instructions.

    Disassembly takes about a second per kernel, so the facts are cached beside Triton's own cache, keyed by the
    cubin's hash (Triton's cache is keyed by the kernel source: unchanged kernels recompile and re-read nothing).
    """
    key = hashlib.sha256(cubin + bytes([with_paths, _FACTS_VERSION])).hexdigest()
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache")) / "zeropp-aot"
    cached = cache / f"{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run(
            [compat.toolchain("cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
        usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res))
        missing = [field for field in ("REG", "STACK", "LOCAL") if field not in usage]
        if missing or int(usage["REG"]) == 0:  # a figure not read must not pass as "no spills"
            raise ValueError(f"cuobjdump -res-usage printed no {missing or 'REG > 0'} for the kernel: {res[-500:]!r}")
        paths, spills = _sass_paths(path) if with_paths else ([], 0)
    facts = {"registers": int(usage["REG"]), "stack": int(usage["STACK"]), "local": int(usage["LOCAL"]),
             "spills": spills, "paths": paths}  # fmt: skip
    cache.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(facts))
    return facts


# ------------------------------------------------------------------------------------------------------------------
# The configurations the strategy launches


def strategy_launches() -> list[Launch]:
    """The launches the strategy makes, by kernel: every dtype, bit width and rounding at the default block sizes
    (qwZ 256, qgZ 128), qgZ's (N, K, stages) shapes (3 stages, sizes that are not multiples of 16), and another
    block size (64) for both bit widths and roundings; then the same with parameter-aligned blocks (``ALIGNED``: a
    unit's odd parameter sizes) and with error feedback (``FEEDBACK``: qgZ's re-quantization, in the fused kernel and
    as the quantize of a rank's own rows when it is alone on its node; residuals of every width, ``FEEDBACK`` 32, 16
    or 8). Small CPU tensors: only the launch arguments matter."""
    import torch

    from . import triton_ops as ops
    from .layout import Blocks, stage_bounds, wire_size
    from .specs import (
        DequantizeReduceQuantizeSpec,
        DequantizeReduceSpec,
        DequantizeSpec,
        QuantizeSpec,
        SwizzleQuantizeSpec,
    )

    float_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    launches: list[Launch] = []

    def record(label: str, call: Callable[[], object]) -> None:
        with capture() as got:
            call()
        for launch in got:
            launch.label = label
        launches.extend(got)

    def qwz(dtype, bits, block, numel, shape):
        x = torch.zeros(numel, dtype=dtype)
        record(f"qwZ quantize {shape}", lambda: ops.quantize(x, QuantizeSpec(bits, block)))
        packed = torch.zeros(4, wire_size(numel, bits, block), dtype=torch.uint8)
        record(f"qwZ dequantize {shape}", lambda: ops.dequantize(packed, DequantizeSpec(numel, bits, block, dtype)))

    def swizzle(where, g, N, K, stages, bits, block, stochastic, blocks=None):
        for s in range(stages):
            spec = SwizzleQuantizeSpec(N, K, stages, s, bits, block, stochastic=stochastic, blocks=blocks)
            record(f"qgZ swizzle_quantize {where}", lambda spec=spec: ops.swizzle_quantize(g, spec))

    def residual(width, K, n, blocks=None, block=128):
        """An error feedback residual of ``width`` bits for K rows of n (0: none), as ``ErrorFeedback`` keeps it."""
        if not width:
            return {}
        if width != 8:
            return {"residual": torch.zeros(K, n, dtype=torch.float32 if width == 32 else torch.bfloat16), "decay": 0.9}
        count = blocks.count if blocks is not None else -(-n // block)
        codes = torch.zeros(K, -(-n // 16) * 16, dtype=torch.int8)[:, :n]  # rows padded to 16 bytes
        return {"residual": codes, "residual_scales": torch.zeros(K, count), "decay": 0.9}

    def qgz(dtype, in_bits, out_bits, block, stochastic, N, K, stages, chunk, feedback=0):
        g = torch.zeros(N * K * chunk, dtype=dtype)
        where = f"N={N} K={K} stages={stages} chunk={chunk}"
        swizzle(where, g, N, K, stages, in_bits, block, stochastic)
        n = stage_bounds(chunk, stages, 0, block)[1]  # the first piece, as qgZ cuts it
        buf = torch.zeros(N, K, wire_size(n, in_bits, block), dtype=torch.uint8)
        fb = residual(feedback, K, n, block=block)
        record(
            f"qgZ dequantize_reduce_quantize {where}{f' feedback {feedback}' if feedback else ''}",
            lambda: ops.dequantize_reduce_quantize(
                buf, DequantizeReduceQuantizeSpec(n, in_bits, out_bits, block, stochastic=stochastic, **fb)
            ),
        )
        rows = torch.zeros(K, wire_size(n, out_bits, block), dtype=torch.uint8)
        out = torch.zeros(n, dtype=dtype)
        record(
            f"qgZ dequantize_reduce {where}",
            lambda: ops.dequantize_reduce(
                rows, DequantizeReduceSpec(n, out_bits, block, multiplier=1 / (N * K), out=out)
            ),
        )
        if N == 2:  # the same rank with one rank per node: its own K pieces go to the rail as quantized rows
            pieces = g.view(N * K, chunk)[:K, :n]
            record(
                f"qgZ quantize rows (N=1){f' feedback {feedback}' if feedback else ''}",
                lambda: ops.quantize(pieces, QuantizeSpec(out_bits, block, stochastic=stochastic, **fb)),
            )

    def qwz_aligned(dtype, bits, blocks):
        x = torch.zeros(blocks.numel, dtype=dtype)
        record("qwZ quantize aligned", lambda: ops.quantize(x, QuantizeSpec(bits, 256, blocks=blocks)))
        packed = torch.zeros(4, blocks.wire_size(bits), dtype=torch.uint8)
        out = torch.zeros(4 * blocks.numel, dtype=dtype)  # FSDP's flat all-gather output
        record(
            "qwZ dequantize aligned",
            lambda: ops.dequantize(packed, DequantizeSpec(blocks.numel, bits, 256, dtype, out=out, blocks=blocks)),
        )

    def qgz_aligned(dtype, in_bits, out_bits, stochastic, N, K, stages, blocks, feedback):
        chunk = blocks.numel
        g = torch.zeros(N * K * chunk, dtype=dtype)
        where = f"aligned N={N} K={K} stages={stages} chunk={chunk}"
        swizzle(where, g, N, K, stages, in_bits, 128, stochastic, blocks)
        for start, piece in blocks.stages(stages):
            if piece.numel:
                qgz_piece(dtype, in_bits, out_bits, stochastic, N, K, g, chunk, start, piece, feedback, where)

    def qgz_piece(dtype, in_bits, out_bits, stochastic, N, K, g, chunk, start, piece, feedback, where):
        n = piece.numel
        buf = torch.zeros(N, K, piece.wire_size(in_bits), dtype=torch.uint8)
        fb = residual(feedback, K, n, blocks=piece)
        label = f"{where} start={start}{f' feedback {feedback}' if feedback else ''}"
        record(
            f"qgZ dequantize_reduce_quantize {label}",
            lambda: ops.dequantize_reduce_quantize(
                buf, DequantizeReduceQuantizeSpec(n, in_bits, out_bits, 128, stochastic=stochastic, blocks=piece, **fb)
            ),
        )
        rows = torch.zeros(K, piece.wire_size(out_bits), dtype=torch.uint8)
        out = torch.zeros(n, dtype=dtype)
        record(
            f"qgZ dequantize_reduce {label}",
            lambda: ops.dequantize_reduce(
                rows, DequantizeReduceSpec(n, out_bits, 128, multiplier=1 / (N * K), out=out, blocks=piece)
            ),
        )
        if N == 2:  # one rank per node: the rank's own K pieces go to the rail as quantized rows
            pieces = g.view(N * K, chunk)[:K, start : start + n]
            record(
                f"qgZ quantize rows (N=1) {label}",
                lambda: ops.quantize(pieces, QuantizeSpec(out_bits, 128, stochastic=stochastic, blocks=piece, **fb)),
            )

    shapes = ((2, 2, 2, 4096), (8, 4, 3, 4096), (4, 2, 3, 1000), (2, 4, 1, 4103))  # 1000, 4103: not 16-aligned

    def feedback_shapes(width):
        return shapes[:1] if width == 16 else shapes[:3]

    for dtype in float_dtypes:
        for bits in (8, 4):
            qwz(dtype, bits, 256, 4096 * 3, "aligned")
            qwz(dtype, bits, 256, 4231, "odd")
            for stochastic in (False, True):
                for N, K, stages, chunk in shapes:
                    qgz(dtype, bits, 4, 128, stochastic, N, K, stages, chunk)  # intra-node bits 8 (default) or 4
        for N, K, stages, chunk in shapes[:2]:
            qgz(dtype, 8, 8, 128, False, N, K, stages, chunk)  # INT8 on both hops
    qgz(torch.bfloat16, 4, 8, 128, False, *shapes[0])  # INT4 inside the node, INT8 across
    for bits in (8, 4):  # another block size
        qwz(torch.bfloat16, bits, 64, 4096 * 3, "aligned")
        for stochastic in (False, True):
            qgz(torch.bfloat16, bits, 4, 64, stochastic, *shapes[1])
    # error feedback in uniform blocks (N=2: also the quantize of a lone rank's own rows), residuals of every width;
    # bf16's differs from fp32's only in two conversions: one shape
    for dtype in (torch.float32, torch.bfloat16):
        for width in FEEDBACK_WIDTHS:
            for bits in (8, 4):
                for stochastic in (False, True):
                    for N, K, stages, chunk in feedback_shapes(width):
                        qgz(dtype, bits, 4, 128, stochastic, N, K, stages, chunk, feedback=width)
            qgz(dtype, 8, 8, 128, False, *shapes[0], feedback=width)  # INT8 on both hops
    # parameter-aligned blocks: a unit's shards of odd sizes (a 1-element bias, an empty one, tails of every length)
    weights = Blocks.of_segments((4096, 1000, 3, 0, 1, 257, 640, 77), 256)
    chunk_blocks = Blocks.of_segments((300, 3, 0, 1000, 5, 1, 257, 2048, 77), 128)
    for dtype in float_dtypes:
        for bits in (8, 4):
            qwz_aligned(dtype, bits, weights)
    # (the launches captured from training steps add these at the test models' odd sizes: error feedback, weight
    # deltas and every precision; here, one qgZ shape for each feedback width, two without)
    for dtype in (torch.float32, torch.bfloat16):
        for bits in (8, 4):
            for stochastic in (False, True):
                for feedback in (0, *FEEDBACK_WIDTHS):
                    for N, K, stages, _ in shapes[: 1 if feedback else 2]:
                        qgz_aligned(dtype, bits, 4, stochastic, N, K, stages, chunk_blocks, feedback)
        for feedback in (0, *FEEDBACK_WIDTHS):  # INT8 on both hops
            qgz_aligned(dtype, 8, 8, False, *shapes[0][:3], chunk_blocks, feedback)
    # parameter-aligned blocks at a real model's sizes (multiples of 16: nearly every block in a vector tile), the
    # rows the static table shows
    real_weights = Blocks.of_segments((4096 * 4, 4096, 4096, 1024 * 11), 256)
    real_chunk = Blocks.of_segments((4096, 512, 512, 4096 + 16), 128)
    for dtype in (torch.bfloat16, torch.float32):
        for bits in (8, 4):
            qwz_aligned(dtype, bits, real_weights)
            for stochastic in (False, True):
                qgz_aligned(dtype, bits, 4, stochastic, *shapes[1][:3], real_chunk, 0)
    qgz_aligned(torch.bfloat16, 8, 4, False, *shapes[0][:3], real_chunk, 8)
    rotated_launches(record, residual, real_chunk, chunk_blocks)
    return launches


def rotated_launches(record: Callable, residual: Callable, real_chunk, odd_chunk) -> None:
    """The launches of rotated blocks (``gradient_rotation="hadamard"``, ``kernels._rotated``): qgZ's inter-node hop
    (step 3's re-quantization at N = 2, 4 and 8, a lone rank's quantization of its rows, step 5's un-rotating sum of
    K pieces) and quantized HSDP's rail (a rank's row, the sum into fp32); every residual width and both roundings at
    a real model's sizes (``real_chunk``, the rows the static table shows), the rest with fewer variants, and at odd
    sizes (``odd_chunk``), in uniform blocks and in blocks of 64."""
    import torch

    from . import triton_ops as ops
    from .layout import Blocks, wire_size
    from .specs import DequantizeReduceQuantizeSpec, DequantizeReduceSpec, QuantizeSpec

    seed = 7  # the sign table is an argument: any seed compiles the same kernels

    def requantize(N, K, in_bits, out_bits, stochastic, blocks, feedback=0, n=4096, block=128, where=""):
        n = blocks.numel if blocks is not None else n
        wire = blocks.wire_size(in_bits) if blocks is not None else wire_size(n, in_bits, block)
        buf = torch.zeros(N, K, wire, dtype=torch.uint8)
        fb = residual(feedback, K, n, blocks=blocks, block=block)
        spec = DequantizeReduceQuantizeSpec(n, in_bits, out_bits, block, stochastic=stochastic, blocks=blocks,
                                            rotation_seed=seed, **fb)  # fmt: skip
        label = f"qgZ rotated dequantize_reduce_quantize {where} N={N} K={K}"
        record(label + (f" feedback {feedback}" if feedback else ""), lambda: ops.dequantize_reduce_quantize(buf, spec))

    def rows(dtype, K, bits, stochastic, blocks, feedback=0, n=4096, block=128, where=""):
        n = blocks.numel if blocks is not None else n
        x = torch.zeros(K, n, dtype=dtype)
        fb = residual(feedback, K, n, blocks=blocks, block=block)
        spec = QuantizeSpec(bits, block, stochastic=stochastic, blocks=blocks, rotation_seed=seed, **fb)
        what = "qgZ rotated quantize rows (N=1)" if K > 1 else "HSDP rail rotated quantize"
        record(f"{what} {where}{f' feedback {feedback}' if feedback else ''}", lambda: ops.quantize(x, spec))

    def summed(M, bits, dtype, blocks, n=4096, block=128, where=""):
        n = blocks.numel if blocks is not None else n
        wire = blocks.wire_size(bits) if blocks is not None else wire_size(n, bits, block)
        buf = torch.zeros(M, wire, dtype=torch.uint8)
        out = torch.zeros(n, dtype=dtype)
        spec = DequantizeReduceSpec(n, bits, block, multiplier=1 / (4 * M), out=out, blocks=blocks, rotation_seed=seed)
        record(f"qgZ rotated dequantize_reduce {where} M={M}", lambda: ops.dequantize_reduce(buf, spec))

    real, odd = f"aligned chunk={real_chunk.numel}", f"aligned chunk={odd_chunk.numel}"
    for stochastic in (False, True):
        for feedback in (0, *FEEDBACK_WIDTHS):
            requantize(2, 2, 8, 4, stochastic, real_chunk, feedback, where=real)
            rows(torch.bfloat16, 2, 4, stochastic, real_chunk, feedback, where=real)
        for feedback in (0, 8) if stochastic else (0, 32, 8):
            requantize(8, 4, 8, 4, stochastic, real_chunk, feedback, where=real)
        requantize(2, 2, 4, 4, stochastic, real_chunk, where=real)  # INT4 inside the node
        rows(torch.float32, 2, 4, stochastic, real_chunk, where=real)
    requantize(4, 2, 8, 4, False, real_chunk, where=real)
    requantize(2, 2, 8, 8, False, real_chunk, where=real)  # INT8 on both hops
    for M in (2, 4, 8):
        summed(M, 4, torch.bfloat16, real_chunk, where=real)
    summed(2, 4, torch.float32, real_chunk, where=real)  # quantized HSDP's rail sums into fp32
    summed(2, 8, torch.bfloat16, real_chunk, where=real)
    for dtype in (torch.bfloat16, torch.float32):
        rows(dtype, 1, 4, False, real_chunk, where=real)  # quantized HSDP: one row per piece
    # odd sizes (no vector tiles at 16-element grids), uniform blocks, blocks of 64
    for stochastic in (False, True):
        requantize(2, 2, 8, 4, stochastic, odd_chunk, where=odd)
        requantize(2, 2, 8, 4, stochastic, None, where="uniform chunk=4096")
    requantize(2, 2, 8, 4, False, odd_chunk, 8, where=odd)
    requantize(2, 2, 8, 4, False, None, 8, where="uniform chunk=4096")
    requantize(8, 4, 8, 4, False, None, where="uniform chunk=4096")
    rows(torch.bfloat16, 2, 4, False, odd_chunk, where=odd)
    rows(torch.bfloat16, 2, 4, False, None, where="uniform chunk=4096")
    summed(2, 4, torch.bfloat16, odd_chunk, where=odd)
    summed(2, 4, torch.bfloat16, None, where="uniform chunk=4096")
    blocks64 = Blocks.of_segments((2048, 512, 96, 2048 + 16), 64)
    requantize(2, 2, 8, 4, False, blocks64, block=64, where="aligned block=64")
    summed(2, 4, torch.bfloat16, blocks64, block=64, where="aligned block=64")


def unique_launches(launches: list[Launch]) -> list[Launch]:
    seen: dict[str, Launch] = {}
    for launch in launches:
        key = specialization_key(launch)
        if key in seen:
            if launch.label not in seen[key].label.split(" | "):
                seen[key].label += " | " + launch.label
        else:
            seen[key] = launch
    return list(seen.values())


def _compile_one(job: tuple[int, int, bool]) -> dict:
    index, arch, sass = job
    launch = _UNIQUE[index]
    return dataclasses.asdict(compile_launch(launch, arch, sass))


def _rebuilt_argument(argument: list) -> object:
    """An argument of a captured launch (``lightning_zeropp.testing.capture.record_of``) as the binder needs it: a
    value, or a CPU tensor of the dtype that starts on 16 bytes or not (CPU allocations start on 64 bytes; one element
    in, they do not)."""
    import torch

    if argument[0] == "value":
        return argument[1]
    _, dtype, aligned = argument
    t = torch.zeros(32, dtype=getattr(torch, dtype))
    return t if aligned else t[1:]


def load_captured(path: Path) -> list[Launch]:
    """The launches ``python -m lightning_zeropp.testing.capture`` recorded from training steps."""
    import importlib

    launches = []
    for r in json.loads(Path(path).read_text()):
        module, name = r["kernel"]
        kernel = getattr(importlib.import_module(module), name)
        args = tuple(_rebuilt_argument(a) for a in r["args"])
        launches.append(Launch(kernel, args, dict(r["kwargs"]), tuple(r["grid"]), r["label"]))
    return launches


_UNIQUE: list[Launch] = []


def _init_worker(captured: Path | None = None) -> None:
    global _UNIQUE
    _UNIQUE = unique_launches((load_captured(captured) if captured else []) + strategy_launches())


def rotated(launch: Launch) -> bool:
    """A launch of rotated blocks (``ROTATE``) or of the sign table they use: the specializations that unroll a
    Hadamard butterfly, the costliest to compile (the suite's times: docs/results/suite.md)."""
    return bool(launch.kwargs.get("ROTATE")) or launch.kernel.__name__ == "_rotation_table_kernel"


def report(archs: list[int], workers: int, captured: Path | None = None, pairs: tuple[int, ...] = (),
           sass: bool = True, rotated_only: tuple[int, ...] = ()) -> dict:  # fmt: skip
    """Compiles every launch: those ``captured`` from training steps (a file of
    ``lightning_zeropp.testing.capture``), then the hand-picked edge shapes of :func:`strategy_launches`; a
    specialization both make is compiled once, its label naming both. For the targets in ``pairs``, only a covering
    of strength 2: specializations in which every pair of values of two :func:`features` that some specialization
    has meets at least once (a compile error tied to one value, or to two values together, is still found). For the
    targets in ``rotated_only``, only the :func:`rotated` specializations. The rotated compilations go first, so that
    none of the slowest is left to one worker at the end."""
    # sm_80 and sm_90 are required by the gate; newer targets are compiled where the toolchain knows them
    skipped = [a for a in archs if a not in (80, 90) and not compat.target_supported(a)]
    archs = [a for a in archs if a not in skipped]
    for name, subset in (("pairs", pairs), ("rotated_only", rotated_only)):
        unknown = sorted(set(subset) - set(archs) - set(skipped))
        if unknown:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{name}={unknown} ({flag}): only targets being compiled (archs={archs}, --arch) can be compiled in"
                f" part; name them in --arch too, or leave them out of {flag}"
            )
    both = sorted(set(pairs) & set(rotated_only))
    if both:
        raise ValueError(
            f"pairs and rotated_only (--pairs, --rotated-only) both name {both}: a target is compiled in one part"
            " only; name each target in one of them"
        )
    _init_worker(captured)
    jobs = []
    for arch in archs:
        every = range(len(_UNIQUE))
        if arch in pairs:
            every = sorted(covering([features(_described(launch, arch)[1]) for launch in _UNIQUE], 2))
        if arch in rotated_only:
            every = [i for i in every if rotated(_UNIQUE[i])]
        jobs += [(i, arch, sass) for i in every]
    jobs.sort(key=lambda job: not rotated(_UNIQUE[job[0]]))  # stable: each part keeps its order
    if workers > 1:
        # spawn, not fork: forking a process that runs torch's and Triton's threads can deadlock the children
        with ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(captured,)
        ) as pool:
            results = list(pool.map(_compile_one, jobs, chunksize=4))
    else:
        results = [_compile_one(job) for job in jobs]
    return {"archs": archs, "skipped_archs": skipped, "pairs_archs": [a for a in archs if a in pairs],
            "rotated_only_archs": [a for a in archs if a in rotated_only], "sass": sass, "launches": len(_UNIQUE),
            "rotated_launches": sum(map(rotated, _UNIQUE)), "compiled": results}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=None, help="compute capabilities (default: all)")
    # one compiler more than CPUs: a compilation spends part of its time waiting on its files and on ptxas's start,
    # which another compiler fills (the suite's cold gate is faster so: docs/results/suite.md)
    parser.add_argument("--workers", type=int, default=(os.cpu_count() or 1) + 1)
    parser.add_argument("--json", type=Path, required=True)
    captured = "launches captured from training steps (python -m lightning_zeropp.testing.capture)"
    parser.add_argument("--captured", type=Path, default=None, help=captured)
    parser.add_argument(
        "--pairs",
        type=int,
        nargs="+",
        default=[],
        metavar="ARCH",
        help="for these targets compile only a covering in which every pair of configuration values "
        "meets (the suite's default for sm_80; every specialization is compiled for the others)",
    )
    parser.add_argument("--rotated-only", type=int, nargs="+", default=[], metavar="ARCH",
                        help="for these targets compile only the rotated blocks' specializations and the sign table's "
                        "(the suite's choice for sm_100)")  # fmt: skip
    parser.add_argument("--no-sass", action="store_true",
                        help=f"do not disassemble sm_{PATH_ARCH}'s SASS (its paths and spill instructions; registers, "
                        "stack and local memory, where spills go, are read either way)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: give at least 1 compiler process")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("lightning_zeropp.kernels.aot: unset TRITON_INTERPRET: the interpreter replaces the compiler.")
    try:
        subsets = {"pairs": tuple(args.pairs), "rotated_only": tuple(args.rotated_only)}
        out = report(args.arch or list(ARCHS), args.workers, args.captured, sass=not args.no_sass, **subsets)
    except ValueError as err:
        parser.error(f"--pairs/--rotated-only: {err}")
    args.json.write_text(json.dumps(out))
    failed = [c for c in out["compiled"] if c["error"]]
    part = f"; a pairwise covering for sm_{', sm_'.join(map(str, out['pairs_archs']))}" if out["pairs_archs"] else ""
    if out["rotated_only_archs"]:
        part += f"; the rotated ones only for sm_{', sm_'.join(map(str, out['rotated_only_archs']))}"
    print(f"{len(out['compiled'])} compilations ({out['launches']} specializations x {len(out['archs'])} targets"
          f"{part}), {len(failed)} failed")  # fmt: skip


if __name__ == "__main__":
    from lightning_zeropp.kernels.aot import main as _main  # the pool's workers import this module by its package name

    _main()


# ------------------------------------------------------------------------------------------------------------------
# The static performance model

GPUS = {"H100 SXM": (132, 1.98e9, 3.35e12), "H200": (132, 1.98e9, 4.8e12)}  # SMs, boost clock, HBM bytes/s
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "i16": 2}


def _elem_bytes(pointer_type: str) -> int:
    return _DTYPE_BYTES[pointer_type.lstrip("*")]


def bytes_per_element(c: dict) -> float:
    """The operation's minimum traffic per output element: every input byte read once, every output byte written
    once (payload, one fp32 scale per block; the wire's alignment padding is ignored)."""
    k, sig = c["constexprs"], c["signature"]
    bs = int(k["BS"])
    # the residual, read and written: fp32, bf16, or INT8 codes with a scale per block
    feedback = {"32": 8, "16": 4, "8": 2 + 8 / int(k["BS"])}.get(k.get("FEEDBACK"), 0)
    if c["kernel"] == "_quantize_kernel":
        return _elem_bytes(sig["x_ptr"]) + int(k["BITS"]) / 8 + 4 / bs + feedback
    if c["kernel"] == "_dequantize_kernel":
        return int(k["ROWS"]) * (int(k["BITS"]) / 8 + 4 / bs) + _elem_bytes(sig["out_ptr"])
    return int(k["N"]) * (int(k["IN_BITS"]) / 8 + 4 / bs) + int(k["OUT_BITS"]) / 8 + 4 / bs + feedback


def full_tile_instructions(c: dict) -> int:
    """SASS instructions a program executes on a full tile: the shortest path to EXIT among those with the fewest
    masked accesses: none, where the tile's accesses are unmasked (the masked paths are the row's last tile; longer
    unmasked paths are the IEEE division's rare slow path); otherwise the few stores predicated to one thread of those
    holding the same value (a block's scale, say) or a kernel whose every tile is masked."""
    fewest = min(p["masked_accesses"] for p in c["sass_paths"])
    return min(p["instructions"] for p in c["sass_paths"] if p["masked_accesses"] == fewest)


def static_row(c: dict) -> dict:
    """Registers, occupancy, instructions per element and the instruction-issue ceiling of one compiled kernel."""
    k = c["constexprs"]
    elements = int(k["G"]) * 2 * int(k["HALF"])
    threads = 32 * c["num_warps"]
    instr = full_tile_instructions(c)
    warp_instr_per_element = instr * c["num_warps"] / elements
    regs = max(c["registers"], 1)
    # occupancy on sm_90: 64K registers and 64 warps per SM, registers allocated per warp in units of 256
    warps_by_regs = 65536 // (-(-regs * 32 // 256) * 256) // c["num_warps"] * c["num_warps"]
    smem_blocks = (228 * 1024) // max(c["shared_bytes"] + 1024, 1)
    warps = min(64, warps_by_regs, smem_blocks * c["num_warps"], 32 * c["num_warps"])
    row = {
        "kernel": c["kernel"], "arch": c["arch"], "label": c["label"], "registers": c["registers"],
        "occupancy": warps / 64, "instructions_per_thread_element": instr / (elements / threads),
        "warp_instructions_per_element": warp_instr_per_element, "bytes_per_element": bytes_per_element(c),
    }  # fmt: skip
    for gpu, (sms, clock, hbm) in GPUS.items():
        ceiling = sms * 4 * clock / warp_instr_per_element * row["bytes_per_element"]
        row[f"issue_ceiling_vs_{gpu.split()[0]}_hbm"] = ceiling / hbm
    return row
