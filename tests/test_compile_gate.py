"""The ahead-of-time compile gate: every kernel, in every configuration the strategy launches, compiled for real GPU
targets on this CPU machine (Triton's compiler and its bundled ptxas need no GPU), and the generated code checked.

The interpreter tests (test_kernels.py) prove the arithmetic; they cannot see what the compiler rejects (a Python
global read inside ``@jit``, say) nor how the code moves memory. Here the launchers run on CPU tensors with the launch
captured (``lightning_zeropp.kernels.aot``), so the compiled specializations are exactly the ones a GPU run compiles.
"""

import collections
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
# every test compiles kernels (minutes cold) or starts a fresh interpreter importing torch and Triton
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_ARCHS = {80, 90}


ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter replaces the compiler


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """The launches of real training steps (``lightning_zeropp.testing.capture``): the path of the records."""
    from lightning_zeropp.testing.capture import CONFIGS, TOPOLOGIES, capture

    out = tmp_path_factory.mktemp("capture") / "captured.json"
    # 4 configurations x 2 models x 3 topologies, on ranks spawned from this process (they define the kernels
    # compiled: ``capture`` unsets the interpreter for them)
    out.write_text(json.dumps(capture(list(TOPOLOGIES), list(CONFIGS), timeout=1800)))
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory, captured, request):
    """sm_90 (the H100's target, whose SASS is read): every specialization. sm_80: a covering in which every pair of
    configuration values meets (about a quarter of the specializations; cold compiles are the gate's cost), every
    specialization with ``--exhaustive``. sm_100, where the toolchain knows it: the rotated specializations (~50). One
    pool of compilers for all three, the slowest first."""
    out = tmp_path_factory.mktemp("aot") / "report.json"
    # --exhaustive: every sm_80 specialization too, and sm_90's SASS disassembled (spill instructions, paths)
    pairs = [] if request.config.getoption("exhaustive") else ["--pairs", "80", "--no-sass"]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_zeropp.kernels.aot", "--json", str(out), "--captured", str(captured),
         "--arch", "80", "90", "100", "--rotated-only", "100", *pairs],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800,  # ~550 compilations, 2 cores
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_gate_compiles_what_training_steps_launch(report, captured):
    """Every launch the captured steps made (each topology, configuration and model; every op) is a compiled entry,
    and the default path's specializations are among them: the gate's list comes from training, not from a list
    kept by hand beside the collectives (hand-picked edge shapes are added to it)."""
    from lightning_zeropp.testing.capture import CONFIGS, TOPOLOGIES

    records = json.loads(Path(captured).read_text())
    labels = {r["label"] for r in records}
    for topology in TOPOLOGIES:
        for config in CONFIGS:
            for model in ("TinyLM", "example GPT"):
                seen = {
                    label.rsplit(" ", 1)[1]
                    for label in labels
                    if label.startswith(f"captured {topology} {config} {model} ")
                }
                assert {
                    "swizzle_quantize",
                    "dequantize_reduce_quantize",
                    "dequantize_reduce",
                    "quantize",
                    "dequantize",
                } <= seen, (topology, config, model, seen)
    compiled_labels = " | ".join(c["label"] for c in report["compiled"])
    assert all(label in compiled_labels for label in labels)
    default = [c for c in report["compiled"] if c["kernel"] == "_requantize_kernel" and "captured" in c["label"]
               and c["constexprs"].get("ALIGNED") == "True" and c["constexprs"]["IN_BITS"] == "8"
               and c["constexprs"]["OUT_BITS"] == "4" and c["constexprs"]["STOCHASTIC"] == "False"]  # fmt: skip
    assert default, "the default qgZ re-quantization was not captured"


def test_a_launch_added_to_a_collective_is_caught(tmp_path):
    """The negative control: qgZ's dequantize-reduce made to launch one more kernel (INT4 in blocks of 96, which no
    hand-picked entry has). The capture records it, so the gate compiles it; the hand-written list alone would not."""
    code = f"""
from pathlib import Path
import json
from lightning_zeropp.kernels import aot
from lightning_zeropp.testing.capture import capture
records = capture(["2x2"], ["defaults, bf16-mixed"], setup="an_extra_launch", models=("TinyLM",))
path = Path({str(tmp_path)!r}) / "captured.json"
path.write_text(json.dumps(records))
hand = {{aot.specialization_key(launch) for launch in aot.strategy_launches()}}
new = [launch for launch in aot.load_captured(path) if aot.specialization_key(launch) not in hand]
extra = [launch for launch in new if launch.kwargs["BS"] == 96]
assert extra, [launch.label for launch in new]
compiled = aot.compile_launch(extra[0], 90)
assert not compiled.error, compiled.error
print("caught", len(extra), extra[0].label)
"""
    done = _without_interpreter(code)
    assert done.returncode == 0 and "caught" in done.stdout, done.stderr[-3000:]


def _where(c):
    return f"{c['kernel']} sm_{c['arch']} {c['constexprs']} {c['signature']} [{c['label']}]"


def _pairs(entries: list[dict]) -> set[tuple]:
    """Every pair of values of two parameters that some specialization has: its kernel, launch width, constexprs,
    argument types and aligned sizes and pointers (written here, not taken from ``aot``, so that a parameter the gate
    forgot to cover is still asked for)."""
    out = set()
    for c in entries:
        k = c["kernel"]
        values = {("kernel", k), ("warps", c["num_warps"]), (k, "aligned", c["aligned"]),
                  (k, "pointers", tuple(c["aligned_pointers"]))}  # fmt: skip
        values |= {(k, name, value) for name, value in c["constexprs"].items()}
        values |= {(k, name, "type", value) for name, value in c["signature"].items()}
        out |= set(itertools.combinations(sorted(values, key=repr), 2))
    return out


def test_every_configuration_compiles_for_sm80_and_sm90(report, request):
    """Every specialization compiles for sm_90; for sm_80, every one with ``--exhaustive``, else a set in which every
    pair of configuration values the specializations have meets (checked here, pair by pair)."""
    assert REQUIRED_ARCHS <= set(report["archs"]), report["archs"]
    failed = [f"{_where(c)}: {c['error'][:300]}" for c in report["compiled"] if c["error"]]
    assert not failed, "\n".join(failed[:10])
    per_arch = collections.Counter(c["arch"] for c in report["compiled"])
    whole = [a for a in report["archs"] if a not in report["pairs_archs"] + report["rotated_only_archs"]]
    assert 90 in whole and all(per_arch[a] == report["launches"] for a in whole), per_arch
    if request.config.getoption("exhaustive"):
        assert report["pairs_archs"] == [], report["pairs_archs"]
    every = [c for c in report["compiled"] if c["arch"] == 90]
    for arch in report["pairs_archs"]:
        some = [c for c in report["compiled"] if c["arch"] == arch]
        assert len(some) < report["launches"], (arch, len(some))
        missing = _pairs(every) - _pairs(some)
        assert not missing, f"sm_{arch}: {len(missing)} pairs of values never compiled, e.g. {sorted(missing)[:5]}"


def test_the_pair_check_fails_on_a_covering_of_single_values(report):
    """The negative control of the check above: specializations chosen so that every value, but not every pair,
    meets (strength 1) leave pairs uncompiled, and the check names them."""
    from lightning_zeropp.kernels.aot import features
    from lightning_zeropp.kernels.covering import covering

    every = [c for c in report["compiled"] if c["arch"] == 90]
    singles = [every[i] for i in covering([features(c) for c in every], 1)]
    assert len(singles) < len(every) and _pairs(every) - _pairs(singles)


def test_the_configurations_cover_what_the_strategy_launches(report):
    compiled = [c for c in report["compiled"] if c["arch"] == 90]
    kernels = collections.defaultdict(set)
    for c in compiled:
        k = c["constexprs"]
        kernels[c["kernel"]].add((k.get("BITS", k.get("OUT_BITS")), k.get("STOCHASTIC"), k["BS"]))
    assert set(kernels) == {"_quantize_kernel", "_dequantize_kernel", "_requantize_kernel", "_rotation_table_kernel"}
    for bits in ("8", "4"):
        for rounding in ("False", "True"):
            for block in ("128", "64"):  # qgZ's default block and another
                assert (bits, rounding, block) in kernels["_quantize_kernel"]
            assert ("4", rounding, "64") in kernels["_requantize_kernel"]
        assert (bits, None, "256") in kernels["_dequantize_kernel"]  # qwZ's default weight block
        assert (bits, "False", "128") in kernels["_requantize_kernel"]
    labels = " ".join(c["label"] for c in compiled)
    assert "stages=3" in labels and "chunk=1000" in labels and "chunk=4103" in labels  # 3 stages; not 16-aligned
    inputs = {c["signature"].get("x_ptr") for c in compiled} | {c["signature"].get("out_ptr") for c in compiled}
    assert {"*fp32", "*bf16", "*fp16"} <= inputs


def _variant(c):
    """(aligned blocks, the error feedback residual's width: 0 without feedback, else 32, 16 or 8)."""
    k = c["constexprs"]
    return k.get("ALIGNED") == "True", int(k.get("FEEDBACK") or 0)


def test_the_configurations_cover_aligned_blocks_and_error_feedback(report):
    """Parameter-aligned blocks (``ALIGNED``) for every kernel, bit width and rounding, and error feedback
    (``FEEDBACK``: the residual's width, 32, 16 or 8) on the re-quantization, fused and as a lone rank's quantize of
    its rows, with either blocks."""
    compiled = [c for c in report["compiled"] if c["arch"] == 90]
    seen = collections.defaultdict(set)
    for c in compiled:
        k = c["constexprs"]
        bits = k.get("BITS", k.get("OUT_BITS"))
        seen[c["kernel"]].add((_variant(c), bits, k.get("STOCHASTIC"), c["signature"].get("x_ptr")))
    for bits in ("8", "4"):
        for dtype in ("*fp32", "*bf16"):
            for rounding in ("False", "True"):
                assert ((True, 0), bits, rounding, dtype) in seen["_quantize_kernel"]  # swizzle_quantize, qwZ
        assert ((True, 0), bits, None, None) in seen["_dequantize_kernel"]
    for out_bits, roundings in (("4", ("False", "True")), ("8", ("False",))):  # qgZ's inter-node bits: 4 or 8
        for rounding in roundings:
            assert ((True, 0), out_bits, rounding, None) in seen["_requantize_kernel"]
            for width in (32, 16, 8):
                for aligned in (False, True):
                    assert ((aligned, width), out_bits, rounding, None) in seen["_requantize_kernel"]
                    for dtype in ("*fp32", "*bf16"):  # a rank alone on its node quantizes its own rows, with feedback
                        assert ((aligned, width), out_bits, rounding, dtype) in seen["_quantize_kernel"]
    rows = {c["constexprs"]["ROWS"] for c in compiled if c["kernel"] == "_dequantize_kernel" and _variant(c)[0]}
    assert "1" in rows and len(rows) > 1  # qwZ's dequantize and qgZ's dequantize_reduce


def test_the_configurations_cover_rotated_blocks(report):
    """Rotated blocks (``ROTATE``, ``gradient_rotation="hadamard"``) for what qgZ's inter-node hop and quantized
    HSDP's rail launch: the step-3 re-quantization at N = 2 and 8 (nearest and stochastic, every residual width, both
    layouts), a lone rank's quantization of its rows and the rail's of one row, and step 5's un-rotating sum; and
    their variants of one thread per block (``L`` 1) and of blocks shared by threads (``L`` > 1, where butterflies
    cross threads). The sign table's kernel with them."""
    compiled = [c for c in report["compiled"] if c["arch"] == 90 and c["constexprs"].get("ROTATE") == "True"]
    seen = collections.defaultdict(set)
    for c in compiled:
        k = c["constexprs"]
        rows = k["N"] if c["kernel"] == "_requantize_kernel" else None  # (the quantize kernel's N is 1: no swizzle)
        seen[c["kernel"]].add((_variant(c), rows, k.get("STOCHASTIC"), int(k["L"]) > 1))
    for aligned in (True, False):
        for rounding in ("False", "True"):
            assert ((aligned, 0), "2", rounding, False) in seen["_requantize_kernel"], (aligned, rounding)
    for rounding in ("False", "True"):
        for width in (32, 16, 8):
            assert ((True, width), "2", rounding, True) in seen["_requantize_kernel"], (width, rounding)
            assert ((True, width), None, rounding, True) in seen["_quantize_kernel"], (width, rounding)
        assert ((True, 0), "8", rounding, True) in seen["_requantize_kernel"], rounding
        assert ((True, 0), None, rounding, False) in seen["_quantize_kernel"], rounding
    one_row = [c for c in compiled if c["kernel"] == "_quantize_kernel" and c["constexprs"].get("K") == "1"]
    assert one_row, "the rail's quantization of one row"
    rows = {c["constexprs"]["ROWS"] for c in compiled if c["kernel"] == "_dequantize_kernel"}
    assert {"2", "4", "8"} <= rows, rows
    assert any(c["kernel"] == "_rotation_table_kernel" for c in report["compiled"])


def test_rotated_blocks_compile_for_sm100_without_spills(report):
    """The rotated specializations on sm_100 too, where the toolchain knows it: every one compiled (the tests above
    and below check them with the others: no error, no spill, no stack, no local memory, vector payload accesses)."""
    if 100 in report["skipped_archs"]:
        pytest.skip("this Triton's toolchain does not compile for sm_100")
    assert report["rotated_only_archs"] == [100], report["rotated_only_archs"]
    on_100 = [c for c in report["compiled"] if c["arch"] == 100]
    rotated = [c for c in on_100 if c["constexprs"].get("ROTATE") == "True"]
    assert len(on_100) == report["rotated_launches"] and len(rotated) >= 40, (len(on_100), len(rotated))
    assert len(on_100) - len(rotated) == sum(c["kernel"] == "_rotation_table_kernel" for c in on_100)
    assert not [c for c in on_100 if c["error"] or c["registers"] <= 0]


def test_no_register_spills_and_no_local_memory(report, request):
    """On every target no stack frame and no local memory, which is where spilled registers go (``cuobjdump
    -res-usage``); with ``--exhaustive`` also no spill instruction in the sm_90 SASS, whose every path is then read
    (disassembly is a subprocess per kernel, a large part of the gate when cold). Every entry's figures were read:
    a kernel without a register count fails the gate when it is compiled (``aot._code_facts``), and none may report
    zero registers here."""
    unread = [_where(c) for c in report["compiled"] if not c["error"] and c["registers"] <= 0]
    assert not unread, "\n".join(unread[:10])
    paths = [c for c in report["compiled"] if c["arch"] == 90 and not c["error"]]
    assert paths and report["sass"] == bool(request.config.getoption("exhaustive"))
    if report["sass"]:
        assert all(c["sass_paths"] for c in paths)  # the sm_90 SASS was read (the spill count comes with it)
    spilled = [
        f"{_where(c)}: {c['spill_instructions']} spill instructions, stack {c['stack_bytes']} B,"
        f" local {c['local_bytes']} B"
        for c in report["compiled"]
        if c["spill_instructions"] or c["stack_bytes"] or c["local_bytes"]
    ]
    assert not spilled, "\n".join(spilled[:10])


def test_payload_loads_and_stores_are_vectorized(report):
    """Every access of the wire payload (lines of _tiles.py marked ``# payload``) moves 8 or 16 bytes per thread
    (PTX ``ld/st.global.v2`` or ``.v4``), in INT8 and INT4, also on a row's last, masked tile, with and without error
    feedback. Parameter-aligned blocks (``ALIGNED``, the default layout) in a padded layout (block sizes that are
    multiples of 32, as every one here) start every block's payload on a 16-byte boundary: their vector tiles (whole
    blocks at starts that are multiples of 16 elements: nearly every block of a real model) move 16 bytes per access,
    their masked tiles (a segment's tail, odd starts) go a quarter tile at a time and move 4 (INT4) or 8 (INT8) bytes,
    never one. The line info cannot tell the two apart, so per kernel and direction: the widest access is 16 bytes,
    the narrowest at least 4."""
    scalar = []
    aligned = 0
    for c in report["compiled"]:
        payload = [a for a in c["accesses"] if a["tag"] == "payload"]
        ops = {a["op"] for a in payload}
        expected = {"_quantize_kernel": {"st"}, "_dequantize_kernel": {"ld"}, "_requantize_kernel": {"ld", "st"},
                    "_rotation_table_kernel": set()}  # fmt: skip
        assert ops == expected[c["kernel"]], f"{_where(c)}: payload accesses found: {ops}"
        if _variant(c)[0]:
            assert int(c["constexprs"]["BS"]) % 32 == 0 and c["constexprs"]["PADDED"] == "True", _where(c)
            aligned += 1
            for op in ops:
                widths = [a["bytes"] for a in payload if a["op"] == op]
                if max(widths) < 16 or min(widths) < 4:
                    scalar.append(f"{_where(c)}: {op} payload accesses of {sorted(set(widths))} bytes")
        else:
            scalar += [f"{_where(c)}: {a}" for a in payload if a["vector"] < 2 or a["bytes"] < 8]
        # only the wire buffers hold bytes (and an INT8 feedback residual's codes, which the masked tiles of aligned
        # blocks at odd starts move one by one): any other access of one byte is payload moved byte by byte
        residual_codes = _variant(c) == (True, 8)
        scalar += [f"{_where(c)}: one-byte access {a}" for a in c["accesses"]
                   if a["bytes"] == 1 and (a["tag"] == "payload" or not residual_codes)]  # fmt: skip
    assert aligned and not scalar, "\n".join(scalar[:10])


def test_one_row_quantization_and_row_sums_move_elements_in_vectors(report):
    """A row starts as aligned as its buffer only where the compiler can see it: a quantization of one row (qwZ's
    shard, N = K = 1) passes a row stride of 0, and a dequantize-reduce writes its one output row at the output
    pointer. With parameter-aligned blocks and a 16-byte aligned buffer, their vector tiles then load (quantize) or
    store (sum) float elements 16 bytes per thread at every size, odd ones included; an odd row stride in the address
    made every one of those accesses 2 or 4 bytes wide. (A buffer that is not 16-byte aligned still gets element-wide
    accesses: the tiles are not shifted to the buffer's alignment. ``Blocks.stages`` cuts pipeline pieces at a block
    start on the 16-element grid where one is near; in training steps the sums left unaligned are the second pieces of
    the test models' transformer units, whose shards are odd from their first parameter on: there no block start but
    the first is on the grid, so no tile of either piece is a vector tile at run time.) INT4 quantization is not
    checked: it loads a tile's even and odd elements apart, element by element, on purpose (``STRIDED`` in
    ``quantize_kernel``: the vector load's layout differs from the INT4 codes', and converting the tile through shared
    memory cost more instructions than the narrow loads; the static table on docs/results/kernels.md has the counts)."""
    checked, odd, narrow = 0, 0, []
    for c in report["compiled"]:
        k = c["constexprs"]
        if k.get("ALIGNED") != "True" or k.get("PADDED") != "True":
            continue
        # N and K are constexprs only where they are 1 (Triton specializes that value)
        one_row = c["kernel"] == "_quantize_kernel" and k.get("N") == k.get("K") == "1" and k["FEEDBACK"] == "0"
        one_row = one_row and k["BITS"] == "8"
        summed = c["kernel"] == "_dequantize_kernel" and int(k["ROWS"]) > 1
        if not ((one_row and "x_ptr" in c["aligned_pointers"]) or (summed and "out_ptr" in c["aligned_pointers"])):
            continue
        checked, odd = checked + 1, odd + (not c["aligned"])
        widths = [a["bytes"] for a in c["accesses"] if a["tag"] == "elements"]
        if max(widths, default=0) < 16:
            narrow.append(f"{_where(c)}: float element accesses of {sorted(set(widths))} bytes")
    assert checked and odd and not narrow, "\n".join(narrow[:10])


def _without_interpreter(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_compat_records_and_specializes_a_launch():
    """Triton's launch internals, through ``lightning_zeropp.compat.triton``: a launch is recorded (not run) and
    specialized for sm_90 as a real launch would be, and ``JITFunction.run`` is restored afterwards."""
    done = _without_interpreter(
        "import torch\n"
        "from lightning_zeropp.compat import triton as compat\n"
        "from lightning_zeropp.kernels import triton_ops\n"
        "from lightning_zeropp.kernels.specs import QuantizeSpec\n"
        "run = compat.JITFunction.run\n"
        "with compat.record_launches() as got:\n"
        "    triton_ops.quantize(torch.zeros(3 * 4096, dtype=torch.bfloat16), QuantizeSpec(4, 256))\n"
        "assert compat.JITFunction.run is run\n"
        "(kernel, args, kwargs, grid), = got\n"
        "spec = compat.specialize(kernel, args, kwargs, 90)\n"
        "print(spec.signature['x_ptr'], spec.signature['n'], spec.constexprs['BITS'], spec.constexprs['BS'],"
        " sorted(spec.divisible_by_16 & {'x_ptr', 'n'}), grid)\n"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # n = 3 * 4096: a multiple of 16, as is the fresh buffer's address; 48 blocks of 256, 16 per program
    assert done.stdout.split() == ["*bf16", "i32", "4", "256", "['n',", "'x_ptr']", "(3,", "1)"], done.stdout


def test_compat_names_the_triton_it_needs():
    """An older Triton fails at the import of ``compat.triton`` with the version and the feature, not later."""
    done = _without_interpreter(
        "from lightning_zeropp.compat import versions\n"
        "versions.TRITON_VERSION = (3, 4, 0)\n"
        "try:\n"
        "    from lightning_zeropp.compat import triton\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "needs a newer triton for the kernels' compile gate (installed: 3.4.0)" in done.stdout, done.stdout
