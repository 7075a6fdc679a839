"""Optimizers that tests train with: the shapes users bring (an Adam subclass, one with its own step, a three-beta
Adam variant, a hand-written sign optimizer, a SAM-style closure optimizer), none of them torch's own."""

from __future__ import annotations

import torch


class MyAdam(torch.optim.Adam):
    """A subclass that keeps Adam's step: corrected."""


class LoggingAdam(torch.optim.Adam):
    """A subclass with a step of its own: its update is not known here."""

    def step(self, closure=None):
        return super().step(closure)


def _evaluate(closure):
    """The closure's loss, computed with gradients on (``step`` runs under ``no_grad``); None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class ThreeBetaAdam(torch.optim.Optimizer):
    """An Adam variant with three betas and an ``exp_avg_sq`` (as Adan has): not torch's Adam, not corrected."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.92, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            b1, b2, b3 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["exp_avg"].lerp_(p.grad, 1 - b1)
                state["exp_avg_sq"].mul_(b3).addcmul_(p.grad, p.grad, value=1 - b3)
                p.sub_(group["lr"] * state["exp_avg"] / (state["exp_avg_sq"].sqrt() + 1e-8))
        return loss


class SignDescent(torch.optim.Optimizer):
    """A hand-written sign optimizer, with ``betas`` as Lion has them and no second moment."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad.sign())
        return loss


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation around a base optimizer: ``step(closure)`` evaluates the closure at the weights,
    moves them up the gradient by ``rho``, evaluates it again there, moves them back and lets the base optimizer step
    with the second gradient."""

    def __init__(self, params, base=torch.optim.AdamW, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base = base(self.param_groups, **kwargs)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None:
            raise RuntimeError("SAM needs a closure")
        with torch.enable_grad():
            loss = closure()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        moved = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                e = p.grad * (group["rho"] / (norm + 1e-12))
                p.add_(e)
                moved.append((p, e))
        with torch.enable_grad():
            closure()
        for p, e in moved:
            p.sub_(e)
        self.base.step()
        return loss
