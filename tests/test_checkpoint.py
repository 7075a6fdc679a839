"""Checkpoints: exact resume (sharded and full), resume with quantization after an evaluation (no stale hpZ copy),
resume on another world size and back, consolidation into one ordinary file, interrupted saves, and mismatches."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import TINY, TinyLM
from lightning_zeropp.testing.workers import LossRecorder, save_inputs

pytestmark = [pytest.mark.multiprocess, pytest.mark.version_sensitive]

BATCH = 2
WIDER = TINY["n_embd"] + TINY["n_head"]  # a model that differs from TINY in width only
EXACT = dict(hpz_partition_size=2, quantize_weights=False, quantize_gradients=False)
# error feedback residuals and the stochastic rounding's call count must come back for a resume to continue exactly
FEEDBACK = dict(gradient_error_feedback=True, gradient_rounding="stochastic")
# ... and so must the weight deltas' node copies (the steps after the resume send deltas, as uninterrupted ones do)
DELTAS = dict(FEEDBACK, weight_deltas=True)
MODES = {
    "exact": EXACT,
    "quantized": {},
    "feedback": FEEDBACK,  # the residuals in the default 8 bits: int8 codes and fp32 block scales
    "feedback-fp32": dict(FEEDBACK, error_feedback_bits=32),
    "deltas": DELTAS,
}


class AdamWTinyLM(TinyLM):
    """TinyLM trained with AdamW: under the defaults on 2 nodes its second moment is corrected every step."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


MODELS = {"sgd": TinyLM, "adamw": AdamWTinyLM}


def _loaders(rank, world, data_path):
    x, y = torch.load(data_path, weights_only=True)
    train = DataLoader(TensorDataset(x[rank::world][: 2 * BATCH], y[rank::world][: 2 * BATCH]), batch_size=BATCH)
    every = DataLoader(TensorDataset(x[:8], y[:8]), batch_size=4)  # each rank evaluates the same 8 windows
    return train, every


class _SaveAtEpochEnd(Callback):
    """Saves where ModelCheckpoint would, inside the run: what the collectives keep across steps (weight deltas' node
    copies) still exists then; a run's teardown frees it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


def _trainer(world, strategy_kwargs, per_node, save_to=None, **kwargs):
    recorder = LossRecorder()
    strategy = ZeroPPStrategy(ranks_per_node=per_node, **strategy_kwargs)
    kwargs.setdefault("limit_val_batches", 1.0)
    callbacks = [recorder] if save_to is None else [recorder, _SaveAtEpochEnd(save_to)]
    trainer = lightning_trainer(world, strategy, callbacks=callbacks, use_distributed_sampler=False, **kwargs)
    return trainer, recorder


def _full_state(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ------------------------------------------------------------------------------------------------ exact resume
def _resume_worker(rank, world, init_path, data_path, ckpt, strategy_kwargs, evaluate_first, dropout, model="sgd"):
    TinyLM = MODELS[model]
    train, every = _loaders(rank, world, data_path)
    torch.manual_seed(rank)  # the same random streams (dropout) in both runs
    trainer, uninterrupted = _trainer(world, strategy_kwargs, 2, max_epochs=2)
    trainer.fit(TinyLM(init_path, dropout=dropout), train)

    torch.manual_seed(rank)
    in_run = strategy_kwargs.get("weight_deltas", False)
    trainer, first = _trainer(world, strategy_kwargs, 2, save_to=ckpt if in_run else None, max_epochs=1)
    trainer.fit(TinyLM(init_path, dropout=dropout), train)
    if not in_run:
        trainer.save_checkpoint(ckpt)

    torch.manual_seed(12345)  # a resumed job starts elsewhere: the checkpoint must bring the streams back
    trainer, resumed = _trainer(world, strategy_kwargs, 2, max_epochs=2)
    model = TinyLM(init_path, dropout=dropout)
    if evaluate_first:  # leaves hpZ secondary copies of the *initial* weights behind, unless they are dropped
        trainer.validate(model, every, verbose=False)
    trainer.fit(model, train, ckpt_path=ckpt)
    corrected = trainer.strategy.comms.moments is not None and model_corrected(trainer)
    return {
        "uninterrupted": uninterrupted.losses,
        "first": first.losses,
        "resumed": resumed.losses,
        "corrected": corrected,
    }


def model_corrected(trainer) -> bool:
    """Whether the run's correction corrected anything (read after the fit: its counter stays)."""
    return trainer.strategy.comms.moments.corrected > 0


@pytest.mark.parametrize(
    ("state_dict_type", "mode", "dropout"),
    [
        ("sharded", "exact", 0.1),
        ("full", "exact", 0.1),
        ("sharded", "quantized", 0.0),
        ("sharded", "feedback", 0.0),
        ("full", "feedback", 0.0),
        ("sharded", "feedback-fp32", 0.0),
        ("sharded", "deltas", 0.0),
        ("sharded", "adamw", 0.0),
        ("full", "adamw", 0.0),
    ],
    ids=[
        "sharded-dropout",
        "full-dropout",
        "sharded-quantized",
        "sharded-feedback",
        "full-feedback",
        "sharded-feedback-fp32",
        "sharded-deltas",
        "sharded-adamw-corrected",
        "full-adamw-corrected",
    ],
)
def test_resume_continues_exactly(tmp_path, state_dict_type, mode, dropout):
    """Every mode resumes bit for bit; AdamW under the defaults too, its second moment corrected at every step."""
    init_path, data_path, *_ = save_inputs(tmp_path, 4 * 2 * BATCH)
    model = "adamw" if mode == "adamw" else "sgd"
    kwargs = {**MODES.get(mode, {}), "state_dict_type": state_dict_type}
    ckpt = str(tmp_path / ("ckpt" if state_dict_type == "sharded" else "last.ckpt"))
    quantized = mode != "exact"
    results = spawn(_resume_worker, 4, init_path, data_path, ckpt, kwargs, quantized, dropout, model)
    for rank, r in enumerate(results):
        assert r["corrected"] == (model == "adamw"), (rank, r)
        assert r["first"] == r["uninterrupted"][:2], f"rank {rank}: the two runs started differently"
        continued = torch.tensor(r["resumed"])
        expected = torch.tensor(r["uninterrupted"][2:])
        assert len(r["resumed"]) == 2, f"rank {rank}: resumed for {len(r['resumed'])} steps"
        # bit-identical (as measured), quantized or not: the steps after resume see exactly the saved weights
        torch.testing.assert_close(continued, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------- another world size and back
def _save_on(rank, world, per_node, init_path, data_path, ckpt, steps, resume_from):
    train, every = _loaders(rank, world, data_path)
    trainer, _ = _trainer(world, EXACT, per_node, max_steps=steps)
    model = TinyLM(init_path)
    if resume_from is None:
        trainer.fit(model, train)
        loaded = None
    else:
        loaded_loss = trainer.validate(model, every, ckpt_path=resume_from, verbose=False)[0]["val/loss"]
        loaded = {"loss": loaded_loss, "state": {k: v.clone() for k, v in _full_state(model).items()}}
        trainer.fit(model, train, ckpt_path=resume_from)
    trainer.save_checkpoint(ckpt)
    loss = trainer.validate(model, every, verbose=False)[0]["val/loss"]
    return {"loaded": loaded, "saved_loss": loss, "saved_state": _full_state(model)}


@pytest.fixture(scope="module")
def cross_world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cross_world")
    init_path, data_path, *_ = save_inputs(tmp, 4 * 2 * BATCH)
    a, b, c = str(tmp / "a"), str(tmp / "b"), str(tmp / "c")
    on4 = spawn(_save_on, 4, 2, init_path, data_path, a, 2, None)  # 2 nodes x 2
    on2 = spawn(_save_on, 2, 2, init_path, data_path, b, 3, a)  # 1 node x 2
    back = spawn(_save_on, 4, 2, init_path, data_path, c, 4, b)  # 2 nodes x 2 again
    return tmp, init_path, data_path, a, on4, on2, back


def test_resume_on_another_world_size_and_back(cross_world):
    _, _, _, _, on4, on2, back = cross_world
    for rank, r in enumerate(on2):
        # measured: equal (here and 2 -> 4); the slack is for a reduction order that differs with the world size
        assert r["loaded"]["loss"] == pytest.approx(on4[0]["saved_loss"], rel=1e-6), f"4 -> 2 ranks, rank {rank}"
    for name, value in on4[0]["saved_state"].items():
        assert torch.equal(on2[0]["loaded"]["state"][name], value), f"4 -> 2 ranks: {name} changed"
    for rank, r in enumerate(back):
        assert r["loaded"]["loss"] == pytest.approx(on2[0]["saved_loss"], rel=1e-6), f"2 -> 4 ranks, rank {rank}"
    assert on2[0]["saved_loss"] != on4[0]["saved_loss"]  # the 2-rank job trained on


def test_consolidate_to_one_ordinary_checkpoint(cross_world, capsys):
    tmp, init_path, data_path, sharded, on4, *_ = cross_world
    out = tmp / "consolidated.ckpt"
    cmd = [sys.executable, "-m", "lightning_zeropp.consolidate", sharded, str(out)]
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plain = torch.load(out, weights_only=False)
    for name, value in on4[0]["saved_state"].items():
        assert torch.equal(plain["state_dict"][name], value), name
    assert plain["global_step"] == 2 and "hyper_parameters" in plain

    model = TinyLM.load_from_checkpoint(out)  # one process, no strategy
    # SGD's momentum in the single-process layout: keyed by the index of each parameter (the tied weight counted
    # once) in the order configure_optimizers gives them, each of that parameter's shape, and not all zero
    optimizer = plain["optimizer_states"][0]
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert optimizer["param_groups"][0]["params"] == list(range(len(shapes)))
    momentum = optimizer["state"]
    assert sorted(momentum) == list(range(len(shapes))), sorted(momentum)
    for i, shape in enumerate(shapes):
        buffer = momentum[i]["momentum_buffer"]
        assert tuple(buffer.shape) == shape and buffer.abs().sum() > 0, f"parameter {i}: {tuple(buffer.shape)}"
    x, y = torch.load(data_path, weights_only=True)
    with torch.no_grad():
        loss = (model.loss((x[:4], y[:4])).item() + model.loss((x[4:8], y[4:8])).item()) / 2
    assert loss == pytest.approx(on4[0]["saved_loss"], rel=1e-6)  # measured: 5e-8 (one process, other order)

    # a folder that is no checkpoint: exit status 2 and the reason (the command's main, in this process: the command
    # itself ran above)
    from lightning_zeropp.consolidate import main

    assert main([str(tmp), str(tmp / "x.ckpt")]) == 2
    assert "not a sharded checkpoint folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------ interrupted saves and mismatches
def _interrupted_worker(rank, world, init_path, data_path, tmp):
    train, _ = _loaders(rank, world, data_path)
    report = {}
    for kind in ("sharded", "full"):
        path = Path(tmp) / ("ckpt" if kind == "sharded" else "last.ckpt")
        trainer, _ = _trainer(world, {**EXACT, "state_dict_type": kind}, 2, max_steps=1)
        model = TinyLM(init_path)
        trainer.fit(model, train)
        trainer.save_checkpoint(path)
        saved = {k: v.clone() for k, v in _full_state(model).items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the weights a failed save would have written

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        original = (FileSystemWriter.write_data, trainer.strategy.checkpoint_io.save_checkpoint)
        if kind == "sharded" and rank == 1:
            FileSystemWriter.write_data = full_disk  # one rank's disk fills up mid-save
        if kind == "full":
            trainer.strategy.checkpoint_io.save_checkpoint = lambda c, p, storage_options=None: (
                Path(p).write_bytes(b"half a checkpoint"),
                full_disk(),
            )
        try:
            trainer.save_checkpoint(path)
            report[kind] = "no error"
        except Exception as err:
            report[kind] = f"{type(err).__name__}: {err}"
        finally:
            FileSystemWriter.write_data, trainer.strategy.checkpoint_io.save_checkpoint = original
        fresh = TinyLM(init_path)
        trainer2, _ = _trainer(world, {**EXACT, "state_dict_type": kind}, 2, max_steps=1)
        trainer2.validate(fresh, _loaders(rank, world, data_path)[1], ckpt_path=path, verbose=False)
        restored = _full_state(fresh)
        report[f"{kind}_intact"] = all(torch.equal(restored[k], v) for k, v in saved.items())
        report[f"{kind}_leftovers"] = sorted(p.name for p in Path(tmp).iterdir() if "partial" in p.name)
    return report


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    init_path, data_path, *_ = save_inputs(tmp_path, 2 * 2 * BATCH)
    for r in spawn(_interrupted_worker, 2, init_path, data_path, str(tmp_path)):
        # every rank refuses, and says which rank failed and why (rank 1's disk for the sharded save, rank 0 writes
        # the full file)
        assert re.search(
            r"saving the checkpoint .*ckpt failed.*rank 1: OSError: \[Errno 28\] No space left", r["sharded"]
        ), r
        assert "FrameSummary" not in r["sharded"] and "tuple" not in r["sharded"], r["sharded"]  # DCP's (error, stack)
        assert re.search(r"saving the checkpoint .*last\.ckpt failed on rank 0.*No space left", r["full"]), r
        assert r["sharded_intact"] and r["full_intact"], r
        assert r["sharded_leftovers"] == [] and r["full_leftovers"] == [], r


def _mismatch_worker(rank, world, init_path, data_path, tmp):
    train, every = _loaders(rank, world, data_path)
    tmp = Path(tmp)
    trainer, _ = _trainer(world, EXACT, 2, max_steps=1)
    trained = TinyLM(init_path)
    trainer.fit(trained, train)
    trainer.save_checkpoint(tmp / "good")
    saved = {k: v.clone() for k, v in _full_state(trained).items()}
    if rank == 0:
        shutil.copytree(tmp / "good", tmp / "no_meta")
        (tmp / "no_meta" / "meta.pt").unlink()
        shutil.copytree(tmp / "good", tmp / "truncated")
        for shard in (tmp / "truncated").glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[:100])
        (tmp / "garbage.ckpt").write_bytes(b"not a checkpoint")
    trainer.strategy.barrier()
    cases = {
        "good": (TinyLM(init_path), tmp / "good"),  # the control: the same harness loads an intact checkpoint
        "wider model": (TinyLM(init_path=None, n_embd=WIDER), tmp / "good"),
        "no meta": (TinyLM(init_path), tmp / "no_meta"),
        "truncated": (TinyLM(init_path), tmp / "truncated"),
        "garbage": (TinyLM(init_path), tmp / "garbage.ckpt"),
        "absent": (TinyLM(init_path), tmp / "absent"),
    }
    report = {}
    for name, (model, path) in cases.items():
        t, _ = _trainer(world, EXACT, 2, max_steps=1)
        try:
            t.validate(model, every, ckpt_path=path, verbose=False)
            report[name] = "no error"
        except Exception as err:
            report[name] = f"{type(err).__name__}: {err}"
        if name == "good":
            loaded = _full_state(model)
            report["good loaded the saved weights"] = all(torch.equal(loaded[k], v) for k, v in saved.items())
    return report


def _reshaped(wider: int) -> list[str]:
    """What the error must list for a model ``wider`` than TINY: every tensor whose shape depends on the width."""
    narrow, wide = TinyLM(), TinyLM(n_embd=wider)
    narrow.configure_model()
    wide.configure_model()
    theirs = wide.state_dict()
    return sorted(
        f"{k}: checkpoint {list(v.shape)} vs model {list(theirs[k].shape)}"
        for k, v in narrow.state_dict().items()
        if v.shape != theirs[k].shape
    )


def test_mismatched_or_damaged_checkpoints_are_refused(tmp_path):
    init_path, data_path, *_ = save_inputs(tmp_path, 2 * 2 * BATCH)
    reshaped = _reshaped(WIDER)
    assert len(reshaped) > 8  # the message lists the first 8 and the count
    expected = {
        "good": "^no error$",
        "wider model": r"CheckpointMismatchError: .*does not fit this model; shape differs: "
        + re.escape(", ".join(reshaped[:8]) + f", ... ({len(reshaped)} in all).")
        + "$",
        "no meta": r"CheckpointMismatchError: .*not a complete sharded checkpoint: it has no meta\.pt",
        "truncated": r"CheckpointMismatchError: .*checkpoint .*truncated is damaged: shard file __\d+_\d+\.distcp is"
        r" truncated \(100 bytes; its index needs \d+\)",
        "garbage": r"CheckpointMismatchError: .*garbage\.ckpt is not a readable checkpoint file",
        "absent": r"FileNotFoundError: .*absent does not exist",
    }
    for rank, report in enumerate(spawn(_mismatch_worker, 2, init_path, data_path, str(tmp_path))):
        for name, pattern in expected.items():
            assert re.search(pattern, report[name], re.S), f"rank {rank}, {name}: {report[name]}"
        assert report["good loaded the saved weights"], f"rank {rank}"
