"""Checkpoints of 2-D models: tensor parallelism inside the node, ZeRO++ across the data-parallel dimension.

- 4 gloo ranks as 2 nodes x 2 with ``tensor_parallel_size=2`` under the defaults (qwZ INT8, qgZ INT4): a sharded
  folder and a full file saved by the Trainer after one epoch and resumed on the same mesh continue bit for bit as
  the uninterrupted run (every parameter, every AdamW moment and step count, every loss);
- another tensor-parallel size and node count: the sharded folder of t = 2 loads on t = 1 (the same 4 ranks), its full
  file on t = 1 on 1 node x 2, and the sharded folder of t = 1 on 2 nodes on t = 2 on 1 node (one data-parallel
  rank); every weight, AdamW moment and step count equals, tensor for tensor, the saving job's full state and the
  one-process consolidation of the folder;
- the consolidation command (``python -m lightning_zeropp.consolidate``; its ``main`` here) turns the 2-D folder into
  one ordinary file holding the full weights and AdamW state, which a plain model and optimizer load on one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from test_tensor_parallel import TensorParallelNet  # the same small net as the training tests
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.checkpoint import index_keyed
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.workers import LossRecorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.version_sensitive]  # passes on torch 2.9 too

WORLD, PER_NODE, BATCH, STEPS_PER_EPOCH = 4, 2, 2, 2


class TwoDimensional(LightningModule):
    """Tensor parallelism and ``fully_shard`` in ``configure_model`` when the mesh has a ``"tensor_parallel"``
    dimension; on a 1-D mesh (t = 1) the strategy shards the model itself. The same parameter names either way."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TensorParallelNet()

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        if "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
        for block in self.model.blocks:
            parallelize_module(block, mesh["tensor_parallel"], plan)
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(data_parallel: int) -> DataLoader:
    """``STEPS_PER_EPOCH`` batches per data-parallel rank and epoch (the Trainer's sampler splits them)."""
    generator = torch.Generator().manual_seed(1)
    n = STEPS_PER_EPOCH * BATCH * data_parallel
    data = TensorDataset(torch.randn(n, 16, generator=generator), torch.randn(n, 4, generator=generator))
    return DataLoader(data, batch_size=BATCH, shuffle=False)


def _cloned(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cloned(v) for v in state)
    return state


def full_states(trainer) -> dict[str, Any] | None:
    """The model's full weights and the optimizer's full state (keyed by parameter name), gathered on rank 0 across
    both mesh dimensions (collective; None on the other ranks). Copies: a full state holds the live tensors that are
    not sharded (AdamW's step counts), which the next steps change in place."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    strategy = trainer.strategy
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optimizer = get_state_dict(strategy.model, strategy.optimizers, options=options)
    if not strategy.is_global_zero:
        return None
    return _cloned({"model": model, "optimizer": optimizer, "global_step": trainer.global_step})


class _Loaded(Callback):
    """The full states once the checkpoint is restored, before the first step (read only after a restore: of an
    optimizer without state, ``get_state_dict`` creates it with a step of learning rate 0, counted by AdamW)."""

    def __init__(self) -> None:
        self.states: dict[str, Any] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.states = full_states(trainer)


class _Save(Callback):
    """Saves at the end of one epoch inside the run, where ModelCheckpoint would (so the uninterrupted run is also
    the first half of the interrupted one), and keeps the full states it saved."""

    def __init__(self, path: str, epoch: int) -> None:
        self.path, self.epoch = path, epoch
        self.states: dict[str, Any] | None = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            self.states = full_states(trainer)


def _fit(world: int, t: int, epochs: int, ckpt_path: str | None = None, save_to: str | None = None,
         save_after: int | None = None, **kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """``epochs`` epochs (from ``ckpt_path``, if given) of :class:`TwoDimensional` on ``world`` ranks in nodes of
    :data:`PER_NODE`, ``tensor_parallel_size=t`` and the defaults, saved to ``save_to`` after epoch ``save_after``
    (default: the last); the losses and the full states once loaded, as saved and at the end."""
    strategy = ZeroPPStrategy(tensor_parallel_size=t, ranks_per_node=PER_NODE, **kwargs)
    recorder, loaded, save = LossRecorder(), _Loaded(), _Save(str(save_to), (save_after or epochs) - 1)
    callbacks = [recorder] + ([loaded] if ckpt_path else []) + ([save] if save_to else [])
    trainer = lightning_trainer(world, strategy, max_epochs=epochs, callbacks=callbacks)
    trainer.fit(TwoDimensional(), _data(world // t), ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "loaded": loaded.states, "saved": save.states, "end": full_states(trainer)}


def _four_ranks_worker(rank: int, world: int, tmp: str) -> dict:
    """2 nodes x 2, t = 2: 2 epochs, a sharded checkpoint saved after the first, resumed from it; one epoch saved
    into a full file, resumed from it. t = 1 from the sharded checkpoint of t = 2, one more epoch, saved for the 2-rank
    job."""
    sharded, full, t1 = (str(Path(tmp) / name) for name in ("sharded", "full.ckpt", "t1"))
    return {
        "uninterrupted": _fit(world, 2, 2, save_to=sharded, save_after=1),
        "sharded_resumed": _fit(world, 2, 2, ckpt_path=sharded),
        "full_first": _fit(world, 2, 1, save_to=full, state_dict_type="full"),
        "full_resumed": _fit(world, 2, 2, ckpt_path=full, state_dict_type="full"),
        "t1": _fit(world, 1, 2, ckpt_path=sharded, save_to=t1),
    }


def _two_ranks_worker(rank: int, world: int, tmp: str) -> dict:
    """1 node x 2: t = 2 (one data-parallel rank) from the sharded checkpoint of t = 1 on 2 nodes, and t = 1 from the
    full file of t = 2 on 2 nodes; no step is taken (the checkpoints' last epoch is the run's last)."""
    return {
        "t1_to_t2": _fit(world, 2, 2, ckpt_path=str(Path(tmp) / "t1")),
        "t2_to_t1": _fit(world, 1, 1, ckpt_path=str(Path(tmp) / "full.ckpt"), state_dict_type="full"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tensor_parallel_checkpoint")
    four = spawn(_four_ranks_worker, WORLD, str(tmp), timeout=600)
    two = spawn(_two_ranks_worker, 2, str(tmp), timeout=600)
    return tmp, four, two


def differences(got: Any, want: Any, prefix: str = "") -> list[str]:
    """Where two nested states differ: each tensor compared bit for bit (dtype and shape included), each key."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{prefix}: {type(got).__name__}, not a dict"]
        if set(got) != set(want):
            return [f"{prefix}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"]
        return [d for k in want for d in differences(got[k], want[k], f"{prefix}.{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{prefix}: {got!r} vs {len(want)} items"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{prefix}.{i}")]
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        return [] if same else [prefix]
    return [] if got == want else [f"{prefix}: {got!r} vs {want!r}"]


def assert_same(got: Any, want: Any, what: str) -> None:
    found = differences(got, want)
    assert not found, f"{what}: {len(found)} differ: {found[:12]}"


@pytest.fixture(scope="module")
def consolidated(runs):
    """The sharded checkpoints of t = 2 and of t = 1 (both 2 nodes x 2) consolidated by the command's ``main``, each
    read in this one process: the references with no strategy and no process group."""
    from lightning_zeropp.consolidate import main

    tmp, *_ = runs
    plain = {}
    for name in ("sharded", "t1"):
        assert main([str(tmp / name), str(tmp / f"{name}.consolidated.ckpt")]) == 0
        plain[name] = torch.load(tmp / f"{name}.consolidated.ckpt", weights_only=False)
    return plain


def _plain_reference(plain: dict[str, Any]) -> dict[str, Any]:
    """A consolidated checkpoint in :func:`full_states`' form (the optimizer state keyed by parameter index)."""
    return {
        "model": plain["state_dict"],
        "optimizer": plain["optimizer_states"][0],
        "global_step": plain["global_step"],
    }


def _indexed(states: dict[str, Any]) -> dict[str, Any]:
    return {**states, "optimizer": index_keyed(states["optimizer"])}


# ------------------------------------------------------------------------------------------------ same mesh
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_resume_on_the_same_mesh_continues_exactly(runs, kind):
    """t = 2 on 2 nodes x 2 under the defaults: saved after one epoch, resumed for the second, every loss, weight,
    AdamW moment and step count bit-identical to the uninterrupted run's."""
    tmp, four, _ = runs
    first = "uninterrupted" if kind == "sharded" else "full_first"
    for rank, r in enumerate(four):
        if kind == "full":  # a run of its own for the first epoch (the sharded folder is saved inside the long run)
            assert r[first]["losses"] == r["uninterrupted"]["losses"][:STEPS_PER_EPOCH], rank
        assert r[f"{kind}_resumed"]["losses"] == r["uninterrupted"]["losses"][STEPS_PER_EPOCH:], rank
    saved, resumed, uninterrupted = four[0][first]["saved"], four[0][f"{kind}_resumed"], four[0]["uninterrupted"]
    assert saved["global_step"] == STEPS_PER_EPOCH and len(saved["model"]) == 16
    assert_same(resumed["loaded"], saved, "loaded")
    assert resumed["end"]["global_step"] == 2 * STEPS_PER_EPOCH
    assert_same(resumed["end"], uninterrupted["end"], "resumed vs uninterrupted")
    unmoved = [n for n, p in saved["model"].items() if torch.equal(p, uninterrupted["end"]["model"][n])]
    assert not unmoved, unmoved  # the second epoch changed every parameter: an unresumed run could not match
    if kind == "full":  # one ordinary file: every tensor whole, gathered over both mesh dimensions
        file = torch.load(tmp / "full.ckpt", weights_only=False)
        assert_same(file["state_dict"], saved["model"], "the file's weights")
        assert_same(file["optimizer_states"][0], index_keyed(saved["optimizer"]), "the file's AdamW state")


# ------------------------------------------------------------------------------------------------ another mesh
def test_checkpoints_of_tensor_parallel_two_load_on_tensor_parallel_one(runs, consolidated):
    """t = 2 on 2 nodes x 2 -> t = 1: the sharded folder on the same ranks, the full file on 1 node x 2. Every weight,
    AdamW moment and step count, and the step, as saved (the saving job's full state), and as the one-process
    consolidation of the folder holds them."""
    _, four, two = runs
    saved, reference = four[0]["uninterrupted"]["saved"], _plain_reference(consolidated["sharded"])
    assert_same(_indexed(saved), reference, "saved vs consolidated")
    assert_same(four[0]["full_first"]["saved"], saved, "the two first epochs")  # one run, saved in either format
    loads = {"sharded, 2 nodes x 2": four[0]["t1"]["loaded"], "full, 1 node x 2": two[0]["t2_to_t1"]["end"]}
    for where, loaded in loads.items():
        assert_same(loaded, saved, where)
        assert_same(_indexed(loaded), reference, f"{where} vs consolidated")
    unmoved = [n for n, p in four[0]["t1"]["saved"]["model"].items() if torch.equal(p, saved["model"][n])]
    assert not unmoved, unmoved  # t = 1 trained on: the next test loads a state no t = 2 job has held


def test_the_checkpoint_of_tensor_parallel_one_on_two_nodes_loads_on_tensor_parallel_two_on_one(runs, consolidated):
    """t = 1 on 2 nodes x 2 -> t = 2 on 1 node x 2 (one data-parallel rank), a sharded folder: the same checks."""
    _, four, two = runs
    saved, reference = four[0]["t1"]["saved"], _plain_reference(consolidated["t1"])
    assert saved["global_step"] == 2 * STEPS_PER_EPOCH
    assert_same(_indexed(saved), reference, "saved vs consolidated")
    assert_same(two[0]["t1_to_t2"]["end"], saved, "loaded")
    assert_same(_indexed(two[0]["t1_to_t2"]["end"]), reference, "loaded vs consolidated")


# ------------------------------------------------------------------------------------------------ consolidation
def test_consolidation_of_a_two_dimensional_folder_is_one_ordinary_checkpoint(runs, consolidated):
    """The file holds every tensor whole; a plain model and a plain AdamW on one process load it, each parameter
    and its moments as the saving job held them."""
    _, four, _ = runs
    plain, saved = consolidated["sharded"], four[0]["uninterrupted"]["saved"]
    assert_same(plain["state_dict"], saved["model"], "weights")
    module = TwoDimensional()
    module.load_state_dict(plain["state_dict"])  # strict: the names and global shapes of the unsharded model
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    optimizer.load_state_dict(plain["optimizer_states"][0])
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), saved["model"][name]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], saved["optimizer"]["state"][name][key]), (name, key)
    assert plain["global_step"] == STEPS_PER_EPOCH and "loops" in plain
