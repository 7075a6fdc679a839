"""The one owner of what runs around an optimizer step: the step's phases, an enum, checked transitions.

What the collectives' features need from a training step, and when (``StepPhase``)::

    IDLE ──reduction──> REDUCING ──end of backward──> REDUCED ──before update──> UPDATING ──update done──> UPDATED
      ^                   ^   |                          |  ^                        |                         |
      |                   └───┘ (the same backward)      |  └── another backward ────┘ (a closure run again)   |
      |                          (accumulation) <────────┘                                                     |
      └───────── (a reduction after an update starts the next step: REDUCING) <────────────────────────────────┘

- a *reduction* is a call of the strategy's reduce-scatter (or all-reduce) hook: the first one of a backward asks
  autograd to call :meth:`StepOwner.backward_done` when that backward ends (the end is autograd's to tell: FSDP2's own
  end-of-backward work has run by then, the reduced gradients are in ``param.grad``). The first reduction after an
  update (or the first ever) starts a new step: :meth:`Subscriber.new_step`.
- *before update* runs right before an optimizer changes the weights: from the optimizer's step pre-hook where it is
  called without a closure (Fabric, fp16's scaler: the backward and clipping are done), or where it is called with
  one (the Trainer) when that closure returns (after Lightning's backward and gradient clipping): the pre-hook hands
  the optimizer a closure that calls the original and then this. The optimizer's own ``step`` still receives and
  calls its closure. A closure is wrapped only where a subscriber asks (:meth:`Subscriber.wants_before_update`).
- *update done* runs from the optimizer's step post-hook.

Attached through ``Optimizer.register_step_pre_hook`` / ``register_step_post_hook`` (public torch API), detached at
teardown; no attribute of the user's optimizer is replaced. FSDP2 keeps the same kind of state for a module's
lifecycle (its ``TrainingState``); neither FSDP2 nor Lightning's ModelParallelStrategy touches the optimizer at all,
and this owner touches it only through those two hooks.

Out of order, and refused with an error naming both phases: an optimizer step while a backward is still reducing
(from a gradient hook, say); the end of a backward that reduced nothing (a bug of ours). A step whose ``step`` raised
after the pre-hook leaves UPDATING; the next reduction starts over from there.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from .compat.torch import call_after_backward


class StepPhase(enum.Enum):
    IDLE = "idle"  # no gradient reduced yet in this job
    REDUCING = "reducing"  # a backward is reducing gradients
    REDUCED = "reduced"  # that backward has ended: the gradients of this step are complete (for now)
    UPDATING = "updating"  # an optimizer is about to change the weights; what runs before it has run
    UPDATED = "updated"  # an optimizer changed the weights; another may still step on the same gradients


class StepPhaseError(RuntimeError):
    """A phase of the training step came out of order."""


# the event -> the phases it may come from (and the phase it leads to)
_EVENTS: dict[str, tuple[frozenset[StepPhase], StepPhase]] = {
    "reduction": (frozenset(StepPhase), StepPhase.REDUCING),
    "end of backward": (frozenset({StepPhase.REDUCING}), StepPhase.REDUCED),
    "before update": (frozenset(StepPhase) - {StepPhase.REDUCING}, StepPhase.UPDATING),
    "update done": (frozenset(StepPhase) - {StepPhase.REDUCING}, StepPhase.UPDATED),
}
_NEW_STEP_FROM = frozenset({StepPhase.IDLE, StepPhase.UPDATING, StepPhase.UPDATED})


class StepOwner:
    """Owns the phases of the training steps of one sharded model (one per :class:`~lightning_zeropp.comm.ZeroPPComms`).

    Subscribers (the second-moment correction, weight deltas, the step counter error feedback reads) are called in the
    order they subscribed, each with whichever of these methods it has: ``new_step()``, ``backward_done()``,
    ``before_update(optimizer, fresh)`` and ``after_update(optimizer, fresh)``; ``fresh`` is whether this optimizer
    updates for the first time on this step's gradients (a second ``step`` without a backward in between is not).
    ``wants_before_update(optimizer)``: whether the subscriber needs ``before_update`` between a closure's backward
    and the update (only then is a closure wrapped).
    """

    def __init__(self) -> None:
        self.phase = StepPhase.IDLE
        self._subscribers: list[Any] = []
        self._handles: dict[int, list[Any]] = {}  # id(optimizer) -> its two hook handles
        self._updated: set[int] = set()  # id(optimizer) of those that updated on this step's gradients

    # ------------------------------------------------------------------ wiring
    def subscribe(self, subscriber: Any) -> None:
        self._subscribers.append(subscriber)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hooks ``optimizer``'s steps (once per optimizer, however often it is set up)."""
        if id(optimizer) in self._handles:
            return
        self._handles[id(optimizer)] = [
            optimizer.register_step_pre_hook(self._pre_hook),
            optimizer.register_step_post_hook(self._post_hook),
        ]

    def detach(self) -> None:
        """Removes every hook this owner registered (the strategy's teardown)."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()

    @property
    def attached(self) -> int:
        """How many optimizers are hooked."""
        return len(self._handles)

    # ------------------------------------------------------------------ events
    def _move(self, event: str) -> StepPhase:
        sources, target = _EVENTS[event]
        if self.phase not in sources:
            raise StepPhaseError(
                f"ZeroPPStrategy: the training step's {event!r} came while the step was {self.phase.value!r}"
                f" ({self.phase.value} -> {target.value} is out of order): {_ADVICE.get((self.phase, event), '')}"
            )
        previous, self.phase = self.phase, target
        return previous

    def _call(self, method: str, *args: Any) -> None:
        for subscriber in self._subscribers:
            hook = getattr(subscriber, method, None)
            if hook is not None:
                hook(*args)

    def reduction(self) -> None:
        """A gradient reduction (the reduce-scatter or all-reduce hook), before it runs."""
        previous = self._move("reduction")
        if previous in _NEW_STEP_FROM:
            self._updated.clear()
            self._call("new_step")
        if previous is not StepPhase.REDUCING:  # this backward's first reduction: be told when it ends
            call_after_backward(self.backward_done)

    def backward_done(self) -> None:
        """The backward that reduced gradients has ended (autograd's final callback)."""
        self._move("end of backward")
        self._call("backward_done")

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        self._move("before update")
        self._call("before_update", optimizer, id(optimizer) not in self._updated)

    def update_done(self, optimizer: torch.optim.Optimizer) -> None:
        self._move("update done")
        fresh = id(optimizer) not in self._updated
        self._updated.add(id(optimizer))
        self._call("after_update", optimizer, fresh)

    # ------------------------------------------------------------------ the optimizer's hooks
    def _wants_before_update(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(s.wants_before_update(optimizer) for s in self._subscribers if hasattr(s, "wants_before_update"))

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # torch passes ``step``'s arguments with the optimizer first: ``(optimizer, closure?)``
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:  # the backward (and any clipping) is done: the update comes next
            self.before_update(optimizer)
            return None
        if not self._wants_before_update(optimizer):
            return None
        wrapped = _ThenBeforeUpdate(closure, lambda: self.before_update(optimizer))
        if len(args) > 1:
            return (args[0], wrapped, *args[2:]), kwargs
        return args, {**kwargs, "closure": wrapped}

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.update_done(optimizer)


class _ThenBeforeUpdate:
    """The user's closure, then what runs right before the update (the closure's result returned as it was)."""

    def __init__(self, closure: Callable[..., Any], then: Callable[[], None]) -> None:
        self.closure = closure
        self.then = then

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.closure(*args, **kwargs)
        self.then()
        return out


_ADVICE = {
    (StepPhase.REDUCING, "before update"): "an optimizer stepped while a backward was still reducing gradients (from"
    " a gradient or backward hook?); step the optimizer after `backward()` returns.",
    (StepPhase.REDUCING, "update done"): "an optimizer stepped while a backward was still reducing gradients; step"
    " the optimizer after `backward()` returns.",
}
