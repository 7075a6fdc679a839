"""Checkpoint errors a person reads in one line: the cause first, before any traceback.

Resuming with another optimizer than the checkpoint's names the missing and unexpected state and the likely cause;
a truncated or missing shard file is named; a failing save of ``torch.distributed.checkpoint`` is unpacked per
rank into ``Type: message`` (torch gives ``(exception, stack)`` pairs).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp import checkpoint as ckpt
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import TinyLM, make_batches

pytestmark = pytest.mark.version_sensitive


class OneRank:
    world_size = 1
    global_rank = 0
    is_global_zero = True

    def broadcast(self, obj, src=0):
        return obj


def test_dcp_failures_read_as_type_and_message():
    import traceback

    stack = traceback.extract_stack()
    err = CheckpointException("save", {0: (OSError(28, "No space left on device"), stack), 1: ValueError("bad")})
    text = ckpt.describe_failures(err)
    assert text == "rank 0: OSError: [Errno 28] No space left on device; rank 1: ValueError: bad", text
    alike = CheckpointException("load", {r: (RuntimeError("Missing key in checkpoint: x"), stack) for r in range(4)})
    assert ckpt.describe_failures(alike) == "ranks 0, 1, 2, 3: RuntimeError: Missing key in checkpoint: x"
    assert ckpt.describe_failures(RuntimeError("plain")) == "RuntimeError: plain"


def test_a_full_disk_during_a_sharded_save_reads_as_the_cause(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    checkpoint = {"state_dict": {"w": torch.ones(3)}, "pytorch-lightning_version": "2.6.0"}
    with pytest.warns(UserWarning), pytest.raises(RuntimeError) as failed:  # DCP warns: no process group
        ckpt.save(OneRank(), checkpoint, tmp_path / "last.ckpt", "sharded", torch.save)
    first = str(failed.value).splitlines()[0]
    assert first.startswith(f"ZeroPPStrategy: saving the checkpoint {tmp_path / 'last.ckpt'} failed (rank 0: OSError:")
    assert "[Errno 28] No space left on device" in first and "tuple" not in first and "FrameSummary" not in first
    assert list(tmp_path.iterdir()) == []  # the temporary is gone


def _full_file(path: Path, optimizer_states: list) -> tuple[torch.nn.Module, dict]:
    model = torch.nn.Linear(3, 2)
    torch.save({"state_dict": model.state_dict(), "optimizer_states": optimizer_states}, path)
    return model, {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_optimizer_checks_of_a_full_file(tmp_path):
    model, shapes = _full_file(tmp_path / "weights.ckpt", [])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expected = [("SGD", ckpt.optimizer_keys(model, [sgd])[0])]
    ckpt.check_compatible(tmp_path / "weights.ckpt", shapes, True, [])  # validate: no optimizer to restore
    with pytest.raises(ckpt.CheckpointMismatchError, match="holds no optimizer state .saved with weights_only"):
        ckpt.check_compatible(tmp_path / "weights.ckpt", shapes, True, expected)
    # a file from an older torch, whose param groups lack a newer setting: the load fills it in, so it fits
    older = sgd.state_dict()
    del older["param_groups"][0]["fused"]
    _full_file(tmp_path / "older.ckpt", [older])
    ckpt.check_compatible(tmp_path / "older.ckpt", shapes, True, expected)
    two_groups = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1, momentum=0.9)
    with pytest.raises(ckpt.CheckpointMismatchError) as refused:
        ckpt.check_compatible(
            tmp_path / "older.ckpt", shapes, True, [("SGD", ckpt.optimizer_keys(model, [two_groups])[0])]
        )
    assert "param groups: 1 in the checkpoint, 2 here" in str(refused.value).splitlines()[0]
    with pytest.raises(ckpt.CheckpointMismatchError, match="holds the state of 1 optimizer.s.; this run has 2"):
        ckpt.check_compatible(tmp_path / "older.ckpt", shapes, True, expected * 2)


def test_full_file_optimizer_state_keyed_by_index_fits(tmp_path):
    """An ordinary (or consolidated) checkpoint keys optimizer state by parameter index, the job by name: the same
    optimizer fits; another one does not."""
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    sgd.step()
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [sgd.state_dict()]}, path)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ckpt.check_compatible(path, shapes, True, [("SGD", ckpt.optimizer_keys(model, [sgd])[0])])
    model.zero_grad(set_to_none=True)  # as on resume: a fresh optimizer's state is then made as by a first step
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ckpt.CheckpointMismatchError) as refused:
        ckpt.check_compatible(path, shapes, True, [("AdamW", ckpt.optimizer_keys(model, [adamw])[0])])
    first = str(refused.value).splitlines()[0]
    assert "optimizer 0's state" in first and "AdamW" in first and "exp_avg" in first and "momentum_buffer" in first


class AdamLM(TinyLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TwoGroupLM(TinyLM):
    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        other = [p for n, p in self.named_parameters() if p.ndim < 2]
        return torch.optim.SGD([{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=0.1, momentum=0.9)


def _worker(rank: int, world: int, tmp: str) -> dict:
    tmp = Path(tmp)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*make_batches(8)), batch_size=2)
    report = {}
    for kind in ("sharded", "full"):
        path = tmp / f"{kind}.ckpt"
        trainer = lightning_trainer(world, ZeroPPStrategy(ranks_per_node=1, state_dict_type=kind), max_steps=1)
        trainer.fit(TinyLM(), loader)  # SGD with momentum
        trainer.save_checkpoint(path)
        for name, cls in (("adamw", AdamLM), ("groups", TwoGroupLM)):
            trainer = lightning_trainer(world, ZeroPPStrategy(ranks_per_node=1, state_dict_type=kind), max_steps=2)
            try:
                trainer.fit(cls(), loader, ckpt_path=path)
                report[f"{kind}_{name}"] = "resumed"
            except Exception as err:
                report[f"{kind}_{name}"] = f"{type(err).__name__}: {err}"
    damaged = tmp / "damaged.ckpt"
    if rank == 0:
        shutil.copytree(tmp / "sharded.ckpt", damaged)
        shard = sorted(damaged.glob("*.distcp"))[-1]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    torch.distributed.barrier()  # the group of the runs above: rank 0 has damaged the copy
    trainer = lightning_trainer(world, ZeroPPStrategy(ranks_per_node=1), max_steps=2)
    try:
        trainer.fit(TinyLM(), loader, ckpt_path=damaged)
        report["truncated"] = "resumed"
    except Exception as err:
        report["truncated"] = f"{type(err).__name__}: {err}"
    return report


@pytest.mark.multiprocess
def test_resume_errors_name_the_cause_first(tmp_path):
    for rank, report in enumerate(spawn(_worker, 2, str(tmp_path), timeout=300)):
        for kind in ("sharded", "full"):
            first = report[f"{kind}_adamw"].splitlines()[0]
            assert first.startswith("CheckpointMismatchError: ZeroPPStrategy: optimizer 0's state"), (rank, first)
            assert "AdamW" in first and "missing" in first and "exp_avg" in first and "another optimizer" in first
            assert "unexpected" in first and "momentum_buffer" in first, first
            assert len(report[f"{kind}_adamw"]) < 1200, len(report[f"{kind}_adamw"])
            first = report[f"{kind}_groups"].splitlines()[0]
            assert "param groups: 1 in the checkpoint, 2 here" in first, (rank, first)
        first = report["truncated"].splitlines()[0]
        assert "CheckpointMismatchError" in first and ".distcp is truncated" in first, (rank, first)


def _in_unprivileged_child(fn) -> str:
    """Runs ``fn()`` in a forked child that cannot write root's files (as root: the child drops to nobody after the
    fork, every module already imported; otherwise the folder's mode denies it), and returns what it raised."""
    import os
    import traceback

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            fn()
            message = "no error"
        except BaseException as err:  # the child reports whatever was raised
            message = "".join(traceback.format_exception_only(type(err), err))
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    os.waitpid(pid, 0)
    return message


def test_full_save_into_a_folder_without_write_permission_names_it():
    """Lightning's atomic save swallows the PermissionError and writes nothing; the error still names the folder and
    the permission, not a missing temporary file."""
    import tempfile

    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_zeropp.checkpoint_files import save_full

    top = Path(tempfile.mkdtemp())  # in /tmp, which anyone may traverse (pytest's tmp_path is the owner's alone)
    folder = top / "read_only"
    folder.mkdir()
    top.chmod(0o755)
    folder.chmod(0o555)
    try:
        io = TorchCheckpointIO()
        io.save_checkpoint({"x": 1}, top / "warm.ckpt")  # imports what a save imports lazily, before the child forks
        (top / "warm.ckpt").unlink()
        message = _in_unprivileged_child(lambda: save_full({"x": 1}, folder / "x.ckpt", io.save_checkpoint))
        assert not list(folder.iterdir())
    finally:
        folder.chmod(0o755)
        shutil.rmtree(top)
    assert message.startswith("PermissionError: ZeroPPStrategy: cannot save the checkpoint"), message
    assert "no permission to create files in" in message and str(folder) in message, message
