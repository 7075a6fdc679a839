"""No copied figure in the README or the docs: a measured figure (a loss gap, a speedup, a share of bytes, a seed
count, a spread) is quoted from its generated results page (``<!-- results: PAGE/NAME -->...<!-- /results -->``,
written by ``benchmarks/report.py``) or linked, never typed in, so a new run cannot leave an old figure behind. The
generated pages themselves (``docs/results/``) and the decisions log, whose numbers are the rules' thresholds, are
not prose of this kind. A line that states a figure fails here, naming the file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "decisions.md")]

QUOTED = re.compile(r"(?<!`)<!-- results: [\w/-]+ -->.*?<!-- /results -->", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)  # commands and program output, not prose
FIGURE = re.compile(
    r"[+-]?\d+(?:\.\d+)?\s?%"  # a percentage
    r"|±"  # a spread
    r"|(?<![\w.])\d+\.\d+x\b"  # a measured ratio or speedup: 2.49x
    r"|\b0\.\d+ of (?:the )?[\w-]+'s"  # a measured share: 0.21 of ZeRO-3's
    r"|\b\d+ seeds?\b"  # a seed count
    r"|\b\d+(?:\.\d+)?\s?(?:GB/s|TB/s|µs|us/call)"  # a measured speed
)
RULES = re.compile(
    r"the 0\.1% (?:rule|line)|within 0\.1% of ZeRO-3's|0\.1% of the final loss|within 5%|mean ± 2 SE"
    r"|\b\d+ seeds? (?:each|per configuration)"
    r"|the paper reports \+2\.07%"  # the paper's own figure (30B tokens), not ours
)
"""Thresholds of the decision rules and the study's method, which are choices, not measurements."""


def figures(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number, line, figures) of each line of ``text`` that states a figure outside a quote or a code block."""
    masked = QUOTED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    masked = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), masked)
    out = []
    for number, line in enumerate(masked.splitlines(), 1):
        found = [m.group(0) for m in FIGURE.finditer(RULES.sub("", line))]
        if found:
            out.append((number, line, found))
    return out


def test_the_pattern_catches_copied_figures_and_not_quoted_ones_or_rules():
    copied = "steps 5.06x faster; +0.063% ± 0.071% (10 seeds); 0.21 of ZeRO-3's bytes; 2006 GB/s"
    found = [f for _, _, f in figures(copied)]
    assert len(found) == 1 and sorted(found[0]) == sorted(
        ["+0.063%", "0.071%", "±", "5.06x", "0.21 of ZeRO-3's", "10 seeds", "2006 GB/s"]
    )
    quoted = "steps <!-- results: slow_link/zeropp_speedup_50 -->5.06x<!-- /results --> faster"
    assert figures(quoted) == []
    assert figures("the 0.1% rule reads undecided; within 5% of the defaults; mean ± 2 SE") == []
    assert figures("```\n$ python x.py\n+0.063%\n```\n") == []


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_copied_figure(path):
    found = [f"{path.relative_to(ROOT)}:{n}: {', '.join(f)}: {line.strip()[:110]}" for n, line, f in
             figures(path.read_text())]  # fmt: skip
    assert found == [], (
        "quote the figure from its results page (<!-- results: PAGE/NAME -->, benchmarks/pages/PAGE.py's snippets)"
        " or link the page:\n" + "\n".join(found)
    )
