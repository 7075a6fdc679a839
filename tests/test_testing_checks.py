"""The accuracy checker the parity tests share (``lightning_zeropp.testing.workers.update_problems``), on tensors made
here with errors worked out by hand: a parameter that never moved, one that barely moved, one far off while the whole
model is close, and a whole model off while every parameter is within its bound are each reported, and nothing else
is. The spawned tests show their bounds failing on faults of the product; this shows what the checker reports."""

from __future__ import annotations

import pytest
import torch

from lightning_zeropp.testing.workers import scaled_update, update_errors, update_problems

# Updates (``state - init``) by hand: the reference moves a by (3, 4) (norm 5) and b by (0, 0, 12) (norm 12), 13 in
# all; starting away from zero, so that a checker reading the weights instead of their updates gets other figures.
INIT = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5, 0.25, -1.0])}
REFERENCE_UPDATE = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 0.0, 12.0])}
REFERENCE = {n: INIT[n] + u for n, u in REFERENCE_UPDATE.items()}
LOOSE = dict(per_parameter=10.0, whole=10.0)


def _moved(**updates: torch.Tensor) -> dict[str, torch.Tensor]:
    """``INIT`` moved by the reference's update, except the parameters named, moved by the updates given."""
    return {n: INIT[n] + updates.get(n, REFERENCE_UPDATE[n]) for n in INIT}


def test_errors_per_parameter_and_whole_model_by_hand():
    # b off by (0, 5, 0): 5 / 12 on b, 5 / 13 over the whole model, a exact
    per, whole = update_errors(_moved(b=torch.tensor([0.0, 5.0, 12.0])), REFERENCE, INIT)
    assert per["a"] == 0.0
    assert per["b"] == pytest.approx(5 / 12, rel=1e-6)
    assert whole == pytest.approx(5 / 13, rel=1e-6)


def test_the_reference_itself_passes_tight_bounds():
    assert update_problems(REFERENCE, REFERENCE, INIT, per_parameter=0.0, whole=0.0, min_movement=1.0) == []


def test_a_parameter_that_never_moved_is_named():
    state = dict(REFERENCE, b=INIT["b"].clone())
    # reported as never moved, not as a movement of 0 of the reference's; its error (1.0) is under this loose bound
    assert update_problems(state, REFERENCE, INIT, **LOOSE) == ["b: never moved"]
    # no update at all: every parameter, and the whole model (error 1.0), whatever the per-parameter bound
    problems = update_problems(dict(INIT), REFERENCE, INIT, per_parameter=10.0, whole=0.9)
    assert problems == ["a: never moved", "b: never moved", "whole model: update error 1.0000 > 0.9"]


def test_a_parameter_moved_by_one_ulp_is_not_never_moved():
    """Never moved means bit-identical to its start; a parameter that moved at all falls to the movement bound."""
    state = dict(REFERENCE, b=torch.nextafter(INIT["b"], torch.full_like(INIT["b"], 100.0)))
    problems = update_problems(state, REFERENCE, INIT, **LOOSE)
    assert len(problems) == 1 and problems[0].startswith("b: moved 0.000 of the reference's update < 0.5"), problems


def test_a_starved_parameter_is_caught_by_the_movement_bound_alone():
    # b moves (0, 0, 1.2): the right direction, 0.1 of the reference's length; its error (0.9) is under 1.0
    state = _moved(b=torch.tensor([0.0, 0.0, 1.2]))
    problems = update_problems(state, REFERENCE, INIT, per_parameter=1.0, whole=1.0)
    assert problems == ["b: moved 0.100 of the reference's update < 0.5"]
    assert update_problems(state, REFERENCE, INIT, per_parameter=1.0, whole=1.0, min_movement=0.1) == []


def test_one_parameter_far_off_inside_a_close_whole_model():
    """The average that hides one bad element: a reversed, an error of 2 (10 / 5), is 10 / 13 of the whole model."""
    state = _moved(a=torch.tensor([-3.0, -4.0]))
    per, whole = update_errors(state, REFERENCE, INIT)
    assert per["a"] == pytest.approx(2.0, rel=1e-6) and whole == pytest.approx(10 / 13, rel=1e-6)
    assert update_problems(state, REFERENCE, INIT, per_parameter=1.0, whole=0.8) == ["a: update error 2.000 > 1.0"]


def test_a_scaled_update_is_caught_by_the_whole_model_bound_alone():
    """Every parameter half its update: 0.5 on each, within a per-parameter bound of 0.75, and 0.5 on the whole."""
    state = scaled_update(REFERENCE, INIT, 0.5)
    per, whole = update_errors(state, REFERENCE, INIT)
    assert per == pytest.approx({"a": 0.5, "b": 0.5}, rel=1e-6) and whole == pytest.approx(0.5, rel=1e-6)
    assert update_problems(state, REFERENCE, INIT, per_parameter=0.75, whole=0.17) == [
        "whole model: update error 0.5000 > 0.17"
    ]
