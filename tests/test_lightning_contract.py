"""Our contract with Lightning's Trainer: the scenarios of Lightning's own tests of ``ModelParallelStrategy``
(``tests/tests_pytorch/strategies/test_model_parallel.py`` and ``test_model_parallel_integration.py``), written for
:class:`lightning_zeropp.ZeroPPStrategy` on 2 CPU gloo ranks. Each test names its upstream scenario (1.x: the unit
tests, 2.x: the integration tests). Where we differ on purpose, the test asserts our behaviour
(docs/development.md, "Contract with Lightning").

All multi-process scenarios run in one spawn of 2 ranks (``trainer_results``), one after the other, each with its own
Trainer; each test then checks its scenario's results. The timeout scenario runs first: it creates the default group.

Not ported (upstream tests of what ZeroPPStrategy does not have):

- 1.1 ``test_torch_greater_equal_2_4``: patches a private version flag of Lightning; our own minimum versions fail at
  import (``lightning_zeropp/compat/versions.py``).

Ported to ``tests/test_tensor_parallel.py`` (4 ranks, ``tensor_parallel_size=2``, against ModelParallelStrategy
itself): 1.3 ``test_validate_device_mesh_dimensions`` (``data_parallel_size x tensor_parallel_size`` must equal the
world size) and 2.2 ``test_tensor_parallel`` (tensor parallelism).
"""

from __future__ import annotations

import inspect
import os
import re
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.testing.contract import (
    FeedForward,
    NonTensorMeta,
    assert_path_exists_contract,
    run_scenarios,
    save_onto_existing,
    scenario_outcome,
)
from lightning_zeropp.testing.distributed import lightning_trainer, spawn

pytestmark = pytest.mark.version_sensitive

WORLD = 2
TIMEOUT = timedelta(seconds=150)  # not torch's default (30 minutes): it bounds a hang of these tests too
EXACT = dict(quantize_weights=False, quantize_gradients=False)
PER_LINEAR = dict(auto_wrap_policy={nn.Linear})  # one unit per layer, as upstream's fully_shard(w1/w2/w3)
INITS = ("cpu_init", "meta_init", "meta_in_configure_model")
PRECISIONS = {"32-true": "torch.float32", "bf16-mixed": "torch.float32", "bf16-true": "torch.bfloat16",
              "16-true": "torch.float16"}  # fmt: skip


# ----------------------------------------------------------------------------------------------- models
class TemplateModel(LightningModule):
    """Upstream's ``TemplateModel``: built in ``__init__``, no ``configure_model`` (Lightning's strategy rejects it)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = FeedForward()

    def training_step(self, batch):
        return self.model(batch).sum()

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


class EmptyConfigureModel(TemplateModel):
    def configure_model(self) -> None:
        pass


def _on_mesh(p: torch.Tensor, mesh: DeviceMesh) -> bool:
    return isinstance(p, DTensor) and p.device_mesh == mesh and not p.is_meta


# ----------------------------------------------------------------------------------------------- scenarios
def _timeout(rank, world, tmp):
    """1.9: the timeout reaches the default group and every group of the strategy's own."""
    init_timeouts, group_timeouts = [], []
    init_process_group, new_group = dist.init_process_group, dist.new_group

    def recording_init(*args, **kwargs):
        init_timeouts.append(kwargs.get("timeout"))
        return init_process_group(*args, **kwargs)

    def recording_new_group(*args, **kwargs):
        caller = inspect.currentframe().f_back.f_globals["__name__"]
        group_timeouts.append((caller, kwargs.get("timeout")))
        return new_group(*args, **kwargs)

    initialized_before = dist.is_initialized()
    with (
        mock.patch.object(dist, "init_process_group", recording_init),
        mock.patch.object(dist, "new_group", recording_new_group),
    ):
        trainer = lightning_trainer(world, ZeroPPStrategy(timeout=TIMEOUT, **EXACT), max_steps=1)
        trainer.fit(TemplateModel())
    return {"initialized_before": initialized_before, "init": init_timeouts, "groups": group_timeouts}


def _fsdp1_refused(rank, world, tmp):
    """1.4: a model holding FSDP1 modules is refused at setup, before anything changes."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = TemplateModel()
    model.model.w1 = FullyShardedDataParallel(model.model.w1, device_id=torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    trainer = lightning_trainer(world, ZeroPPStrategy(), max_steps=1)
    try:
        trainer.fit(model)
    except TypeError as err:
        return {"error": str(err), "untouched": all(torch.equal(a, b) for a, b in zip(before, model.parameters()))}
    return {"error": None}


def _configure_model_not_required(rank, world, tmp):
    """1.5 (inverted): with no ``configure_model``, or an empty one, the strategy shards the model itself."""
    out = {}
    for name, cls in (("absent", TemplateModel), ("empty", EmptyConfigureModel)):
        model = cls()
        trainer = lightning_trainer(world, ZeroPPStrategy(), max_steps=1)
        trainer.fit(model)
        out[name] = {
            "global_step": trainer.global_step,
            "dtensors": {n: isinstance(p, DTensor) for n, p in model.named_parameters()},
        }
    return out


def _path_exists(rank, world, tmp):
    """1.7: what a save may replace, in both formats."""
    out = {}
    for kind in ("full", "sharded"):
        strategy = ZeroPPStrategy(state_dict_type=kind, **EXACT)
        trainer = lightning_trainer(world, strategy, max_steps=1, default_root_dir=tmp)
        trainer.fit(TemplateModel())
        out[kind] = save_onto_existing(trainer.save_checkpoint, tmp / kind, rank, trainer.strategy.barrier)
    return out


def _unknown_checkpoint_type(rank, world, tmp):
    """1.8: resuming from an empty folder is refused before anything is loaded."""
    (tmp / "empty_dir").mkdir(exist_ok=True)
    trainer = lightning_trainer(world, ZeroPPStrategy(**EXACT), max_steps=1)
    try:
        trainer.fit(TemplateModel(), ckpt_path=tmp / "empty_dir")
    except Exception as err:  # the type is part of what the test checks
        return {"type": type(err).__name__, "is_value_error": isinstance(err, ValueError), "message": str(err),
                "global_step": trainer.global_step}  # fmt: skip
    return {"type": None}


class NoResetParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class ResetParameters(NoResetParameters):
    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 2.0)


class MetaModel(LightningModule):
    """Upstream's ``CustomModel`` of ``test_meta_device_materialization``; ``layer_class`` may define
    ``reset_parameters``. The root's ``reset_parameters`` sets the buffer and overrides ``layer2``'s init."""

    def __init__(self, layer_class: type[nn.Module] = NoResetParameters) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(layer_class(), layer_class())
        self.layer2 = nn.Linear(4, 4)
        self.register_buffer("buffer", torch.rand(2))
        self.seen = None

    def reset_parameters(self) -> None:
        self.buffer.fill_(1.0)
        nn.init.constant_(self.layer2.weight, 0.5)

    def configure_model(self) -> None:
        pass

    def training_step(self, batch):
        return self.layer2(self.layer1(batch)).sum()

    def train_dataloader(self):
        return DataLoader(RandomDataset(4, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_train_start(self) -> None:
        tensors = dict(self.named_parameters())
        self.seen = {
            "meta": [n for n, t in [*tensors.items(), *self.named_buffers()] if t.is_meta],
            "values": {n: sorted(set(t.full_tensor().flatten().tolist())) for n, t in tensors.items() if "layer1" in n},
            "layer2.weight": sorted(set(self.layer2.weight.full_tensor().flatten().tolist())),
            "buffer": self.buffer.tolist(),
        }


def _meta_device_materialization(rank, world, tmp):
    """1.10: a model built on the meta device; a tensor no ``reset_parameters`` initializes is refused by name."""
    out = {}
    with torch.device("meta"):
        model = MetaModel()
    out["meta_before"] = [model.layer1[0].weight.is_meta, model.layer2.weight.is_meta, model.buffer.is_meta]
    trainer = lightning_trainer(world, ZeroPPStrategy(**EXACT), max_steps=1)
    try:
        trainer.fit(model)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    with torch.device("meta"):
        model = MetaModel(ResetParameters)
    trainer = lightning_trainer(world, ZeroPPStrategy(**EXACT), max_steps=1)
    trainer.fit(model)
    out["materialized"] = model.seen
    return out


class MeshProbe(BoringModel):
    def configure_model(self) -> None:
        mesh = self.device_mesh
        self.seen = {
            "is_mesh": isinstance(mesh, DeviceMesh),
            "device_type": mesh.device_type,
            "module_device_type": self.device.type,
            "names": mesh.mesh_dim_names,
            "ndim": mesh.ndim,
            "size0": mesh.size(0),
        }


def _device_mesh(rank, world, tmp):
    """2.1: ``self.device_mesh`` in ``configure_model``; one node of 2 ranks, and 2 nodes of 1."""
    out = {}
    for name, kwargs in (("one_node", {}), ("two_nodes", {"ranks_per_node": 1})):
        model = MeshProbe()
        trainer = lightning_trainer(world, ZeroPPStrategy(**kwargs), max_steps=1)
        trainer.fit(model)
        out[name] = {**model.seen, "global_step": trainer.global_step}
    return out


class ShardedProbe(TemplateModel):
    def on_train_start(self) -> None:
        mesh = self.trainer.strategy.device_mesh
        optimizer_params = self.optimizers(use_pl_optimizer=False).param_groups[0]["params"]
        loader = self.trainer.train_dataloader
        self.seen = {
            "mesh": (mesh.ndim, mesh.size(), mesh.mesh_dim_names),
            "params_on_mesh": {n: _on_mesh(p, mesh) for n, p in self.named_parameters()},
            "optimizer_on_mesh": [_on_mesh(p, mesh) for p in optimizer_params],
            "optimizer_holds_params": [id(p) for p in optimizer_params] == [id(p) for p in self.model.parameters()],
            "len_loader": len(loader),
            "distributed_sampler": isinstance(loader.sampler, DistributedSampler),
            "batches_differ": [],
        }

    def training_step(self, batch):
        batches = self.all_gather(batch)
        self.seen["batches_differ"].append(all(not torch.equal(batches[0], b) for b in batches[1:]))
        return super().training_step(batch)


def _fsdp2_meta_init(rank, world, tmp):
    """2.3 (without tensor parallelism): built on the meta device with no ``configure_model``, sharded on the 1-D
    mesh, the data split over the ranks."""
    seed_everything(0)
    trainer = lightning_trainer(world, ZeroPPStrategy(**PER_LINEAR), max_steps=2)
    with trainer.init_module(empty_init=True):
        model = ShardedProbe()
    meta_before = all(p.is_meta for p in model.parameters())
    trainer.fit(model)
    return {**model.seen, "meta_before": meta_before, "global_step": trainer.global_step}


class MetricsModel(TemplateModel):
    def __init__(self) -> None:
        from torchmetrics.classification import Accuracy

        super().__init__()
        self.metric = Accuracy("multiclass", num_classes=10)
        self.seen = {"init": self._metric_state()}

    def _metric_state(self):
        return self.metric.device.type, self.metric.tp.device.type, type(self.metric.tp).__name__

    def setup(self, stage: str) -> None:
        self.seen["setup"] = self._metric_state()

    def training_step(self, batch):
        self.seen.setdefault("step", []).append(self._metric_state())
        self.metric(torch.rand(2, 10, device=self.device), torch.randint(0, 10, size=(2,), device=self.device))
        return super().training_step(batch)

    def on_train_end(self) -> None:
        self.seen["counted"] = int(self.metric.tp.sum() + self.metric.fn.sum())
        self.seen["end"] = self._metric_state()


def _modules_without_parameters(rank, world, tmp):
    """2.4: a submodule without parameters but with tensor state (a TorchMetrics metric) survives sharding."""
    model = MetricsModel()
    trainer = lightning_trainer(world, ZeroPPStrategy(), max_epochs=1)
    trainer.fit(model)
    return {**model.seen, "global_step": trainer.global_step}


class InitProbe(TemplateModel):
    def on_train_start(self) -> None:
        w = self.model.w1.weight
        p = self.optimizers(use_pl_optimizer=False).param_groups[0]["params"][0]
        self.seen = (str(w.device), str(w.dtype), isinstance(w, DTensor), str(p.device), str(p.dtype))


class ConfigureModelProbe(InitProbe):
    """Its layers are built in ``configure_model``, on the meta device (the big-model path)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.built = None

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = FeedForward()
            self.built = (str(self.model.w1.weight.device), str(self.model.w1.weight.dtype))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def _module_init_context(rank, world, tmp):
    """2.5: ``trainer.init_module(empty_init=...)`` in every precision: on the CPU or the meta device with the
    precision's dtype before ``fit``; sharded on the CPU after (bf16-mixed: fp32 master weights throughout). Also a
    model whose ``configure_model`` builds its layers on the meta device."""
    out = {}
    for precision in PRECISIONS:
        for init in INITS:
            trainer = lightning_trainer(world, ZeroPPStrategy(**PER_LINEAR), precision=precision, max_steps=1)
            probe = ConfigureModelProbe if init == "meta_in_configure_model" else InitProbe
            with trainer.init_module(empty_init=init != "cpu_init"):
                model = probe()
            w1 = model.model.w1.weight if model.model is not None else None
            before = (str(w1.device), str(w1.dtype)) if w1 is not None else None
            trainer.fit(model)
            out[(precision, init)] = {"before": before or model.built, "after": model.seen}
    return out


def _strategy_state_dict(rank, world, tmp):
    """2.6: ``lightning_module_state_dict()`` has the unwrapped module's keys, in order."""
    out = {}
    for kind in ("sharded", "full"):
        model = TemplateModel()
        expected = list(model.state_dict())
        trainer = lightning_trainer(world, ZeroPPStrategy(state_dict_type=kind, **PER_LINEAR), max_epochs=1)
        trainer.fit(model)
        state_dict = trainer.strategy.lightning_module_state_dict()
        out[kind] = {"expected": expected, "keys": list(state_dict), "types": {type(v) for v in state_dict.values()}}
    return out


def _zeropp_to_ddp(rank, world, tmp):
    """2.7: our full checkpoint resumes under DDP, model and optimizer exactly."""
    model = TemplateModel()
    strategy = ZeroPPStrategy(state_dict_type="full", **PER_LINEAR, **EXACT)
    trainer = lightning_trainer(world, strategy, max_epochs=1, default_root_dir=tmp)
    trainer.fit(model)
    path = trainer.strategy.broadcast(tmp / "last.ckpt")
    trainer.save_checkpoint(path)
    saved = trainer.strategy.lightning_module_state_dict(), trainer.strategy.optimizer_state(model.optimizers())
    model = TemplateModel()
    trainer = lightning_trainer(world, "ddp", max_epochs=1, default_root_dir=tmp)
    trainer.fit(model, ckpt_path=path)
    restored = trainer.strategy.lightning_module_state_dict(), trainer.strategy.optimizer_state(model.optimizers())
    return {"saved": saved, "restored": restored}


def _full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v  # noqa: E731
    return {
        "state": {name: {k: full(v) for k, v in s.items()} for name, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def _ddp_to_zeropp(rank, world, tmp):
    """2.8: a DDP checkpoint resumes under ZeroPP, full and sharded mode alike."""
    model = TemplateModel()
    trainer = lightning_trainer(world, "ddp", max_epochs=1, default_root_dir=tmp)
    trainer.fit(model)
    path = trainer.strategy.broadcast(tmp / "last.ckpt")
    trainer.save_checkpoint(path)
    saved = trainer.strategy.lightning_module_state_dict(), trainer.strategy.optimizer_state(model.optimizers())
    out = {"saved": saved}
    for kind in ("full", "sharded"):
        model = TemplateModel()
        strategy = ZeroPPStrategy(state_dict_type=kind, **PER_LINEAR, **EXACT)
        trainer = lightning_trainer(world, strategy, max_epochs=1, default_root_dir=tmp)
        trainer.fit(model, ckpt_path=path)
        if kind == "full":
            restored = (
                trainer.strategy.lightning_module_state_dict(),
                trainer.strategy.optimizer_state(model.optimizers()),
            )
        else:
            weights = {k: v.full_tensor() for k, v in trainer.strategy.lightning_module_state_dict().items()}
            restored = weights, _full_optimizer_state(model, model.optimizers(use_pl_optimizer=False))
        out[kind] = restored
    return out


class CheckpointModel(TemplateModel):
    def __init__(self, params_to_compare=None) -> None:
        super().__init__()
        self.params_to_compare = params_to_compare
        self.compared = None

    def on_train_start(self) -> None:
        if self.params_to_compare is not None:
            pairs = zip(self.params_to_compare, self.trainer.model.parameters())
            self.compared = [torch.equal(p0, p1.full_tensor()) for p0, p1 in pairs]


def _save_load_sharded(rank, world, tmp):
    """2.9: the default ModelCheckpoint writes a sharded folder; a resume from it starts from the saved weights."""
    seed_everything(0)
    kwargs = dict(max_epochs=1, default_root_dir=tmp, enable_checkpointing=True)
    trainer = lightning_trainer(world, ZeroPPStrategy(**PER_LINEAR), **kwargs)
    trainer.fit(CheckpointModel())
    params_before = [p.full_tensor() for p in trainer.model.parameters()]
    path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    listing = sorted(os.listdir(path))
    siblings = sorted(os.listdir(path.parent))
    try:
        metadata = torch.load(path / "meta.pt", weights_only=True)
        safe = None
    except Exception as err:  # reported: the test says what failed
        metadata, safe = torch.load(path / "meta.pt", weights_only=False), f"{type(err).__name__}: {err}"
    model = CheckpointModel(params_to_compare=params_before)
    kwargs["max_epochs"] = 2
    trainer = lightning_trainer(world, ZeroPPStrategy(**PER_LINEAR), **kwargs)
    trainer.fit(model, ckpt_path=path)
    return {
        "listing": listing,
        "siblings": siblings,
        "name": path.name,
        "weights_only_error": safe,
        "metadata_keys": sorted(metadata),
        "callbacks": len(metadata.get("callbacks", [])),
        "compared": model.compared,
        "epochs": trainer.current_epoch,
    }


class MetaCallback(Callback):
    """A callback whose state holds an object that is not a tensor."""

    def __init__(self, meta=None) -> None:
        self.meta = meta

    def state_dict(self):
        return {"user_meta": self.meta}

    def load_state_dict(self, state_dict) -> None:
        self.meta = state_dict["user_meta"]


def _non_tensor_metadata(rank, world, tmp):
    """3.19 (Trainer): a callback's state holding a non-tensor object survives a sharded save and a resume, with
    ``weights_only=False`` and by default (as Lightning loads a sharded checkpoint's metadata)."""
    path = tmp / "ckpt"
    callback = MetaCallback(NonTensorMeta(42))
    trainer = lightning_trainer(world, ZeroPPStrategy(**EXACT), max_steps=1, callbacks=[callback])
    trainer.fit(TemplateModel())
    trainer.save_checkpoint(path)
    out = {}
    for case, kwargs in (("weights_only=False", {"weights_only": False}), ("default", {})):
        callback = MetaCallback()
        trainer = lightning_trainer(world, ZeroPPStrategy(**EXACT), max_steps=2, callbacks=[callback])
        try:
            trainer.fit(TemplateModel(), ckpt_path=path, **kwargs)
        except ValueError as err:
            out[case] = str(err).splitlines()[0]
            continue
        out[case] = {"type": type(callback.meta).__name__, "value": getattr(callback.meta, "value", None)}
    return out


SCENARIOS = {
    "1.9": _timeout,  # first: it creates the default process group
    "1.4": _fsdp1_refused,
    "1.5": _configure_model_not_required,
    "1.7": _path_exists,
    "1.8": _unknown_checkpoint_type,
    "1.10": _meta_device_materialization,
    "2.1": _device_mesh,
    "2.3": _fsdp2_meta_init,
    "2.4": _modules_without_parameters,
    "2.5": _module_init_context,
    "2.6": _strategy_state_dict,
    "2.7": _zeropp_to_ddp,
    "2.8": _ddp_to_zeropp,
    "2.9": _save_load_sharded,
    "3.19": _non_tensor_metadata,
}


def _worker(rank, world, tmp):
    return run_scenarios(SCENARIOS, rank, world, tmp)


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning_contract")
    return spawn(_worker, WORLD, str(tmp), timeout=600)


# ----------------------------------------------------------------------------------------------- no process group
def test_device_mesh_access_before_setup():
    """1.2"""
    with pytest.raises(RuntimeError, match="Accessing the device mesh .* not allowed"):
        ZeroPPStrategy().device_mesh  # noqa: B018


def test_save_checkpoint_storage_options(tmp_path):
    """1.6 (our text)"""
    with pytest.raises(TypeError, match=re.escape("ZeroPPStrategy.save_checkpoint(..., storage_options=...) is not")):
        ZeroPPStrategy().save_checkpoint(checkpoint=mock.Mock(), filepath=tmp_path, storage_options=mock.Mock())
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------- 2 gloo ranks
@pytest.mark.multiprocess
@pytest.mark.slow
def test_timeout_reaches_every_group(trainer_results):
    """1.9 (wider than upstream): the default group and each of the strategy's own groups get ``timeout``."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "1.9")):
        assert not seen["initialized_before"], "the timeout scenario must create the default group"
        assert seen["init"] == [TIMEOUT], (rank, seen["init"])
        ours = [timeout for caller, timeout in seen["groups"] if caller.startswith("lightning_zeropp")]
        assert len(ours) >= 3, (rank, seen["groups"])  # world, intra-node, inter-node rails (and hpZ)
        assert ours == [TIMEOUT] * len(ours), (rank, seen["groups"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp1_modules_refused(trainer_results):
    """1.4: TypeError at setup naming the wrapped module; the model untouched."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "1.4")):
        assert seen["error"] is not None, f"rank {rank}: an FSDP1-wrapped model trained"
        assert "FullyShardedDataParallel" in seen["error"] and "model.w1" in seen["error"], seen["error"]
        assert seen["untouched"], rank


@pytest.mark.multiprocess
@pytest.mark.slow
def test_configure_model_not_required(trainer_results):
    """1.5, inverted (upstream requires ``configure_model``): without one, or with an empty one, fit trains and every
    parameter is sharded."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "1.5")):
        for case in ("absent", "empty"):
            assert seen[case]["global_step"] == 1, (rank, case)
            names = seen[case]["dtensors"]
            assert sorted(names) == [f"model.{w}.{k}" for w in ("w1", "w2", "w3") for k in ("bias", "weight")]
            assert all(names.values()), (rank, case, names)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_save_checkpoint_path_exists(trainer_results):
    """1.7: a checkpoint (either format) or an empty file is replaced; a folder of other files is refused in both
    formats and keeps its files (upstream writes a sharded checkpoint into it: 1.7d); a non-empty file that is not a
    checkpoint is refused (upstream overwrites it). Nothing is left beside the path."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "1.7")):
        full, sharded = seen["full"], seen["sharded"]
        assert_path_exists_contract(full, sharded, rank)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_load_unknown_checkpoint_type(trainer_results):
    """1.8 (our text): an empty folder is refused with a ValueError before any step."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "1.8")):
        assert seen["type"] is not None, f"rank {rank}: resumed from an empty folder"
        assert seen["is_value_error"], seen
        assert "is not a complete sharded checkpoint: it has no meta.pt" in seen["message"], seen["message"]
        assert seen["global_step"] == 0, seen


@pytest.mark.multiprocess
@pytest.mark.slow
def test_meta_device_materialization(trainer_results):
    """1.10: upstream warns that ``NoResetParameters`` has no ``reset_parameters`` and trains on uninitialized
    memory; we refuse, naming every tensor left uninitialized. With ``reset_parameters`` everywhere, every meta tensor
    is materialized, children first and the LightningModule last (its init of ``layer2`` wins)."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "1.10")):
        assert seen["meta_before"] == [True, True, True], rank
        message = seen["refused"]
        assert message is not None, f"rank {rank}: a model with uninitialized tensors trained"
        assert "no `reset_parameters()` initialized" in message, message
        assert "layer1.0.weight" in message and "layer1.1.weight" in message and "NoResetParameters" in message
        assert "layer2.weight" not in message and "buffer" not in message, message
        done = seen["materialized"]
        assert done["meta"] == [], (rank, done)
        assert done["values"] == {"layer1.0.weight": [2.0], "layer1.1.weight": [2.0]}, (rank, done)
        assert done["layer2.weight"] == [0.5], (rank, done)
        assert done["buffer"] == [1.0, 1.0], (rank, done)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_device_mesh_in_configure_model(trainer_results):
    """2.1 (1-D): ``self.device_mesh`` in ``configure_model`` is the data-parallel mesh over every rank, one node or
    several; a BoringModel (no ModuleList) trains."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "2.1")):
        for layout in ("one_node", "two_nodes"):
            mesh = seen[layout]
            assert mesh["is_mesh"] and mesh["ndim"] == 1 and mesh["size0"] == WORLD, (rank, layout, mesh)
            assert mesh["names"] == ("data_parallel",), (rank, layout, mesh)
            assert mesh["device_type"] == mesh["module_device_type"] == "cpu", (rank, layout, mesh)
            assert mesh["global_step"] == 1, (rank, layout, mesh)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_meta_init_and_data(trainer_results):
    """2.3 (without tensor parallelism)."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "2.3")):
        assert seen["meta_before"], rank
        assert seen["mesh"] == (1, WORLD, ("data_parallel",)), seen["mesh"]
        assert len(seen["params_on_mesh"]) == 6 and all(seen["params_on_mesh"].values()), seen["params_on_mesh"]
        assert len(seen["optimizer_on_mesh"]) == 6 and all(seen["optimizer_on_mesh"]), seen["optimizer_on_mesh"]
        assert seen["optimizer_holds_params"], rank
        assert seen["len_loader"] == 8 // 2 // WORLD and seen["distributed_sampler"], seen
        assert seen["batches_differ"] == [True, True], seen["batches_differ"]
        assert seen["global_step"] == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_modules_without_parameters(trainer_results):
    """2.4: a metric's tensor states stay plain tensors on the root device and it updates in every step."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "2.4")):
        assert seen["global_step"] == 2, seen
        for stage in ("init", "setup", "end"):
            assert seen[stage] == ("cpu", "cpu", "Tensor"), (rank, stage, seen[stage])
        assert seen["step"] == [("cpu", "cpu", "Tensor")] * 2, (rank, seen["step"])
        assert seen["counted"] == 2 * 2, seen  # 2 samples per step, 2 steps


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("init", INITS)
def test_module_init_context(trainer_results, precision, init):
    """2.5, in all four of our precisions (bf16-mixed: fp32 parameters, the optimizer's too), and with the layers
    built on the meta device in ``configure_model``."""
    dtype = PRECISIONS[precision]
    for rank, seen in enumerate(scenario_outcome(trainer_results, "2.5")):
        result = seen[(precision, init)]
        assert result["before"] == ("cpu" if init == "cpu_init" else "meta", dtype), (rank, result)
        assert result["after"] == ("cpu", dtype, True, "cpu", dtype), (rank, result)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_strategy_state_dict(trainer_results):
    """2.6: the unwrapped module's keys in order; sharded: DTensors on every rank; full: plain tensors on rank 0 and
    nothing elsewhere."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "2.6")):
        sharded, full = seen["sharded"], seen["full"]
        assert sharded["keys"] == sharded["expected"] and len(sharded["keys"]) == 6, (rank, sharded)
        assert sharded["types"] == {DTensor}, sharded["types"]
        if rank == 0:
            assert full["keys"] == full["expected"], full
            assert full["types"] == {torch.Tensor}, full["types"]
        else:
            assert full["keys"] == [], full


def _assert_states_equal(saved, restored, rank):
    (model, optimizer), (model_after, optimizer_after) = saved, restored
    assert len(model) == len(model_after) == 6, (rank, list(model), list(model_after))
    assert list(model) == list(model_after)
    for name in model:
        torch.testing.assert_close(model_after[name], model[name], atol=0, rtol=0, msg=name)
    assert len(optimizer) == len(optimizer_after) == 2
    torch.testing.assert_close(optimizer_after, optimizer, atol=0, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_full_checkpoint_resumes_under_ddp(trainer_results):
    """2.7"""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "2.7")):
        if rank != 0:
            assert seen["saved"] == ({}, {}), seen["saved"]
            continue
        _assert_states_equal(seen["saved"], seen["restored"], rank)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddp_checkpoint_resumes_under_zeropp(trainer_results):
    """2.8, into ``state_dict_type="full"`` (as upstream) and into ``"sharded"`` (the file's type decides the load)."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "2.8")):
        if rank != 0:
            assert seen["full"] == ({}, {}), seen["full"]
        else:
            _assert_states_equal(seen["saved"], seen["full"], rank)
        model, optimizer = seen["saved"]
        weights, by_name = seen["sharded"]
        assert list(weights) == list(model)
        for name, value in model.items():
            assert torch.equal(weights[name], value), (rank, name)
        names = by_name["param_groups"][0]["params"]
        assert names == [n for n in model if n.endswith(("weight", "bias"))], names
        assert [g["params"] for g in optimizer["param_groups"]] == [list(range(6))]
        for index, name in zip(optimizer["param_groups"][0]["params"], names):
            want, have = optimizer["state"][index], by_name["state"][name]
            assert sorted(have) == sorted(want) == ["exp_avg", "exp_avg_sq", "step"], (rank, name, sorted(have))
            for key in want:
                assert torch.equal(have[key], want[key]), (rank, name, key)
        # as upstream: betas come back from a broadcast load as a list
        settings = lambda groups: [  # noqa: E731
            {k: tuple(v) if k == "betas" else v for k, v in g.items() if k != "params"} for g in groups
        ]
        assert settings(by_name["param_groups"]) == settings(optimizer["param_groups"]), rank


@pytest.mark.multiprocess
@pytest.mark.slow
def test_save_load_sharded_state_dict(trainer_results):
    """2.9: the folder holds DCP's index, one shard file per rank and ``meta.pt`` (readable with
    ``weights_only=True``), nothing beside it; ``meta.pt`` holds Lightning's metadata and no tensors of the model or
    optimizer (ours adds the random states and the collectives' counters); the resume starts from the saved weights."""
    for seen in scenario_outcome(trainer_results, "2.9"):
        assert seen["listing"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], seen["listing"]
        assert seen["siblings"] == [seen["name"]], seen["siblings"]
        assert seen["weights_only_error"] is None, seen["weights_only_error"]
        keys = seen["metadata_keys"]
        assert "pytorch-lightning_version" in keys and "state_dict" not in keys and "optimizer_states" not in keys
        assert seen["callbacks"] == 1, seen
        assert seen["compared"] == [True] * 6, seen["compared"]
        assert seen["epochs"] == 2, seen


@pytest.mark.multiprocess
@pytest.mark.slow
def test_callback_state_with_non_tensor_object_resumes(trainer_results):
    """3.19, the Trainer's side: a sharded checkpoint's metadata loads with arbitrary picklable objects, also without
    ``weights_only=False`` (upstream's newest Fabric test: metadata loads with ``weights_only=False`` by default)."""
    for rank, seen in enumerate(scenario_outcome(trainer_results, "3.19")):
        for case in ("weights_only=False", "default"):
            assert seen[case] == {"type": "NonTensorMeta", "value": 42}, (rank, case, seen[case])
