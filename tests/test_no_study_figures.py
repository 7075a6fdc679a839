"""No study figure in the package's source: what a study measured (a loss gap in percent, a seed count, a spread)
lives in the results and the docs, where a new run updates it once; the code's texts (``when=``, docstrings, the
planner's advice) say what to do and where to read the figures. A percentage or a seed count in the source fails here,
naming the file and line."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "lightning_zeropp").rglob("*.py"), *(ROOT / "triton_kernels").glob("*.py")])

# a literal percentage (a format specification such as ``{x:.0%}`` computes one at run time: not a figure)
PERCENT = re.compile(r"(?<![:.\d])[+-]?\d+(?:\.\d+)?%")  # ``x % y``, the operator, has spaces
SEEDS = re.compile(r"\b\d+\s+seeds?\b|\bseeds?\s+\d+\s*(?:-|to|and)\s*\d+", re.IGNORECASE)
SPREAD = re.compile("±")
TIMES = re.compile(r"(?<![\w.])\d+\.\d+x\b")  # a measured speedup or ratio: ``2.49x``, ``0.19x``
SHARE = re.compile(r"\b0\.\d+ of (?:the )?[A-Za-z0-9-]+'s")  # a measured share: ``0.27 of HSDP's``


def figures(text: str) -> list[str]:
    return [m.group(0) for pattern in (PERCENT, SEEDS, SPREAD, TIMES, SHARE) for m in pattern.finditer(text)]


def test_the_patterns_catch_the_figures_that_were_in_the_source_and_not_computed_ones():
    old = "it took the late loss gap from +0.13% to +0.06% at 500 steps (10 seeds, paired); -0.012% ± 0.034%"
    assert figures(old) == ["+0.13%", "+0.06%", "-0.012%", "0.034%", "10 seeds", "±"]
    assert figures('f"predicted step {extra:+.0%} ({share:.1%} of it)"') == []
    assert figures("seed 1 to 5") != [] and figures("about 0.5% of the learning rate") == ["0.5%"]
    assert figures("5.06x faster, 0.27 of HSDP's bytes") == ["5.06x", "0.27 of HSDP's"]
    assert figures("x 2 in bf16, f(x) = 2x, a 0x10 mask, dim 4096x4096") == []


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_no_study_figure_in_the_package_source(path):
    found = [
        f"{path.relative_to(ROOT)}:{number}: {', '.join(figures(line))}: {line.strip()[:100]}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if figures(line)
    ]
    assert found == [], "study figures belong in the results and docs; say what to do and link there:\n" + "\n".join(
        found
    )
