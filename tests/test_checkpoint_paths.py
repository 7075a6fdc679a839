"""A checkpoint path is never left empty, and a save replaces only a checkpoint.

A process saving onto a path that already holds a checkpoint is killed at every filesystem operation of the
sequence in turn (the temporary's write, the metadata, the exchange or the two renames, the removal of the old
copy), for both formats, with the exchange rename and with the two-rename fallback. After each kill, loading from
the path finds a complete checkpoint (the previous or the new one) and no leftover temporaries.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_zeropp import checkpoint as ckpt
from lightning_zeropp.compat.lightning import METADATA_FILENAME
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import TinyLM, make_batches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class OneRank:
    world_size = 1
    global_rank = 0
    is_global_zero = True

    def broadcast(self, obj, src=0):
        return obj


def _checkpoint(value: float) -> dict:
    return {
        "state_dict": {"w": torch.full((6,), value)},
        "optimizer_states": [],
        "pytorch-lightning_version": "2.6.0",
        "epoch": int(value),
    }


def _save(path: Path, kind: str, value: float) -> None:
    ckpt.save(OneRank(), _checkpoint(value), path, kind, lambda c, p: torch.save(c, p))


def _read(path: Path) -> float:
    def read(p: Path) -> dict:
        if p.is_dir():
            state = {"state_dict": {"w": torch.empty(6)}}
            dcp.load(state, checkpoint_id=p)
            return {**torch.load(p / METADATA_FILENAME, weights_only=False), **state}
        return torch.load(p, weights_only=False)

    loaded = ckpt.load(OneRank(), path, {"w": (6,)}, True, read)
    w = loaded["state_dict"]["w"]
    assert torch.equal(w, torch.full((6,), float(loaded["epoch"]))), "a torn checkpoint"
    return float(w[0])


class _Killer:
    """Counts the filesystem operations of a save and ends the process (``os._exit``) at operation ``k``."""

    def __init__(self, k: int) -> None:
        self.k, self.count = k, 0

    def wrap(self, fn):
        def op(*args, **kwargs):
            if self.count == self.k:
                os._exit(9)
            self.count += 1
            return fn(*args, **kwargs)

        return op


def _killed_save(path: Path, kind: str, k: int, fallback: bool) -> int:
    """Saves value 2.0 onto ``path`` in a forked child killed at operation ``k``; returns the child's exit code."""
    pid = os.fork()
    if pid == 0:  # the child: instrument, save, exit
        try:
            killer = _Killer(k)
            ckpt.exchange = (lambda a, b: False) if fallback else killer.wrap(ckpt.exchange)
            os.replace = killer.wrap(os.replace)
            ckpt.remove = killer.wrap(ckpt.remove)
            torch.save = killer.wrap(torch.save)
            dcp.save = killer.wrap(dcp.save)
            _save(path, kind, 2.0)
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_save_killed_at_any_point_leaves_a_checkpoint(tmp_path, kind, fallback):
    points = 0
    for k in range(20):
        folder = tmp_path / f"k{k}"
        folder.mkdir()
        path = folder / "last.ckpt"
        _save(path, kind, 1.0)
        code = _killed_save(path, kind, k, fallback)
        assert code in (0, 9), f"the save failed otherwise (exit {code})"
        value = _read(path)  # recovers first, then checks and reads
        assert value == (2.0 if code == 0 else value) and value in (1.0, 2.0), (k, value)
        assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"], (k, list(folder.iterdir()))
        if code == 0:
            assert value == 2.0
            break
        points += 1
    else:
        pytest.fail("the save never completed")
    # the writes (DCP's shards, the metadata), the swap (one exchange, or two renames), removing the previous copy
    assert points >= {"full": 2, "sharded": 4}[kind] + (1 if fallback and kind == "sharded" else 0), points


def test_between_the_two_renames_the_newer_complete_checkpoint_comes_back(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, "sharded", 1.0)
    assert _killed_save(path, "sharded", 4, fallback=True) == 9  # after the move aside, before the move in
    assert not path.exists()
    left = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert left == [".last.ckpt.old", ".last.ckpt.partial"], left
    assert _read(path) == 2.0


def test_incomplete_temporaries_are_removed_and_user_files_are_not(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, "sharded", 1.0)
    (tmp_path / ".last.ckpt.partial-0000beef").mkdir()  # a save killed while writing its shards
    (tmp_path / ".last.ckpt.partial-0000beef" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("mine")
    assert ckpt.recover(path) == ["removed .last.ckpt.partial-0000beef"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "notes.txt"]


def test_only_checkpoints_are_replaced(tmp_path):
    # a full save onto a folder of the user's
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(IsADirectoryError, match="not a checkpoint"):
        _save(notes, "full", 1.0)
    # a sharded save onto a non-empty folder that is not a checkpoint
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        _save(notes, "sharded", 1.0)
    assert (notes / "todo.txt").read_text() == "keep me" and len(list(tmp_path.iterdir())) == 1
    # a save onto a file that is not a checkpoint
    text = tmp_path / "model.ckpt"
    text.write_text("not a checkpoint")
    for kind in ("full", "sharded"):
        with pytest.raises(FileExistsError, match="not a Lightning checkpoint"):
            _save(text, kind, 1.0)
    assert text.read_text() == "not a checkpoint"
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain)  # a torch file, but not Lightning's
    with pytest.raises(FileExistsError):
        _save(plain, "sharded", 1.0)
    # switching formats replaces the other format's checkpoint; an empty folder is replaced
    switch = tmp_path / "last.ckpt"
    for kind, value in (("full", 1.0), ("sharded", 2.0), ("full", 3.0), ("sharded", 4.0)):
        _save(switch, kind, value)
        assert switch.is_dir() == (kind == "sharded") and _read(switch) == value
    empty = tmp_path / "empty"
    empty.mkdir()
    _save(empty, "full", 5.0)
    assert _read(empty) == 5.0


def test_checkpoint_files_are_recognised_without_unpickling(tmp_path):
    lightning = tmp_path / "a.ckpt"
    torch.save(_checkpoint(1.0), lightning)
    assert ckpt.is_checkpoint_file(lightning)
    evil = tmp_path / "b.ckpt"

    class Boom:
        def __reduce__(self):
            return (shutil.rmtree, (str(tmp_path / "victim"),))

    (tmp_path / "victim").mkdir()
    torch.save({"state_dict": {}, "x": Boom()}, evil)
    assert not ckpt.is_checkpoint_file(evil) and (tmp_path / "victim").is_dir()  # read as bytes, never executed
    (tmp_path / "c.ckpt").write_bytes(b"PK\x03\x04 broken")
    assert not ckpt.is_checkpoint_file(tmp_path / "c.ckpt")


# ----------------------------------------------------------------------------------------------- through the strategy
def _resume_worker(rank: int, world: int, tmp: str) -> dict:
    tmp = Path(tmp)
    data = torch.utils.data.TensorDataset(*make_batches(16))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    report = {}
    for kind in ("sharded", "full"):
        path, newer = tmp / f"{kind}.ckpt", tmp / f"{kind}-newer.ckpt"
        strategy = {"ranks_per_node": 1, "state_dict_type": kind}
        trainer = lightning_trainer(world, _strategy(strategy), max_steps=1)
        trainer.fit(TinyLM(), loader)
        trainer.save_checkpoint(path)
        trainer = lightning_trainer(world, _strategy(strategy), max_steps=2)
        trainer.fit(TinyLM(), loader, ckpt_path=path)
        trainer.save_checkpoint(newer)
        if rank == 0:  # exactly what a save killed between the two renames leaves
            os.replace(path, tmp / f".{path.name}.old-0000cafe")
            os.replace(newer, tmp / f".{path.name}.partial-0000f00d")
        trainer.strategy.barrier()
        trainer = lightning_trainer(world, _strategy(strategy), max_steps=3)
        model = TinyLM()
        trainer.fit(model, loader, ckpt_path=path)
        report[kind] = {
            "resumed_to": trainer.global_step,
            "left": sorted(p.name for p in tmp.iterdir() if kind in p.name),
        }
        notes = tmp / f"notes-{kind}"
        if rank == 0:
            notes.mkdir()
            (notes / "todo.txt").write_text("keep")
        trainer.strategy.barrier()
        try:
            trainer.save_checkpoint(notes)
            report[f"{kind}_onto_notes"] = "saved"
        except OSError as err:
            report[f"{kind}_onto_notes"] = type(err).__name__
        report[f"{kind}_notes_kept"] = (notes / "todo.txt").read_text() == "keep"
    return report


def _strategy(kwargs):
    from lightning_zeropp import ZeroPPStrategy

    return ZeroPPStrategy(**kwargs)


@pytest.mark.multiprocess
def test_resume_after_a_save_killed_between_the_renames(tmp_path):
    """2 ranks: the path is missing, the previous checkpoint sits at ``.old-*`` and the finished newer one at
    ``.partial-*``; ``fit(ckpt_path=path)`` puts the newer one back and resumes from its step (2 -> 3). A save onto a
    folder of notes is refused on every rank and keeps the notes."""
    for report in spawn(_resume_worker, 2, str(tmp_path), timeout=300):
        for kind in ("sharded", "full"):
            assert report[kind]["resumed_to"] == 3, report
            assert report[kind]["left"] == [f"{kind}.ckpt"], report
            assert report[f"{kind}_onto_notes"] == ("IsADirectoryError" if kind == "full" else "FileExistsError")
            assert report[f"{kind}_notes_kept"], report
