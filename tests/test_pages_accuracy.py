"""The accuracy page's verdicts (``benchmarks/pages/accuracy.py``) on made-up gaps: the rule fixed before the bf16
study's runs (decisions log, 2026-12-06), each branch, with the 0.1% line and the seed counts written here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from pages import accuracy

FAR = [(1, 0.0), (2, 0.0002), (3, -0.0002)]  # the defaults against ZeRO-3: well inside 0.1%, interval short of it


def _seeded(gaps):
    return list(enumerate(gaps, start=1))


@pytest.mark.parametrize(
    ("gaps", "defaults", "want"),
    [
        ([0.001, 0.001], FAR, "**no verdict yet**: 2 of the 3"),
        ([0.0020, 0.0021, 0.0019], FAR, "**resolved worse** at 3 seeds"),  # 0.2% ± 0.012%
        ([0.0010, -0.0005, 0.0008], FAR, "**close** at 3 seeds"),  # mean above 0, interval holds 0
        ([-0.0014, -0.0010, 0.0009], _seeded([-0.0002, -0.0001, 0.0019]), "**close** at 3 seeds"),  # holds 0.1%
        ([-0.0014, -0.0010, 0.0009], FAR, "**not worse** at 3 seeds:"),  # mean below 0, defaults far from 0.1%
        ([-0.0014, -0.0010, 0.0009, 0.0001], FAR, "**not worse** at 4 seeds:"),
        ([0.0010, -0.0005, 0.0008, 0.0004], FAR, "**close** at 4 seeds"),
        ([0.0010, -0.0005, 0.0008, 0.0004, -0.0001], FAR, "**not worse** at 5 seeds, close at 5 seeds too"),
        ([0.0020, 0.0021, 0.0019, 0.0018, 0.0022], FAR, "**resolved worse** at 5 seeds"),
    ],
)
def test_the_bf16_rule_as_fixed_before_its_runs(gaps, defaults, want):
    assert accuracy.bf16_rule(_seeded(gaps), defaults).startswith(want)


def test_the_bf16_rule_stands_the_correction_down_only_when_resolved_worse():
    verdict = accuracy.bf16_rule(_seeded([0.0020, 0.0021, 0.0019]), FAR)
    assert '"auto" stands down' in verdict
    for gaps in ([0.0010, -0.0005, 0.0008, 0.0004, -0.0001], [-0.0014, -0.0010, 0.0009]):
        assert "stays the default" in accuracy.bf16_rule(_seeded(gaps), FAR)


@pytest.mark.parametrize(
    ("gaps", "want"),
    [
        ([0.001, 0.001], "not run (2 of the 3 seeds)"),
        ([0.0020, 0.0021, 0.0019], "fails"),  # the candidate 0.2% +- 0.012% above the defaults
        ([0.0010, -0.0005, 0.0008], "holds"),  # above on average, not resolved
        ([-0.0010, -0.0012, -0.0008], "holds"),
    ],
)
def test_the_scope_rule_fails_only_where_the_candidate_is_resolved_worse_at_three_seeds(gaps, want):
    assert accuracy.scope_rule_1d(_seeded(gaps)).startswith(want)
