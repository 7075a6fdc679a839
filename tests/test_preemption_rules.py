"""The rules of :mod:`lightning_zeropp.preemption`, on simulated ranks in one process (a thread per rank; the
all-reduce and the broadcast computed from what each rank sends, without torch.distributed): which boundary answers a
requeue signal, that a late copy of the signal starts no second save, whose save request every rank runs, what the
barrier after a deferred save does, SIGTERM answered on every rank at once, and SIGTERM held during a save.
``tests/test_preemption.py`` runs them on real ranks."""

from __future__ import annotations

import copy
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from lightning_zeropp.checkpoint_files import target_name, temporary_name
from lightning_zeropp.compat.lightning import SAVE_CHECKPOINT_BARRIER
from lightning_zeropp.preemption import Preemption

pytestmark = pytest.mark.version_sensitive

WORLD = 4


class FakeTrainer:
    global_step = 7

    def __init__(self) -> None:
        self.saved: list[tuple[str, bool]] = []
        self.terms = 0

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        self.saved.append((path, weights_only))


def _job(holding: bool = True) -> tuple[list[Preemption], list[FakeTrainer], list[int]]:
    """``WORLD`` ranks' Preemption objects; with ``holding``, each holds the requeue signal and SIGTERM with fake
    handlers: the requeue handler saves and counts its calls per rank, the SIGTERM one counts into ``trainer.terms``."""
    ranks = [Preemption() for _ in range(WORLD)]
    trainers = [FakeTrainer() for _ in range(WORLD)]
    requeued = [0] * WORLD
    for r, p in enumerate(ranks):
        if holding:
            p.signum = signal.SIGUSR1

            def requeue(signum, frame, r=r):
                trainers[r].save_checkpoint(f"hpc_ckpt_{requeued[r] + 1}.ckpt")
                requeued[r] += 1

            p.requeue = requeue
            p.terminate = lambda signum, frame, t=trainers[r]: setattr(t, "terms", t.terms + 1)
    return ranks, trainers, requeued


class _Collectives:
    """``WORLD`` ranks' all-reduce (MAX) and object broadcast, each rank in its own thread: a call returns only when
    every rank has made it, with what the ranks sent, as the world group's collectives do. A rank that makes one call
    more than its peers (or another kind of call) breaks the barrier instead of hanging."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(WORLD, timeout=10)
        self.slots: list[Any] = [None] * WORLD
        self.calls = [0] * WORLD  # collectives of either kind, per rank
        self.exchanges = [0] * WORLD

    def _gather(self, rank: int, value: Any) -> list[Any]:
        self.calls[rank] += 1
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()  # nobody writes the next call's value before every rank has read this one's
        return seen

    def exchange(self, rank: int, values: list[int]) -> list[int]:
        self.exchanges[rank] += 1
        sent = self._gather(rank, ("all_reduce", list(values)))
        kinds = {kind for kind, _ in sent}
        assert kinds == {"all_reduce"}, f"rank {rank}: the ranks made different collectives: {sent}"
        lengths = {len(v) for _, v in sent}
        assert len(lengths) == 1, f"the ranks all-reduced lists of different lengths: {sent}"
        return [max(column) for column in zip(*(v for _, v in sent))]

    def broadcast(self, rank: int, obj: Any, src: int) -> Any:
        sent = self._gather(rank, ("broadcast", (copy.deepcopy(obj), src)))
        assert {kind for kind, _ in sent} == {"broadcast"}, f"rank {rank}: the ranks made different collectives: {sent}"
        sources = {s for _, (_, s) in sent}
        assert len(sources) == 1 and 0 <= src < WORLD, f"the ranks broadcast from different or no ranks: {sources}"
        return copy.deepcopy(sent[src][1][0])


def _boundary(ranks: list[Preemption], trainers: list[FakeTrainer], saves: bool = True) -> int:
    """Every rank reaches a boundary at once, each in a thread of its own, and exchanges what it holds with the others
    through :class:`_Collectives` (the MAX all-reduce and the broadcast the strategy passes in): what a rank learns is
    what the ranks sent. Returns how many all-reduces each rank made (the same on every rank, or the test fails)."""
    comm = _Collectives()
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            ranks[r].boundary(
                trainers[r],
                lambda values: comm.exchange(r, values),
                lambda obj, src: comm.broadcast(r, obj, src),
                WORLD,
                r,
                saves,
            )
        except BaseException as error:  # reported by the main thread
            errors.append(error)
            comm.barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting in a collective"
    first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None:
        raise first
    assert not errors, f"a collective found some ranks missing (calls per rank: {comm.calls}): {errors}"
    assert len(set(comm.calls)) == 1, f"the ranks made different numbers of collectives: {comm.calls}"
    return comm.exchanges[0]


def test_a_signal_on_one_rank_is_answered_once_by_every_rank():
    ranks, trainers, requeued = _job()
    ranks[2].received += 1  # the signal reached rank 2 first
    _boundary(ranks, trainers)
    assert requeued == [1] * WORLD
    assert [t.saved for t in trainers] == [[("hpc_ckpt_1.ckpt", False)]] * WORLD
    for r in (0, 1, 3):  # the late copies of the same signal
        ranks[r].received += 1
    _boundary(ranks, trainers)
    assert requeued == [1] * WORLD, "a late copy of the signal started a second save"
    ranks[0].received += 1  # a new signal
    _boundary(ranks, trainers)
    assert requeued == [2] * WORLD


def test_two_signals_before_one_boundary_make_one_save():
    ranks, trainers, requeued = _job()
    ranks[0].received += 2
    ranks[3].received += 1
    _boundary(ranks, trainers)
    _boundary(ranks, trainers)
    assert requeued == [1] * WORLD


def test_a_save_asked_for_during_a_step_runs_on_every_rank_at_the_boundary():
    ranks, trainers, requeued = _job()
    with ranks[1].in_flight():
        ranks[1].defer("asked.ckpt", weights_only=True)
        assert ranks[1].skips(SAVE_CHECKPOINT_BARRIER), "the barrier after the deferred save must not wait for peers"
    with ranks[3].in_flight():
        ranks[3].defer("other.ckpt", weights_only=False)  # the lowest rank that asked wins
        ranks[3].skip_barrier = False
    _boundary(ranks, trainers)
    assert [t.saved for t in trainers] == [[("asked.ckpt", True)]] * WORLD
    assert requeued == [0] * WORLD and not any(p.deferred for p in ranks)


def test_without_the_signal_no_collective_runs_and_each_rank_saves_what_it_asked():
    ranks, trainers, _ = _job(holding=False)
    for p in ranks:
        with p.in_flight():
            p.defer("every.ckpt", weights_only=False)
    assert _boundary(ranks, trainers) == 0
    assert [t.saved for t in trainers] == [[("every.ckpt", False)]] * WORLD


def test_no_boundary_inside_a_step_and_only_the_save_barrier_is_skipped():
    ranks, trainers, requeued = _job()
    ranks[0].received += 1
    with ranks[0].in_flight():
        ranks[0].boundary(trainers[0], lambda v: pytest.fail("exchanged inside a step"), None, WORLD, 0)
        ranks[0].defer("x.ckpt", False)
        assert not ranks[0].skips("some other barrier")
        ranks[0].defer("x.ckpt", False)
    assert not ranks[0].skips(SAVE_CHECKPOINT_BARRIER), "skipped a barrier outside a step"
    assert requeued == [0] * WORLD


def test_sigterm_on_one_rank_reaches_every_rank_at_the_boundary_after_the_requeue():
    ranks, trainers, requeued = _job()
    ranks[1].terms += 1
    assert _boundary(ranks, trainers) == 1
    assert [t.terms for t in trainers] == [1] * WORLD and requeued == [0] * WORLD
    ranks[0].received += 1
    ranks[3].terms += 1  # SLURM's SIGTERM after the requeue: looked for again right after it, one more exchange
    assert _boundary(ranks, trainers) == 2
    assert requeued == [1] * WORLD and [t.terms for t in trainers] == [1] * WORLD  # the same count: answered
    ranks[2].terms += 2
    _boundary(ranks, trainers)
    assert [t.terms for t in trainers] == [2] * WORLD


def test_sigterm_sent_during_the_requeue_is_answered_at_the_same_boundary():
    """``scontrol requeue`` makes SLURM send SIGTERM while the requeue handler runs: on one rank here. The exchange
    right after the requeue carries it to every rank, so all stop at this boundary, not one at the next."""
    ranks, trainers, requeued = _job()
    save = ranks[3].requeue

    def requeue_then_sigterm(signum, frame):
        save(signum, frame)
        ranks[3].terms += 1  # arrives on rank 3 only, after that rank's save

    ranks[3].requeue = requeue_then_sigterm
    ranks[1].received += 1
    assert _boundary(ranks, trainers) == 2
    assert requeued == [1] * WORLD
    assert [t.terms for t in trainers] == [1] * WORLD, "a SIGTERM sent during the requeue waited for the next boundary"


def test_between_validation_batches_only_sigterm_is_answered():
    ranks, trainers, requeued = _job()
    ranks[0].received += 1
    with ranks[2].in_flight():
        ranks[2].defer("asked.ckpt", weights_only=False)
    ranks[2].terms += 1
    _boundary(ranks, trainers, saves=False)
    assert [t.terms for t in trainers] == [1] * WORLD
    assert requeued == [0] * WORLD and [t.saved for t in trainers] == [[]] * WORLD, "saved inside a validation run"
    _boundary(ranks, trainers)  # the validation run's end
    assert requeued == [1] * WORLD
    assert [t.saved for t in trainers] == [[("asked.ckpt", False), ("hpc_ckpt_1.ckpt", False)]] * WORLD


def test_release_gives_a_late_sigterm_to_lightnings_handler():
    ranks, trainers, _ = _job()
    ranks[0].terms += 1
    for p in ranks:
        p.release()
    assert [t.terms for t in trainers] == [1, 0, 0, 0]


def test_take_over_leaves_a_handler_of_the_users_alone():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        p = Preemption()
        p.take_over(signal.SIGUSR1)
        assert p.requeue is None and signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_sigterm_during_a_save_is_held_until_the_save_is_over():
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        p = Preemption()
        with p.saving() as held:
            os.kill(os.getpid(), signal.SIGTERM)
            assert got == [] and held == [signal.SIGTERM] and p.busy
        assert got == [signal.SIGTERM] and not p.busy
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_temporary_names_hold_no_checkpoint_number():
    """Lightning reads the digits after ``hpc_ckpt_`` (or ``ckpt_``) in every name of the folder, hidden ones too."""
    for name in ("hpc_ckpt_12.ckpt", "last.ckpt", "a%5Fb_c.ckpt", "epoch=0-step=3.ckpt"):
        tmp = temporary_name(Path("/x") / name).name
        assert "_" not in tmp and target_name(tmp) == name, (name, tmp)


def test_boundaries_after_an_optimizer_step_not_between_micro_batches():
    """With gradient accumulation only the batch that steps the optimizer ends at a boundary; inside fit, a validation
    batch is a boundary for SIGTERM only, and sanity checking is none."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_zeropp.preemption import Boundaries

    calls = []
    p = Preemption()
    hooks = Boundaries(lambda trainer, saves=True: calls.append(saves), p)
    fitting = SimpleNamespace(optimizers=[object()], state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False)
    hooks.on_train_batch_end(fitting, None, None, None, 0)  # a micro-batch that accumulated
    assert calls == []
    p.stepped = True
    hooks.on_train_batch_end(fitting, None, None, None, 1)
    assert calls == [True] and not p.stepped
    hooks.on_validation_batch_end(fitting, None, None, None, 0)
    hooks.on_validation_end(fitting, None)
    assert calls == [True, False, True]
    sanity = SimpleNamespace(**{**vars(fitting), "sanity_checking": True})
    hooks.on_validation_batch_end(sanity, None, None, None, 0)
    hooks.on_validation_end(sanity, None)
    testing = SimpleNamespace(optimizers=[], state=SimpleNamespace(fn=TrainerFn.TESTING), sanity_checking=False)
    hooks.on_test_batch_end(testing, None, None, None, 0)
    assert calls == [True, False, True, True]
