"""The compile gate for sm_80 (A100): the specializations of ``test_compile_gate.py`` (the same capture of training
steps, and the hand-picked edge shapes) in which every pair of configuration values meets, compiled with Triton's
bundled ptxas; every specialization with ``--exhaustive``.

sm_90 is compiled whole and its code read (vector widths, SASS paths) by ``test_compile_gate.py``; what can differ on
sm_80 is whether a configuration compiles and whether it spills, which a value or two values together decide. A cold
compile takes about a second per specialization on this machine: a pairwise covering is about a quarter of them.
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
pytestmark = pytest.mark.slow  # compiles kernels (minutes cold)

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter replaces the compiler


@pytest.fixture(scope="module")
def report(tmp_path_factory, captured_launches, request):
    out = tmp_path_factory.mktemp("aot80") / "report.json"
    pairs = [] if request.config.getoption("exhaustive") else ["--pairs", "80"]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_zeropp.kernels.aot", "--json", str(out), "--captured",
         str(captured_launches), "--arch", "80", *pairs],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _where(c: dict) -> str:
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


def test_every_pair_of_configuration_values_compiles_for_sm80(report, request):
    """Compiled without error; every specialization with ``--exhaustive``, else a part of them in which every pair of
    values the whole set has meets (checked here, pair by pair, against what the report says of the ones left out)."""
    assert report["archs"] == [80], report["archs"]
    failed = [f"{_where(c)}: {c['error'][:300]}" for c in report["compiled"] if c["error"]]
    assert not failed, "\n".join(failed[:10])
    left_out = report["not_compiled"].get("80", [])
    assert len(report["compiled"]) + len(left_out) == report["launches"] > 300, report["launches"]
    if request.config.getoption("exhaustive"):
        assert report["pairs_archs"] == [] and not left_out
        return
    assert report["pairs_archs"] == [80] and len(left_out) > len(report["compiled"]), len(left_out)
    missing = _pairs(report["compiled"] + left_out) - _pairs(report["compiled"])
    assert not missing, f"{len(missing)} pairs of values never compiled for sm_80, e.g. {sorted(missing)[:5]}"
    kernels = collections.Counter(c["kernel"] for c in report["compiled"])
    assert set(kernels) == {"_quantize_kernel", "_dequantize_kernel", "_requantize_kernel", "_rotation_table_kernel"}


def test_the_pair_check_fails_on_a_covering_of_single_values(report):
    """The negative control of the check above: specializations chosen so that every value, but not every pair,
    meets (strength 1) leave pairs uncompiled, and the check names them."""
    from lightning_zeropp.kernels.aot import features
    from lightning_zeropp.kernels.covering import covering

    every = report["compiled"] + report["not_compiled"].get("80", [])
    singles = [every[i] for i in covering([features(c) for c in every], 1)]
    assert len(singles) < len(every) and _pairs(every) - _pairs(singles)


def test_no_stack_and_no_local_memory_on_sm80(report):
    """Spilled registers go to the stack frame or local memory: neither, in any specialization compiled; and every
    entry's register count was read (none reports zero)."""
    bad = [f"{_where(c)}: {c['registers']} registers, stack {c['stack_bytes']} B, local {c['local_bytes']} B"
           for c in report["compiled"] if c["registers"] <= 0 or c["stack_bytes"] or c["local_bytes"]]  # fmt: skip
    assert report["compiled"] and not bad, "\n".join(bad[:10])
