"""The renderers of the results pages (``benchmarks/report.py`` runs them), one module per question.

A renderer module defines:

- ``TITLE``: the page's title;
- ``QUESTION``: what the page answers, in a sentence or two (its first line is the index's entry);
- ``SOURCES``: the data files it reads, as paths under ``benchmarks/data/``;
- ``render(sources)``: the page's body in Markdown, from ``{path: Source}``; every figure comes from the data;
- optionally ``snippets(sources)``: ``{name: Markdown}``, the figures the README and the docs quote
  (``<!-- results: PAGE/NAME -->``).

Prose in a renderer says what a figure means and never states the figure itself: a number in a sentence is
formatted from the data, so a new run cannot leave an old figure behind.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass
class Source:
    """One data file of a page: its path under ``benchmarks/data/``, its JSON and its manifest entries."""

    path: str
    data: Any
    runs: list[dict[str, Any]]


def _cell(value: Any) -> str:
    return "-" if value in (None, "") else str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def mb(n: float, digits: int = 3) -> str:
    """Bytes as megabytes (10^6)."""
    return f"{n / 1e6:.{digits}f}"


def pct(x: float, digits: int = 3, sign: bool = True) -> str:
    """A fraction as a percentage: ``0.00115`` -> ``+0.115%``."""
    return f"{100 * x:{'+' if sign else ''}.{digits}f}%"


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (0 for one value)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def interval(values: list[float], digits: int = 3) -> str:
    """``mean +- 2 SE (n seeds)`` of fractions, as percentages."""
    m, se = mean_se(values)
    if len(values) == 1:
        return f"{pct(m, digits)} (1 seed)"
    return f"{pct(m, digits)} ± {pct(2 * se, digits, sign=False)} ({len(values)} seeds)"
