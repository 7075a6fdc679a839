"""The optimizer step, one process: the step's owner (phases, transitions, public hooks only), each optimizer's verdict
from what it is, and the correction's rule where it used to break (coupled L2, amsgrad's first step, feedback's decay).

- ``exp_avg_sq`` stays >= 0 after every corrected step of torch's Adam family, whatever the gradient, the weight
  decay (coupled or decoupled), ``maximize``, ``amsgrad`` and the noise estimate: a search over random and adversarial
  cases (tiny and subnormal values, a gradient that the coupled decay cancels), through the real optimizers.
- The NaN of ``Adam(weight_decay>0)`` shown: the old floor, bounded with the raw gradient, drives Adam's second moment
  below zero where ``g + wd * p`` is small; the new one cannot.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zeropp.moments import SecondMomentCorrection, _UnitNoise, judge, noise_factor
from lightning_zeropp.step_owner import StepOwner, StepPhase, StepPhaseError
from lightning_zeropp.testing.optimizers import LoggingAdam, MyAdam, SignDescent, ThreeBetaAdam

# The floor as documented (moments.py's docstring, docs/accuracy.md): the corrected second moment never falls
# below half the uncorrected one. Written here, not imported: a changed floor must fail these tests.
FLOOR = 0.5


def _correction(optimizer, values, starts, spans, setting="auto", factor=1 / 12):
    """A correction whose one unit was reduced this step with ``values`` per block, its parameters at ``spans``
    ``(param, start, length)`` of the chunk."""
    correction = SecondMomentCorrection(factor, setting)
    correction.judge_optimizer(optimizer)
    entry = _UnitNoise(None, tuple(starts), torch.as_tensor(values, dtype=torch.float32))
    correction._units["unit"] = entry
    correction._reduced.add("unit")
    correction.reduced_parameters = lambda: iter([(entry, p, s, n) for p, s, n in spans])
    return correction


# ---------------------------------------------------------------------------------------------------- the verdicts
@pytest.mark.parametrize(
    "make, corrected, reason",
    [
        (lambda ps: torch.optim.Adam(ps), True, ""),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), True, ""),
        (lambda ps: torch.optim.Adam(ps, foreach=True, weight_decay=0.1), True, ""),
        (lambda ps: torch.optim.AdamW(ps, fused=True), True, ""),
        (lambda ps: torch.optim.NAdam(ps, decoupled_weight_decay=True), True, ""),
        (lambda ps: torch.optim.RAdam(ps), True, ""),
        (lambda ps: MyAdam(ps), True, ""),
        (lambda ps: torch.optim.Adamax(ps), False, "not an Adam second moment"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), False, "not an Adam second moment"),
        (lambda ps: LoggingAdam(ps), False, "its own step (not Adam's)"),
        (lambda ps: ThreeBetaAdam(ps), False, "not an Adam second moment"),
        (lambda ps: SignDescent(ps), False, "not an Adam second moment"),
        (lambda ps: torch.optim.Adam(ps, betas=(0.9, 0.0)), False, "betas=(0.9, 0.0)"),
        (lambda ps: torch.optim.Adam(ps, differentiable=True), False, "differentiable=True"),
    ],
)
def test_each_optimizer_is_judged_by_what_it_is(make, corrected, reason):
    verdict = judge(make([torch.nn.Parameter(torch.zeros(3))]))
    assert verdict.corrected == corrected and verdict.reason.startswith(reason), verdict


def test_true_refuses_an_optimizer_it_cannot_correct_in_one_sentence():
    correction = SecondMomentCorrection(1 / 12, True)
    with pytest.raises(ValueError, match=r"cannot correct SignDescent \(not an Adam second moment.*\"auto\"") as err:
        correction.judge_optimizer(SignDescent([torch.nn.Parameter(torch.zeros(3))]))
    assert str(err.value).count(". ") == 0  # one sentence


def test_one_optimizers_verdict_never_changes_anothers():
    """An SGD beside an Adam in one job: the SGD's parameters get no estimate, the Adam's do, for the whole run."""
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    adam, sgd = torch.optim.Adam([a]), torch.optim.SGD([b], lr=0.1)
    correction = SecondMomentCorrection(1 / 12, "auto")
    assert correction.judge_optimizer(sgd).describe() == "SGD: not an Adam second moment, off"
    assert not correction.active
    assert correction.judge_optimizer(adam).describe() == "Adam corrected"
    assert correction.wants_before_update(adam) and not correction.wants_before_update(sgd)
    correction.forget_optimizers()
    assert not correction.active and not correction.verdicts


# ---------------------------------------------------------------------------------------------------- the rule
def _old_lower(v, g, var, shift):
    """The rule before: the floor bounded with the raw gradient."""
    return v - torch.minimum(shift * var, (1 - FLOOR) * (v + shift * g * g))


def test_coupled_weight_decay_drove_adams_second_moment_below_zero_and_no_longer_does():
    """Adam(weight_decay=wd) squares ``g + wd * p``. Where that is small and the noise estimate large, the old floor
    (bounded by ``g^2``) lowered ``v`` below what Adam's ``(1 - b2)(g + wd p)^2`` gives back: ``exp_avg_sq < 0``, and
    the update's square root is NaN (what 2 x 2 ranks showed at step 3). The floor now uses Adam's own gradient."""
    b2, wd = 0.999, 0.1
    p = torch.nn.Parameter(torch.tensor([2.0, -3.0, 0.5]))
    optimizer = torch.optim.Adam([p], lr=1e-2, betas=(0.9, b2), weight_decay=wd)
    p.grad = torch.ones(3)
    optimizer.step()  # the state exists
    w = p.detach().clone()  # the weights the next update decays
    g = -wd * w + torch.tensor([1e-6, 0.0, 1e-3])  # the decay all but cancels the gradient
    v = torch.tensor([1e-6, 4e-6, 1e-6])
    var = torch.tensor([1.0, 1.0, 1.0])  # a large estimate: the floor binds
    old = b2 * _old_lower(v, g, var, (1 - b2) / b2) + (1 - b2) * (g + wd * w) ** 2
    assert (old < 0).all()  # the cause, shown

    optimizer.state[p]["exp_avg_sq"].copy_(v)
    p.grad = g.clone()
    correction = _correction(optimizer, var, (0, 1, 2, 3), [(p, 0, 3)])
    correction.before_update(optimizer, True)
    optimizer.step()
    after = optimizer.state[p]["exp_avg_sq"]
    assert (after >= 0).all() and torch.isfinite(p).all(), (after, p)
    uncorrected = b2 * v + (1 - b2) * (g + wd * w) ** 2
    assert torch.all(after >= FLOOR * uncorrected * (1 - 1e-5))  # never below the floor's share


_FAMILY_MAKERS = {
    "Adam": lambda ps, **k: torch.optim.Adam(ps, **k),
    "AdamW": lambda ps, **k: torch.optim.AdamW(ps, **k),
    "NAdam": lambda ps, **k: torch.optim.NAdam(ps, **{x: y for x, y in k.items() if x != "amsgrad"}),
    "RAdam": lambda ps, **k: torch.optim.RAdam(ps, **{x: y for x, y in k.items() if x != "amsgrad"}),
}


def _magnitude(gen, n):
    """Values over the whole fp32 range, subnormals and zeros included, either sign."""
    exponent = torch.randint(-46, 6, (n,), generator=gen).float()
    values = torch.rand(n, generator=gen) * 10.0**exponent
    values[torch.rand(n, generator=gen) < 0.1] = 0.0
    return values * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("name", sorted(_FAMILY_MAKERS))
def test_exp_avg_sq_stays_non_negative_whatever_the_gradient_decay_and_estimate(name):
    """A search for a counterexample: 150 cases per optimizer class (random magnitudes over fp32's range, a gradient
    the coupled decay cancels exactly, ``maximize``, ``amsgrad``, foreach, b2 from 0.5 to 0.99999), each corrected
    and stepped by the real optimizer; ``exp_avg_sq`` (and ``max_exp_avg_sq``) >= 0 and the weights finite."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    n = 64
    for case in range(150):
        b2 = [0.5, 0.9, 0.95, 0.999, 0.99999][case % 5]
        wd = [0.0, 1e-4, 0.1, 10.0][(case // 5) % 4]
        kwargs = dict(lr=1e-2, betas=(0.9, b2), weight_decay=wd, maximize=bool(case % 3 == 0),
                      amsgrad=bool(case % 7 == 0), foreach=bool(case % 2))  # fmt: skip
        if name in ("NAdam", "RAdam"):
            kwargs["decoupled_weight_decay"] = bool(case % 4 == 0)
        p = torch.nn.Parameter(_magnitude(gen, n) * 1e3)
        optimizer = _FAMILY_MAKERS[name]([p], **kwargs)
        p.grad = _magnitude(gen, n)
        optimizer.step()  # the state exists; then adversarial second moments
        optimizer.state[p]["exp_avg_sq"].copy_(_magnitude(gen, n).abs())
        g = _magnitude(gen, n)
        if case % 6 == 1:  # Adam's squared gradient cancelled by the coupled decay (its sign with maximize)
            sign = -1.0 if kwargs["maximize"] else 1.0
            g = sign * (-wd * p.detach())
        p.grad = g.clone()
        var = _magnitude(gen, 8).abs() * 10.0 ** float(torch.randint(-6, 7, (), generator=gen))
        correction = _correction(optimizer, var, tuple(range(0, 65, 8)), [(p, 0, n)])
        correction.before_update(optimizer, True)
        assert (optimizer.state[p]["exp_avg_sq"] >= -math.inf).all()
        optimizer.step()
        state = optimizer.state[p]
        assert (state["exp_avg_sq"] >= 0).all(), (name, case, kwargs)
        if "max_exp_avg_sq" in state:
            assert (state["max_exp_avg_sq"] >= 0).all(), (name, case, kwargs)
        assert torch.isfinite(p).all(), (name, case, kwargs)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_first_step_is_corrected_after_it_amsgrads_peak_too_with_no_estimate_expanded(amsgrad):
    """The state the first update creates: ``v = (1 - b2) g^2`` lowered by ``(1 - b2) var`` (floored at FLOOR v),
    and with amsgrad ``max_exp_avg_sq`` (equal to v after one step) alike; nothing per element is kept meanwhile."""
    p = torch.nn.Parameter(torch.zeros(5))
    optimizer = torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.8), amsgrad=amsgrad)
    correction = _correction(optimizer, [0.5, 100.0, 0.25], (0, 2, 4, 5), [(p, 0, 5)])
    p.grad = torch.ones(5)
    correction.before_update(optimizer, True)
    pending = correction._first[id(optimizer)]
    assert all(x is p or not isinstance(x, torch.Tensor) or x.numel() <= 1 for item in pending for x in item)
    optimizer.step()
    correction.after_update(optimizer, True)
    v1 = 0.2 * torch.ones(5)
    want = torch.maximum(v1 - 0.2 * torch.tensor([0.5, 0.5, 100.0, 100.0, 0.25]), FLOOR * v1)
    torch.testing.assert_close(optimizer.state[p]["exp_avg_sq"], want)
    if amsgrad:
        torch.testing.assert_close(optimizer.state[p]["max_exp_avg_sq"], want)
    assert correction.corrected == 1


def test_feedbacks_factor_follows_its_decay():
    """``n_t = d r_{t-1} - r_t``: variance ``(1 + d^2)`` rounding's; and what a simulation of the recursion gives."""
    assert noise_factor("nearest", None) == pytest.approx(1 / 12)
    assert noise_factor("nearest", 1.0) == pytest.approx(2 / 12)
    assert noise_factor("nearest", 0.8) == pytest.approx(1.64 / 12)
    assert noise_factor("stochastic", 0.5) == pytest.approx(1.25 / 6)
    gen = torch.Generator().manual_seed(0)
    for d in (0.0, 0.5, 0.8, 1.0):
        residual, errors = torch.zeros(20000), []
        for _ in range(30):
            x = torch.randn(20000, generator=gen) * 3
            carried = x + d * residual
            sent = carried.round()  # a block scale of 1: rounding to nearest
            residual = carried - sent
            errors.append(sent - x)
        measured = torch.stack(errors[5:]).var().item()
        assert measured == pytest.approx(noise_factor("nearest", d), rel=0.03), d


# ---------------------------------------------------------------------------------------------------- the owner
class Recorder:
    def __init__(self, wants=False):
        self.events, self.wants = [], wants

    def wants_before_update(self, optimizer):
        return self.wants

    def new_step(self):
        self.events.append("new step")

    def backward_done(self):
        self.events.append("backward done")

    def before_update(self, optimizer, fresh):
        self.events.append(("before", fresh))

    def after_update(self, optimizer, fresh):
        self.events.append(("after", fresh))


def _reducing_backward(owner, p):
    """A backward whose gradient hook is a reduction (as FSDP2's reduce-scatter is)."""
    p.register_hook(lambda g: owner.reduction())
    (p * 2).sum().backward()


def test_the_owner_walks_the_phases_through_public_hooks_and_detaches():
    owner, seen = StepOwner(), Recorder()
    owner.subscribe(seen)
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    before = dict(vars(optimizer))
    owner.attach(optimizer)
    owner.attach(optimizer)  # once per optimizer
    assert {k: id(v) for k, v in vars(optimizer).items()} == {k: id(v) for k, v in before.items()}
    _reducing_backward(owner, p)
    assert owner.phase is StepPhase.REDUCED and seen.events == ["new step", "backward done"]
    optimizer.step()  # no closure: before update from the pre-hook
    optimizer.step()  # again on the same gradients: not fresh
    assert owner.phase is StepPhase.UPDATED
    assert seen.events[2:] == [("before", True), ("after", True), ("before", False), ("after", False)]
    owner.detach()
    optimizer.step()
    assert owner.attached == 0 and len(seen.events) == 6  # no hook of ours left: the step reached no subscriber


def test_a_closure_is_wrapped_only_where_asked_and_still_called_by_the_optimizer():
    """The Trainer's path: ``step(closure)``; the before-update runs when the closure returns (its backward done);
    a closure called twice (SAM) is the optimizer's own business where nobody asked to wrap it."""
    for wants in (False, True):
        owner, seen, calls = _closure_run(wants)
        assert len(calls) >= 2  # LBFGS calls its closure more than once
        befores = [e for e in seen.events if isinstance(e, tuple) and e[0] == "before"]
        assert len(befores) == (len(calls) if wants else 0), (wants, seen.events)
        assert owner.phase is StepPhase.UPDATED


def _closure_run(wants):
    owner, seen = StepOwner(), Recorder(wants)
    owner.subscribe(seen)
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.LBFGS([p], lr=0.1, max_iter=2)
    owner.attach(optimizer)
    calls = []

    def closure():
        calls.append(owner.phase)
        optimizer.zero_grad()
        loss = (p * p).sum()
        p.register_hook(lambda g: owner.reduction())
        loss.backward()
        return loss

    optimizer.step(closure)
    return owner, seen, calls


def test_a_step_while_a_backward_reduces_is_refused_naming_both_phases():
    owner = StepOwner()
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    owner.attach(optimizer)

    def step_inside(g):
        owner.reduction()
        optimizer.step()
        return g

    p.register_hook(step_inside)
    with pytest.raises(StepPhaseError, match=r"'before update' came while the step was 'reducing' \(reducing -> upd"):
        (p * 2).sum().backward()
