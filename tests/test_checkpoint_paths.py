"""A checkpoint path is never left empty, and a save replaces only a checkpoint.

A process saving onto a path that already holds a checkpoint is killed at every filesystem operation of the
sequence in turn (the temporary's write, the metadata, the exchange or the two renames, the removal of the old
copy), for both formats, with the exchange rename and with the two-rename fallback. After each kill, loading from
the path finds a complete checkpoint (the previous or the new one) and no leftover temporaries.
"""

from __future__ import annotations

import io
import os
import shutil
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback

from lightning_zeropp import checkpoint as ckpt
from lightning_zeropp import checkpoint_files as files
from lightning_zeropp.compat.lightning import METADATA_FILENAME
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import TinyLM, make_batches

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.version_sensitive]


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
    def read(p: Path, layout: ckpt.CheckpointKeys) -> dict:
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
    """Counts the filesystem operations of a save and ends the process (``os._exit``) at operation ``k``: before a
    rename or a removal, half-way through a write (half its bytes on disk)."""

    def __init__(self, k: int) -> None:
        self.k, self.count = k, 0

    def wrap(self, fn, torn: bool = False):
        def op(*args, **kwargs):
            if self.count == self.k:
                if torn and isinstance(args[1], (str, os.PathLike)):  # not DCP's own serialization to a buffer
                    data = io.BytesIO()
                    fn(args[0], data)
                    Path(args[1]).write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
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
            exchange = files.exchange

            def recorded_exchange(a, b):  # leaves a mark beside the folder when the exchange rename did the swap
                done = exchange(a, b)
                if done:
                    (path.parent.parent / f"{path.parent.name}.exchanged").touch()
                return done

            files.exchange = (lambda a, b: False) if fallback else killer.wrap(recorded_exchange)
            os.replace = killer.wrap(os.replace)
            files.remove = killer.wrap(files.remove)
            torch.save = killer.wrap(torch.save, torn=True)  # the metadata file, the full file
            dcp.save = killer.wrap(dcp.save)
            _save(path, kind, 2.0)
        except BaseException:
            traceback.print_exc()  # shown with the failing test
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("previous", [True, False], ids=["onto-a-checkpoint", "first-save"])
@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_save_killed_at_any_point_leaves_a_checkpoint(tmp_path, kind, fallback, previous):
    points = 0
    for k in range(30):
        folder = tmp_path / f"k{k}"
        folder.mkdir()
        path = folder / "last.ckpt"
        if previous:
            _save(path, kind, 1.0)
        code = _killed_save(path, kind, k, fallback)
        assert code in (0, 9), f"the save failed otherwise (exit {code})"
        try:
            value = _read(path)  # recovers first, then checks and reads
        except FileNotFoundError:  # a first save killed before its checkpoint was whole: nothing torn put in place
            value = None
        allowed = (2.0,) if code == 0 else (1.0, 2.0) if previous else (None, 2.0)
        assert value in allowed, (k, value)
        assert sorted(p.name for p in folder.iterdir()) == ([] if not path.exists() else ["last.ckpt"]), k
        if code == 0:
            # a folder replaced in the "exchange" cases was swapped by the exchange rename itself, not silently by the
            # fallback (a file is replaced by one plain rename either way)
            exchanged = (tmp_path / f"k{k}.exchanged").exists()
            swapped = kind == "sharded" and previous and not fallback
            assert exchanged == (swapped and files.exchange_available()), (k, exchanged)
            break
        points += 1
    else:
        pytest.fail("the save never completed")
    # the writes (DCP's shards, the metadata and its rename), the swap (one exchange, or two renames), removing the
    # previous copy
    expected = {"full": 1, "sharded": 3}[kind] + (1 + (fallback and kind == "sharded") if previous else 0)
    print(
        f"{kind}, {'two renames' if fallback else 'exchange'}, {'onto a checkpoint' if previous else 'first'}:"
        f" {points} kills"
    )
    assert points >= expected, points


def test_between_the_two_renames_the_newer_complete_checkpoint_comes_back(tmp_path):
    for k in range(30):  # the first point of the two-rename fallback at which the path is missing
        path = tmp_path / f"k{k}" / "last.ckpt"
        _save(path, "sharded", 1.0)
        assert _killed_save(path, "sharded", k, fallback=True) == 9, "the save completed: no such point"
        if not path.exists():
            break
    left = sorted(p.name.split("-")[0] for p in path.parent.iterdir())
    assert left == [".last.ckpt.old", ".last.ckpt.partial"], left  # after the move aside, before the move in
    assert _read(path) == 2.0 and [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_incomplete_temporaries_are_removed_and_user_files_are_not(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, "sharded", 1.0)
    (tmp_path / ".last.ckpt.partial-0000beef").mkdir()  # a save killed while writing its shards
    (tmp_path / ".last.ckpt.partial-0000beef" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("mine")
    assert files.recover(path) == ["removed .last.ckpt.partial-0000beef"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "notes.txt"]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_only_checkpoints_are_replaced(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    text = tmp_path / "model.ckpt"
    text.write_text("not a checkpoint")
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain)  # a torch file, but not Lightning's
    empty = tmp_path / "empty"
    empty.mkdir()
    mine = _tree(tmp_path)
    # a full save onto a folder that is not a checkpoint, even an empty one (as Lightning's ModelParallelStrategy)
    for folder in (notes, empty):
        with pytest.raises(IsADirectoryError, match=f"{folder} exists and is a directory that is not a checkpoint"):
            _save(folder, "full", 1.0)
    # a sharded save onto a folder of other files, or onto a file that is not a Lightning checkpoint
    with pytest.raises(FileExistsError, match=f"{notes} exists and is a folder of other files, not a checkpoint"):
        _save(notes, "sharded", 1.0)
    for file in (text, plain):
        for kind in ("full", "sharded"):
            with pytest.raises(
                FileExistsError, match=f"{file} exists and is a file that is not a Lightning checkpoint"
            ):
                _save(file, kind, 1.0)
    assert _tree(tmp_path) == mine and empty.is_dir()  # nothing written, nothing deleted
    # switching formats replaces the other format's checkpoint
    switch = tmp_path / "last.ckpt"
    for kind, value in (("full", 1.0), ("sharded", 2.0), ("full", 3.0), ("sharded", 4.0)):
        _save(switch, kind, value)
        assert switch.is_dir() == (kind == "sharded") and _read(switch) == value
    # a folder with Lightning's metadata file is a checkpoint; an empty folder takes a sharded one; an empty file any
    lightnings = tmp_path / "lightnings"
    lightnings.mkdir()
    (lightnings / METADATA_FILENAME).touch()
    _save(lightnings, "full", 5.0)
    _save(empty, "sharded", 6.0)
    (tmp_path / "touched.pt").touch()
    _save(tmp_path / "touched.pt", "sharded", 7.0)
    assert [_read(p) for p in (lightnings, empty, tmp_path / "touched.pt")] == [5.0, 6.0, 7.0]
    assert (notes / "todo.txt").read_text() == "keep me" and text.read_text() == "not a checkpoint"


def test_checkpoint_files_are_recognised_without_unpickling(tmp_path):
    lightning = tmp_path / "a.ckpt"
    torch.save(_checkpoint(1.0), lightning)
    assert files.is_checkpoint_file(lightning)
    evil = tmp_path / "b.ckpt"

    class Boom:
        def __reduce__(self):
            return (shutil.rmtree, (str(tmp_path / "victim"),))

    (tmp_path / "victim").mkdir()
    torch.save({"state_dict": {}, "x": Boom()}, evil)
    assert not files.is_checkpoint_file(evil) and (tmp_path / "victim").is_dir()  # read as bytes, never executed
    (tmp_path / "c.ckpt").write_bytes(b"PK\x03\x04 broken")
    assert not files.is_checkpoint_file(tmp_path / "c.ckpt")


# ----------------------------------------------------------------------------------------------- through the strategy
class _StartStep(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step  # after the checkpoint was restored


def _resume_worker(rank: int, world: int, tmp: str) -> dict:
    from lightning_zeropp import ZeroPPStrategy

    tmp = Path(tmp)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*make_batches(2 * world)), batch_size=2)
    path, newer = tmp / "last.ckpt", tmp / "newer.ckpt"  # sharded: replacing a folder takes two renames (fallback)
    trainer = lightning_trainer(world, ZeroPPStrategy(ranks_per_node=2), max_steps=1)
    trainer.fit(TinyLM(), loader)
    trainer.save_checkpoint(path)  # step 1
    trainer = lightning_trainer(world, ZeroPPStrategy(ranks_per_node=2), max_steps=2)
    trainer.fit(TinyLM(), loader, ckpt_path=path)
    trainer.save_checkpoint(newer)  # step 2
    if rank == 0:  # exactly what rank 0 killed between the two renames leaves
        os.replace(path, tmp / ".last.ckpt.old-0000cafe")
        os.replace(newer, tmp / ".last.ckpt.partial-0000f00d")
    trainer.strategy.barrier()
    start = _StartStep()
    trainer = lightning_trainer(world, ZeroPPStrategy(ranks_per_node=2), max_steps=3, callbacks=[start])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyLM(), loader, ckpt_path=path)
    notes = tmp / "notes"
    if rank == 0:
        notes.mkdir()
        (notes / "todo.txt").write_text("keep")
    trainer.strategy.barrier()
    try:
        trainer.save_checkpoint(notes)
        onto_notes = "saved"
    except OSError as err:
        onto_notes = f"{type(err).__name__}: {err}"
    return {
        "resumed_from": start.step,
        "left": sorted(p.name for p in tmp.iterdir() if path.name in p.name),  # the path and its temporaries
        "warned": [str(w.message) for w in caught if "interrupted" in str(w.message)],
        "onto_notes": onto_notes,
        "notes": _tree(notes),
    }


@pytest.mark.multiprocess
def test_resume_after_a_save_killed_between_the_renames(tmp_path):
    """4 ranks: the path is missing, the previous checkpoint (step 1) sits at ``.old-*`` and the finished newer one
    (step 2) at ``.partial-*``; ``fit(ckpt_path=path)`` puts the newer one back, with one warning, and resumes from
    step 2. A save onto a folder of notes is then refused on every rank and keeps the notes."""
    for rank, report in enumerate(spawn(_resume_worker, 4, str(tmp_path), timeout=300)):
        assert report["resumed_from"] == 2, (rank, report)
        assert report["left"] == ["last.ckpt"], (rank, report)
        warned = report["warned"]  # one warning, on rank 0 (the other ranks find the path repaired)
        expected = "restored last.ckpt from .last.ckpt.partial-0000f00d; removed .last.ckpt.old-0000cafe"
        assert len(warned) == (rank == 0) and all(expected in w for w in warned), (rank, warned)
        assert report["onto_notes"].startswith("FileExistsError: ZeroPPStrategy: the checkpoint path"), report
        assert report["notes"] == {"todo.txt": b"keep"}, report
