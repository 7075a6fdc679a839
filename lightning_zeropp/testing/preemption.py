"""Requeue signals sent to the spawned ranks of a one-node SLURM job at chosen points of a step (used by
``tests/test_preemption.py``).

Every rank sets the ``SLURM_*`` variables ``srun -n4`` gives its tasks (Lightning then runs under
``SLURMEnvironment(auto_requeue=True)``), a fake ``scontrol`` on ``PATH`` records the requeue, and
:func:`preemption_worker` trains :class:`~lightning_zeropp.testing.models.TinyLM` three ways: without a signal (the
reference), with ``SIGUSR1`` raised inside a chosen point of a chosen step (:class:`Signals`), and resumed
(``ckpt_path=None``: under SLURM, Lightning picks the newest ``hpc_ckpt_N.ckpt``, as a requeued job does).

The data are one batch per epoch, chosen by the epoch (:class:`EpochBatch`): a resume continues with the right batch
at any step, with no data loader state to restore. :func:`killed_save_worker` and :func:`resume_worker` kill every
rank inside a requeue save and resume after it; :func:`srun_task` is one task of a real ``srun`` job step
(``python -m lightning_zeropp.testing.preemption ROOT INIT DATA STEPS PAUSE TIMEOUT``, ``tests/test_slurm.py``), and
:func:`srun_reference_worker` the same task on a spawned rank, never signalled (that test's reference).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.deltas import WeightDeltas

from .models import TinyLM
from .workers import full_state

__all__ = [
    "CASES",
    "JOB_ID",
    "POINTS",
    "STEPS",
    "EpochBatch",
    "Signals",
    "fabric_save_in_step_worker",
    "fake_scontrol",
    "killed_save_worker",
    "preemption_worker",
    "resume_worker",
    "slurm_task_environment",
    "srun_reference_worker",
    "srun_task",
]

JOB_ID = "4242"
STEPS = 4
BATCH = 2
STRATEGY = dict(ranks_per_node=2, weight_deltas=True, weight_delta_refresh=2)
"""qwZ, hpZ and qgZ on, 4 ranks as 2 nodes x 2, weight deltas with an exact refresh every 2 steps: a resume at an
even step rebuilds the node copies exactly where the uninterrupted run does, so the two stay bit-identical."""

POINTS: dict[str, tuple[int, int]] = {
    "forward": (1, 2),
    "backward": (1, 2),
    "optimizer_step": (1, 2),
    "qgz_all_to_all": (1, 2),
    "weight_delta_exchange": (1, 2),
    "validation": (2, 2),  # validation runs after every second step; saved where it ends
    "checkpoint_save": (2, 2),  # inside ModelCheckpoint's save after step 2; saved right after it
    "last_step": (3, 4),
}
"""Where ``SIGUSR1`` arrives: (the global step during which it arrives, the step boundary that must be saved). Even
ranks get it there; odd ranks a late copy at the point's next occurrence (as when SLURM's signal reaches the tasks
at different moments), except at the qgZ point, which rank 3 alone gets."""

CASES: dict[str, tuple[int, int]] = {
    **POINTS,
    # rank 1 alone calls trainer.save_checkpoint inside backward (as a signal handler of the user's would): the save
    # waits for the boundary, where the request is broadcast and every rank saves
    "save_in_step": (1, 2),
    # SIGUSR1 in the forward of step 1, then SIGTERM inside the requeue save on every rank: the save completes, then
    # the run stops at the end of that batch and says what happened
    "sigterm_during_save": (1, 2),
}
_EVERY_SECOND_STEP = ("validation", "checkpoint_save")


def slurm_task_environment(rank: int, world_size: int) -> dict[str, str]:
    """The variables ``srun -n{world_size}`` sets for task ``rank`` of a one-node job."""
    return {
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NAME": "zeropp-preemption",
        "SLURM_NTASKS": str(world_size),
        "SLURM_NTASKS_PER_NODE": str(world_size),
        "SLURM_NNODES": "1",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
    }


def fake_scontrol(folder: Path) -> Path:
    """Writes an executable ``scontrol`` into ``folder`` that appends its arguments to ``$SCONTROL_LOG``."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "scontrol"
    script.write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


class EpochBatch(Sampler[int]):
    """Yields the indices of batch ``epoch`` (wrapping around): one batch per epoch, chosen by the epoch Lightning
    sets, so a resumed run continues with the batch the uninterrupted run used."""

    def __init__(self, n_samples: int, batch_size: int) -> None:
        self.n_samples, self.batch_size, self.epoch = n_samples, batch_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        start = self.epoch * self.batch_size
        return iter([(start + i) % self.n_samples for i in range(self.batch_size)])

    def __len__(self) -> int:
        return self.batch_size


def raise_signal(signum: int) -> Callable[[Trainer], None]:
    def send(trainer: Trainer) -> None:
        os.kill(os.getpid(), signum)  # its handler runs before the next line of Python does

    return send


class Signals(Callback):
    """At each planned point (``{point: (global step, action)}``) runs the action once, inside the point:
    ``forward``, ``last_step`` and ``validation`` (a forward pre-hook of the second block), ``backward`` (its backward
    pre-hook), ``optimizer_step`` (the optimizer's step pre-hook), ``qgz_all_to_all`` (right after qgZ starts an
    asynchronous all-to-all), ``weight_delta_exchange`` (as the deltas are exchanged), ``checkpoint_save`` (as
    ``torch.distributed.checkpoint.save`` starts writing)."""

    def __init__(self, schedule: dict[str, tuple[int | None, Callable[[Trainer], None]]]) -> None:
        self.schedule = schedule
        self.done: dict[str, int] = {}  # point: the global step at which its action ran
        self.trainer: Trainer | None = None
        self._undo: list[Callable[[], None]] = []

    def fire(self, point: str) -> None:
        trainer = self.trainer
        if point not in self.schedule or point in self.done or trainer is None:
            return
        at, action = self.schedule[point]
        if trainer.global_step != at:
            return
        self.done[point] = trainer.global_step
        action(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: TinyLM) -> None:
        self.trainer = trainer
        block = pl_module.net.blocks[1]
        hooks = [
            block.register_forward_pre_hook(lambda m, a: self.fire(self._forward_point())),
            block.register_full_backward_pre_hook(lambda m, g: self.fire("backward")),
            trainer.optimizers[0].register_step_pre_hook(lambda o, a, k: self.fire("optimizer_step")),
        ]
        self._undo += [h.remove for h in hooks]
        self._patch(dist, "all_to_all_single", self._after_async_all_to_all)
        self._patch(WeightDeltas, "_exchange", self._before_delta_exchange)
        self._patch(dcp, "save", self._before_save)

    def _forward_point(self) -> str:
        assert self.trainer is not None
        if torch.is_grad_enabled():
            return "forward" if self.trainer.global_step < STEPS - 1 else "last_step"
        return "validation" if self.trainer.validating else ""

    def _patch(self, owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, wrap(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def _after_async_all_to_all(self, original: Callable) -> Callable:
        def all_to_all_single(*args: Any, **kwargs: Any) -> Any:
            work = original(*args, **kwargs)
            if kwargs.get("async_op"):  # qgZ's hops: the signal arrives while the exchange is in flight
                self.fire("qgz_all_to_all")
            return work

        return all_to_all_single

    def _before_delta_exchange(self, original: Callable) -> Callable:
        def exchange(deltas: WeightDeltas, kind: str, *args: Any, **kwargs: Any) -> Any:
            if kind == "weight_delta_all_to_all":
                self.fire("weight_delta_exchange")
            return original(deltas, kind, *args, **kwargs)

        return exchange

    def _before_save(self, original: Callable) -> Callable:
        def save(*args: Any, **kwargs: Any) -> Any:
            self.fire("checkpoint_save")
            return original(*args, **kwargs)

        return save

    def undo(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def teardown(self, trainer: Trainer, pl_module: TinyLM, stage: str) -> None:
        self.undo()

    def on_exception(self, trainer: Trainer, pl_module: TinyLM, exception: BaseException) -> None:
        self.undo()


def schedule(case: str, rank: int, root: Path) -> dict[str, tuple[int | None, Callable[[Trainer], None]]]:
    """What :class:`Signals` does on ``rank`` for ``case`` (see :data:`POINTS` and :data:`CASES`)."""
    at, _ = CASES[case]
    usr1 = raise_signal(signal.SIGUSR1)
    if case == "save_in_step":
        return {"backward": (at if rank == 1 else None, lambda trainer: trainer.save_checkpoint(root / "asked.ckpt"))}
    if case == "sigterm_during_save":
        return {"forward": (at, usr1), "checkpoint_save": (at + 1, raise_signal(signal.SIGTERM))}
    if case == "qgz_all_to_all":
        return {case: (at if rank == 3 else None, usr1)}
    late = at + (2 if case in _EVERY_SECOND_STEP else 1)
    return {case: (late if rank % 2 else at, usr1)}


class BatchCount(Callback):
    """Counts the training batches a run trains (a resumed run: the steps after its checkpoint), and the global step
    training started from."""

    def __init__(self) -> None:
        self.batches = 0
        self.start: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: TinyLM) -> None:
        self.start = trainer.global_step

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1


@contextmanager
def _environment(values: dict[str, str]) -> Generator[None, None, None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fit(
    root: Path,
    init_path: str,
    data_path: str,
    rank: int,
    world: int,
    timeout_s: float,
    callbacks: list,
    strategy_kwargs: dict[str, Any] = STRATEGY,
    steps: int = STEPS,
    **fit: Any,
) -> dict[str, torch.Tensor]:
    """Trains TinyLM for ``steps`` steps (from a checkpoint: the rest) with ``default_root_dir=root``; returns its
    final weights."""
    x, y = torch.load(data_path, weights_only=True)
    local = TensorDataset(x[rank::world], y[rank::world])
    train = DataLoader(local, batch_size=BATCH, sampler=EpochBatch(len(local), BATCH))
    val = DataLoader(TensorDataset(x[:4], y[:4]), batch_size=4)
    strategy = ZeroPPStrategy(**strategy_kwargs, timeout=timedelta(seconds=timeout_s))
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=strategy,
        precision="32-true",
        max_steps=steps,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=2,
        limit_val_batches=1,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    torch.manual_seed(0)
    model = TinyLM(init_path)
    trainer.fit(model, train, val, **fit)  # ckpt_path=None: under SLURM, Lightning resumes from hpc_ckpt_N if any
    return full_state(model)


def preemption_worker(
    rank: int, world: int, out: str, bin_dir: str, init_path: str, data_path: str, cases: list[str], timeout_s: float
) -> dict[str, Any]:
    """The reference run, then for each case a run signalled as :func:`schedule` says and its resumed run. Returns rank
    0's final weights of each run; per case, on every rank: the global step each planned action ran at, the global
    step the resumed run started from, and the warnings of the signalled run and the resumed run."""
    env = slurm_task_environment(rank, world) | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    keep = (lambda state: state) if rank == 0 else (lambda state: None)
    with _environment(env):
        reference = _fit(Path(out, "reference"), init_path, data_path, rank, world, timeout_s, [])
        report: dict[str, Any] = {"reference": keep(reference), "cases": {}}
        for case in cases:
            root = Path(out, case)
            signals = Signals(schedule(case, rank, root))
            callbacks: list = [signals]
            if case == "checkpoint_save":
                callbacks.append(ModelCheckpoint(dirpath=root / "every2", every_n_train_steps=2, save_top_k=-1))
            result: dict[str, Any] = {"stopped": None}
            with _environment({"SCONTROL_LOG": str(root / "scontrol.log")}):
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    try:
                        result["signalled"] = keep(_fit(root, init_path, data_path, rank, world, timeout_s, callbacks))
                    except SIGTERMException as stop:
                        result["stopped"] = type(stop).__name__
                result["signalled_warnings"] = [str(w.message) for w in seen]
                count = BatchCount()
                resume = {"ckpt_path": str(root / "asked.ckpt")} if case == "save_in_step" else {}
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    resumed = _fit(root, init_path, data_path, rank, world, timeout_s, [count], **resume)
                result["resumed"] = keep(resumed)
                result["resumed_warnings"] = [str(w.message) for w in seen]
            result["resumed_from"] = STEPS - count.batches
            result["done"] = signals.done
            report["cases"][case] = result
    return report


def killed_save_worker(
    rank: int, world: int, out: str, bin_dir: str, init_path: str, data_path: str, timeout_s: float
) -> None:
    """Two requeue signals on every rank (in steps 1 and 3: saves at steps 2 and 4); the second requeue save is cut
    short: every rank is killed (SIGKILL, what SLURM sends when the grace period is over) right after writing its
    shards, before the save is complete. The process dies: nothing returns."""
    root = Path(out)
    kill = raise_signal(signal.SIGKILL)
    usr1 = raise_signal(signal.SIGUSR1)

    class AfterShards(Signals):
        def _before_save(self, original: Callable) -> Callable:
            def save(*args: Any, **kwargs: Any) -> Any:
                written = original(*args, **kwargs)
                self.fire("checkpoint_save")
                return written

            return save

    signals = AfterShards({"forward": (1, usr1), "backward": (3, usr1), "checkpoint_save": (4, kill)})
    env = slurm_task_environment(rank, world) | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    with _environment(env | {"SCONTROL_LOG": str(root / "scontrol.log")}):
        _fit(root, init_path, data_path, rank, world, timeout_s, [signals])


def resume_worker(
    rank: int, world: int, out: str, bin_dir: str, init_path: str, data_path: str, timeout_s: float
) -> dict[str, Any]:
    """Resumes as a requeued job does (``ckpt_path=None`` under SLURM); returns rank 0's final weights, the step the
    run resumed from and its warnings."""
    env = slurm_task_environment(rank, world) | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    count = BatchCount()
    with _environment(env | {"SCONTROL_LOG": str(Path(out, "scontrol.log"))}):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state = _fit(Path(out), init_path, data_path, rank, world, timeout_s, [count])
    return {
        "state": state if rank == 0 else None,
        "resumed_from": STEPS - count.batches,
        "warnings": [str(w.message) for w in seen],
    }


def fabric_save_in_step_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    """A Fabric loop whose optimizer's step pre-hook calls ``fabric.save`` (as a signal handler arriving then would):
    returns the error, and whether a save after the step (the loop's own) then works."""
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from lightning_zeropp.fabric import ZeroPPStrategy as FabricZeroPPStrategy

    from .models import make_batches

    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricZeroPPStrategy(), precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    model = TinyLM()
    model.configure_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_batches(2)
    state = {"model": model, "optimizer": optimizer}
    hook = optimizer.optimizer.register_step_pre_hook(lambda *a: fabric.save(Path(out, "in_step"), state))
    logits = model(x)
    fabric.backward(F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)))
    error = None
    try:
        optimizer.step()
    except RuntimeError as err:
        error = str(err)
    hook.remove()
    optimizer.step()  # the step the hook interrupted
    fabric.save(Path(out, "between_steps"), state)
    return {"error": error, "saved": sorted(p.name for p in Path(out).iterdir())}


# ----------------------------------------------------------------------------------------------- a real SLURM job
SLURM_STRATEGY = dict(ranks_per_node=2)
"""qwZ, hpZ and qgZ, 4 ranks as 2 nodes x 2: a resume at any step continues bit-identically (the signal of a real
job arrives whenever it does, so the saved step is not chosen)."""


class Pace(Callback):
    """Sleeps ``seconds`` inside every training forward (so that a signal sent from outside most likely arrives in the
    middle of a step), and writes the global step reached to ``progress`` (rank 0)."""

    def __init__(self, seconds: float, progress: Path) -> None:
        self.seconds, self.progress = seconds, progress
        self._hook: Any = None

    def on_train_start(self, trainer: Trainer, pl_module: TinyLM) -> None:
        def pause(module: Any, args: Any) -> None:
            if torch.is_grad_enabled():
                time.sleep(self.seconds)

        self._hook = pl_module.net.blocks[1].register_forward_pre_hook(pause)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self.progress.write_text(str(trainer.global_step))

    def teardown(self, trainer: Trainer, pl_module: TinyLM, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()


def srun_task(root: str, init_path: str, data_path: str, steps: int, pause_s: float, timeout_s: float) -> None:
    """One task of an ``srun`` job step: trains (resuming from the newest ``hpc_ckpt_N`` if any, as Lightning does
    under SLURM) and writes ``task{rank}-{restart}.json`` (the global step training started from, the batches it
    trained, whether SIGTERM stopped it) and, on rank 0 of a run that finished, ``final.pt``."""
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    out = Path(root)
    count = BatchCount()
    report: dict[str, Any] = {"stopped": False}
    try:
        state = _fit(
            out, init_path, data_path, rank, world, timeout_s, [count, Pace(pause_s, out / "progress")],
            strategy_kwargs=SLURM_STRATEGY, steps=steps,
        )  # fmt: skip
        if rank == 0:
            torch.save(state, out / "final.pt")
    except SIGTERMException:
        report["stopped"] = True
        raise
    finally:
        report.update(start=count.start, batches=count.batches)
        (out / f"task{rank}-{restart}.json").write_text(json.dumps(report))


def srun_reference_worker(
    rank: int, world: int, root: str, init_path: str, data_path: str, steps: int, timeout_s: float
) -> None:
    """:func:`srun_task` of a job never signalled, on a spawned rank with the variables ``srun`` would set: the
    uninterrupted run a requeued job must end equal to, without starting fresh interpreters for it."""
    with _environment(slurm_task_environment(rank, world)):
        srun_task(root, init_path, data_path, steps, 0, timeout_s)


if __name__ == "__main__":
    root_, init_, data_, steps_, pause_, timeout_ = sys.argv[1:7]
    srun_task(root_, init_, data_, int(steps_), float(pause_), float(timeout_))
