"""Preemption: SLURM's requeue signal saves a checkpoint at a step boundary that every rank agrees on.

Lightning's auto-requeue (``SLURMEnvironment(auto_requeue=True)``, what Lightning uses under SLURM by default) answers
the requeue signal (``SIGUSR1``; ``#SBATCH --signal=SIGUSR1@90``) from inside the signal handler: it saves
``hpc_ckpt_N.ckpt`` and runs ``scontrol requeue``. A signal handler runs wherever the rank happens to be, and each
rank is somewhere else: mid-forward, mid-backward, between the two hops of a qgZ reduction. With a sharded model the
save's collectives then meet other collectives (the job hangs), or the save reshards weights the running forward is
using (``aten.addmm.default got mixed torch.Tensor and DTensor``).

:class:`Preemption` moves that work to step boundaries::

    signal (any rank, any moment) ──> count += 1                        (nothing else inside the handler)
    boundary (every rank) ──────────> all_reduce(MAX, [count, who asked to save, SIGTERMs])   24 bytes, world group
                                      count > handled: Lightning's handler on every rank, here:
                                          loggers finalized, hpc_ckpt_N.ckpt saved (one step, one path),
                                          then rank 0 runs `scontrol requeue <job id>`
                                      a SIGTERM anywhere: Lightning's SIGTERM handler on every rank, here

- Once Lightning has installed its handler, the strategy puts one in its place that only counts the signal
  (:meth:`Preemption.take_over`); Lightning's is kept, run at the boundary, and put back at teardown.
- Boundaries (:class:`Boundaries`): after a training batch whose optimizer stepped, at the end of a validation run of
  ``fit``, at the end of training, and after each batch of ``validate``/``test``/``predict``; between the batches of a
  validation run of ``fit`` for SIGTERM only (the saves wait for the run's end). Every rank reaches each of them, so
  the all-reduce always finds its peers. It runs only while the strategy holds the signal: outside auto-requeue no
  collective is added.
- The count is combined by MAX: a rank whose copy of the signal arrives after the save (a late copy) does not start a
  second one, and a signal that reaches one rank only is enough for all of them.
- ``save_checkpoint`` called while a step is in flight (:meth:`Preemption.in_flight`: a step method, backward, an
  optimizer step, a save) is recorded and returns; it runs at the next boundary, on every rank: with the agreement,
  the request of the lowest rank that made one is broadcast; without it, every rank must have asked, as for any save.
- ``SIGTERM`` (SLURM sends it at the time limit, on ``scancel``, and right after ``scontrol requeue``) is counted in
  the same way while the strategy holds the requeue signal, and exchanged in the same all-reduce: at the boundary
  every rank runs Lightning's SIGTERM handler at once (it broadcasts a flag from rank 0 inside the handler; run
  wherever a rank happens to be, that broadcast meets other collectives and the ranks wait for each other until
  SIGKILL), and the loop stops at the end of the batch. A SIGTERM during a save is held until the save is over, then
  given to the handler that was there (outside auto-requeue: Lightning's), so a save is never cut by its collectives.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from .compat.lightning import SAVE_CHECKPOINT_BARRIER, requeue_handler

__all__ = ["Boundaries", "Preemption"]

Exchange = Callable[[list[int]], list[int]]  # all-reduce (MAX) of a few ints over every rank
Broadcast = Callable[[Any, int], Any]  # an object from one rank to all


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Preemption:
    """One strategy's requeue signal, saves waiting for a boundary, and what is in flight."""

    def __init__(self) -> None:
        self.depth = 0  # steps and saves in flight on this rank
        self.deferred: list[tuple[str, bool]] = []  # (path, weights_only) of saves asked for during a step
        self.skip_barrier = False
        self.stepped = False  # an optimizer stepped since the last training batch ended
        self.signum: int | None = None
        self.requeue: Callable[[int, Any], None] | None = None  # Lightning's handler, while the strategy holds it
        self.received = 0  # requeue signals this rank received since the strategy took the signal over
        self.handled = 0  # the most any rank had received at the last boundary: those are answered
        self.requeueing = False
        self.saved: tuple[str, int] | None = None  # the last requeue checkpoint of this run: path, global step
        self.terminate: Callable[[int, Any], None] | None = None  # Lightning's SIGTERM handler, while held
        self.terms = 0  # SIGTERMs this rank received while the strategy held the signal
        self.terms_handled = 0

    # ------------------------------------------------------------------ in flight
    @property
    def busy(self) -> bool:
        """Whether a step method, backward, an optimizer step or a save is running on this rank."""
        return self.depth > 0

    @contextmanager
    def in_flight(self) -> Generator[None, None, None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    @contextmanager
    def saving(self) -> Generator[list[int], None, None]:
        """A save in flight: another save asked for meanwhile waits for the boundary, and SIGTERM is held until this
        one is over (yields the list of held signals), then given to the handler that was installed."""
        held: list[int] = []
        previous = signal.getsignal(signal.SIGTERM) if _main_thread() else None
        if callable(previous):
            signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
        else:
            previous = None  # the default action (end the process) or none: nothing to hold it for
        self.depth += 1
        try:
            yield held
        finally:
            self.depth -= 1
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
                for signum in held:
                    previous(signum, None)

    def defer(self, path: str, weights_only: bool) -> None:
        """A save asked for during a step: it runs at the next boundary (and the barrier that follows the call in
        ``Trainer.save_checkpoint`` is skipped: the other ranks are not there)."""
        self.deferred.append((path, weights_only))
        self.skip_barrier = True

    def skips(self, barrier_name: str | None) -> bool:
        """Whether this barrier is the one ``Trainer.save_checkpoint`` calls after a save that was deferred."""
        skip = self.skip_barrier and self.busy and barrier_name == SAVE_CHECKPOINT_BARRIER
        self.skip_barrier = False
        return skip

    # ------------------------------------------------------------------ the signal
    def take_over(self, signum: int | None) -> None:
        """If Lightning's auto-requeue handler is installed for ``signum``, puts a handler in its place that only
        counts the signal, and does the same for SIGTERM: Lightning's SIGTERM handler broadcasts a flag from rank 0
        inside the handler, which meets whatever collective the other ranks are in (seen: ranks 1-3 waiting in that
        broadcast while rank 0 waited in a step's all-reduce, until SIGKILL). Idempotent."""
        if self.requeue is not None or signum is None or not _main_thread():
            return
        handler = requeue_handler(signum)
        if handler is None:
            return
        self.requeue, self.signum = handler, signum
        self.received = self.handled = self.terms = self.terms_handled = 0
        self.saved = None
        signal.signal(signum, self._count)
        terminate = signal.getsignal(signal.SIGTERM)
        if callable(terminate):
            self.terminate = terminate
            signal.signal(signal.SIGTERM, self._count_term)

    # nothing else in these two: a signal handler runs in the middle of whatever this rank was doing (logging included)
    def _count(self, signum: int, frame: Any) -> None:
        self.received += 1

    def _count_term(self, signum: int, frame: Any) -> None:
        self.terms += 1

    def release(self) -> None:
        """Puts Lightning's handlers back (teardown; Lightning then restores what was there before the run), and gives
        Lightning's SIGTERM handler a SIGTERM that arrived after the last boundary."""
        if self.requeue is None:
            return
        assert self.signum is not None
        if _main_thread() and signal.getsignal(self.signum) == self._count:
            signal.signal(self.signum, self.requeue)
        if self.received > self.handled:
            rank_zero_warn(
                f"ZeroPPStrategy: the requeue signal ({signal.Signals(self.signum).name}) arrived after the run's last"
                " step boundary; no checkpoint was saved for it and the job was not requeued."
            )
        terminate, self.terminate = self.terminate, None
        if terminate is not None:
            if _main_thread() and signal.getsignal(signal.SIGTERM) == self._count_term:
                signal.signal(signal.SIGTERM, terminate)
            if self.terms > self.terms_handled:
                terminate(signal.SIGTERM, None)
        self.requeue = self.signum = None
        self.deferred.clear()

    # ------------------------------------------------------------------ boundaries
    def boundary(
        self,
        trainer: pl.Trainer,
        exchange: Exchange,
        broadcast: Broadcast,
        world_size: int,
        rank: int,
        saves: bool = True,
    ) -> None:
        """Every rank is between steps: run the saves asked for during the step and, if a requeue signal arrived on
        any rank, Lightning's requeue handler (save, then ``scontrol requeue``); then, if a SIGTERM arrived on any
        rank, Lightning's SIGTERM handler. Collective while the strategy holds the signal. ``saves=False`` (between
        the batches of a validation run inside ``fit``): SIGTERM only, the saves wait for the validation's end."""
        if self.busy:
            return
        requests, answer, terms = [], False, 0
        if saves:
            requests, self.deferred = self.deferred, []
        if self.requeue is not None:
            signals, asked, terms = exchange(
                [self.received if saves else 0, world_size - rank if requests else 0, self.terms]
            )
            if asked:
                requests = broadcast(requests, world_size - asked)
            answer = saves and signals > self.handled
            self.handled = max(self.handled, signals)
        for path, weights_only in requests:
            trainer.save_checkpoint(path, weights_only=weights_only)
        if answer:
            assert self.requeue is not None and self.signum is not None
            rank_zero_info(
                f"ZeroPPStrategy: requeue signal ({signal.Signals(self.signum).name}): saving at global step"
                f" {trainer.global_step} on every rank, then requeueing the job."
            )
            self.requeueing = True
            try:
                self.requeue(self.signum, None)
            finally:
                self.requeueing = False
            # `scontrol requeue` makes SLURM send SIGTERM at once, often before the next boundary: look again now
            terms = exchange([0, 0, self.terms])[2]
        if terms > self.terms_handled and self.terminate is not None:
            # every rank at once: Lightning's handler (its broadcast included) sets `trainer.received_sigterm`, and
            # the loop stops at the end of this batch on every rank
            self.terms_handled = terms
            self.terminate(signal.SIGTERM, None)

    def record_save(self, path: str, global_step: int) -> None:
        if self.requeueing:
            self.saved = (path, global_step)

    def sigterm_report(self, global_step: int) -> str:
        """What a run stopped by SIGTERM did about it (a requeue checkpoint or none)."""
        text = (
            f"ZeroPPStrategy: SIGTERM stopped the run after global step {global_step} (SLURM sends it at the time"
            " limit, on scancel and after `scontrol requeue`)."
        )
        if self.saved is not None:
            path, step = self.saved
            return (
                f"{text} The requeue checkpoint {path} (global step {step}) is complete; a requeued job resumes there."
            )
        return text + (
            " This run saved no requeue checkpoint; a requeued job resumes from the newest complete hpc_ckpt_N.ckpt, if"
            " any (a save cut short never replaces one)."
        )


class Boundaries(Callback):
    """Calls ``boundary()`` of the strategy where every rank is between steps (see the module's docstring)."""

    def __init__(self, boundary: Callable[..., None], preemption: Preemption) -> None:
        self.boundary = boundary
        self.preemption = preemption

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stepped, self.preemption.stepped = self.preemption.stepped, False
        if stepped or not trainer.optimizers:  # not between micro-batches of an accumulation
            self.boundary(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.boundary(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.boundary(trainer)

    def _evaluation_batch_end(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            self.boundary(trainer)
        elif not trainer.sanity_checking:  # inside fit: SIGTERM only (Lightning stops after any validation batch)
            self.boundary(trainer, saves=False)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._evaluation_batch_end(trainer)

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._evaluation_batch_end(trainer)

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._evaluation_batch_end(trainer)
