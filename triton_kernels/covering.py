"""Covering arrays: a few cases in which every combination of parameter values that any case has appears.

The suite runs the kernels' parameter matrices in Triton's interpreter (``tests/conftest.py``) and the compile gate
compiles for a second target (``aot``) on such a subset: every value, or every pair of values, met at least once,
instead of every case.
"""

from __future__ import annotations

import itertools


def covering(cases: list[dict[str, str]], strength: int, chosen: tuple[int, ...] = ()) -> list[int]:
    """Indices of cases in which every combination of ``strength`` parameter values that some case has appears in at
    least one: ``chosen`` first, then, one at a time, the case that brings the most combinations not yet covered (the
    earliest on a tie), until none is left. Strength 1: every value of every parameter runs at least once; strength 2:
    every pair of values of two parameters meets in some case (all-pairs testing)."""

    def combos(case: dict[str, str]) -> set[tuple]:
        return set(itertools.combinations(sorted(case.items()), strength))

    chosen = list(chosen)
    left = set().union(*(combos(c) for c in cases)) - set().union(*(combos(cases[i]) for i in chosen))
    while left:
        best = max(range(len(cases)), key=lambda i: (len(combos(cases[i]) & left), -i))
        chosen.append(best)
        left -= combos(cases[best])
    return chosen
