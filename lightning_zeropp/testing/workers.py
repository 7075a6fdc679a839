"""Rank workers and what they share: module-level functions, so spawned ranks can import them by name.

The parity tests all follow one pattern: :func:`save_inputs` writes an initial state and a data set, every rank
trains :class:`~lightning_zeropp.testing.models.TinyLM` from them with :func:`train_worker`, and the result is
compared with :func:`reference_training`, one process on the global batch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from .distributed import lightning_trainer
from .models import TINY, TinyLM, freeze_all_but_biases_and_norms, make_batches

__all__ = [
    "LossRecorder",
    "WeightProbe",
    "padded_shard_numel",
    "reference_training",
    "relative_error",
    "scaled_update",
    "update_errors",
    "update_problems",
    "save_inputs",
    "fabric_train_worker",
    "full_state",
    "GPT_SHAPE",
    "example_gpt",
    "gpt_reference_training",
    "gpt_train_worker",
    "save_gpt_inputs",
    "ledger_table",
    "train_worker",
    "unit_shard_numels",
]


class LossRecorder(Callback):
    """Collects the training loss of every step on this rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class WeightProbe(Callback):
    """Checks that every module holding parameters (the blocks' Linears and LayerNorms, the embeddings and the final
    norm of the root unit, the head tied to the token embedding) computes backward with bit-identical weights to its
    forward, every parameter of it."""

    def __init__(self) -> None:
        self.compared, self.mismatched = 0, 0
        self.mismatches: list[str] = []
        self.seen: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.named_modules():
            if any(True for _ in module.parameters(recurse=False)) and module is not pl_module:
                module.register_forward_hook(self.forward_hook)
                module.register_full_backward_pre_hook(self._backward_hook(name))

    def forward_hook(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            self.seen[id(module)] = {n: p.detach().clone() for n, p in module.named_parameters(recurse=False)}

    def _backward_hook(self, name: str):
        def hook(module, grad_output) -> None:
            seen = self.seen.pop(id(module))
            for pname, p in module.named_parameters(recurse=False):
                self.compared += 1
                if not torch.equal(seen[pname], p.detach()):
                    self.mismatched += 1
                    self.mismatches.append(f"{name}.{pname}")

        return hook


def save_inputs(tmp: Path, n_samples: int, seed: int = 0) -> tuple[str, str, torch.Tensor, torch.Tensor]:
    """Writes a fresh TinyLM's initial weights and ``n_samples`` token windows under ``tmp``; returns both paths
    and the data."""
    return _save_model_inputs(tmp, "", TinyLM, TINY, n_samples, seed)


def _save_model_inputs(
    tmp: Path, prefix: str, make: Any, shape: dict[str, Any], n_samples: int, seed: int
) -> tuple[str, str, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = make()
    model.configure_model()
    init_path, data_path = str(tmp / f"{prefix}init.pt"), str(tmp / f"{prefix}data.pt")
    torch.save(model.net.state_dict(), init_path)
    x, y = make_batches(n_samples, shape["block_size"], shape["vocab_size"], seed)
    torch.save((x, y), data_path)
    return init_path, data_path, x, y


def reference_training(
    init_path: str,
    x: torch.Tensor,
    y: torch.Tensor,
    global_batch: int,
    steps: int,
    *,
    accumulate: int = 1,
    clip: tuple[str, float] | None = None,
    freeze_matrices: bool = False,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process training on the global batch, what every data-parallel run must reproduce; returns the final
    weights (named as in the LightningModule's state dict) and the loss of every micro-batch."""
    model = TinyLM(init_path)
    model.configure_model()
    if freeze_matrices:
        freeze_all_but_biases_and_norms(model)
    opt_conf = model.configure_optimizers()
    optimizer, scheduler = opt_conf["optimizer"], opt_conf["lr_scheduler"]["scheduler"]
    losses = []
    for k in range(steps):
        for m in range(accumulate):
            i = k * accumulate + m
            sl = slice(i * global_batch, (i + 1) * global_batch)
            loss = model.loss((x[sl], y[sl]))
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            kind, value = clip
            params = [p for p in model.parameters() if p.grad is not None]
            if kind == "norm":
                torch.nn.utils.clip_grad_norm_(params, value)
            else:
                torch.nn.utils.clip_grad_value_(params, value)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {f"net.{k}": v.detach().clone() for k, v in model.net.state_dict().items()}, losses


class _FrozenMatricesLM(TinyLM):
    """TinyLM training only its biases and norms (as the reference's ``freeze_matrices``)."""

    def configure_model(self) -> None:
        super().configure_model()
        freeze_all_but_biases_and_norms(self)


def train_worker(
    rank: int,
    world_size: int,
    strategy_kwargs: dict[str, Any],
    init_path: str,
    data_path: str,
    batch_size: int,
    steps: int,
    precision: str = "32-true",
    num_nodes: int = 1,
    probe_weights: bool = False,
    freeze_matrices: bool = False,
) -> dict[str, Any]:
    """Trains TinyLM with ``ZeroPPStrategy(**strategy_kwargs)``; returns the full weights (rank 0), the losses, the
    ledger, what :class:`WeightProbe` saw, the units whose quantization blocks could not follow parameters, the
    strategy's persistent memory and the elements its error feedback residuals hold."""
    from lightning_zeropp import ZeroPPStrategy

    x, y = torch.load(data_path, weights_only=True)
    model = _FrozenMatricesLM(init_path) if freeze_matrices else TinyLM(init_path)
    strategy = ZeroPPStrategy(**strategy_kwargs)
    recorder = LossRecorder()
    probe = WeightProbe()
    trainer = lightning_trainer(
        world_size,
        strategy,
        num_nodes=num_nodes,
        max_steps=steps,
        precision=precision,
        callbacks=[recorder, probe] if probe_weights else [recorder],
        use_distributed_sampler=False,
    )
    # rank r takes samples r, r + W, ...: batch k of all ranks together is the reference's global batch k
    local = TensorDataset(x[rank::world_size], y[rank::world_size])
    trainer.fit(model, DataLoader(local, batch_size=batch_size, shuffle=False))
    comms = strategy.comms
    unaligned = {unit.name: unit.unaligned for unit in comms.units if unit.unaligned} if comms is not None else {}
    state = full_state(model)
    return {
        "state": state if rank == 0 else None,
        "losses": recorder.losses,
        "ledger": ledger_table(strategy.comm_ledger),
        "weights_compared": probe.compared,
        "weights_mismatched": probe.mismatched,
        "weights_mismatches": probe.mismatches[:8],
        "unaligned_blocks": unaligned,
        "persistent_memory": strategy.persistent_memory,
        "feedback_elements": comms.feedback.numel if comms is not None and comms.feedback is not None else 0,
    }


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model's whole weights in fp32 on the CPU (collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.float() for k, v in state.items()}


def ledger_table(ledger: Any) -> dict[str, tuple[int, int, int]]:
    """A ledger's totals by kind: ``(intra-node bytes, inter-node bytes, calls)``."""
    return {k: (t.intra_node_bytes, t.inter_node_bytes, t.calls) for k, t in ledger.by_kind().items()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in the L2 norm, in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def update_errors(
    state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], init: dict[str, torch.Tensor]
) -> tuple[dict[str, float], float]:
    """How far a run's updates (``state - init``) are from the reference's: per parameter, and over the whole model
    (every parameter's update in one vector), each as :func:`relative_error`."""
    per = {n: relative_error(state[n] - init[n], reference[n] - init[n]) for n in reference}
    got = torch.cat([(state[n] - init[n]).float().flatten() for n in reference])
    want = torch.cat([(reference[n] - init[n]).float().flatten() for n in reference])
    return per, relative_error(got, want)


def update_problems(
    state: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    init: dict[str, torch.Tensor],
    per_parameter: float,
    whole: float,
    min_movement: float = 0.5,
) -> list[str]:
    """What is wrong with a run's updates against the reference's: a parameter that never moved, one that moved less
    than ``min_movement`` times the reference's update (L2 norms: a starved parameter, whose gradient mostly rounds
    to zero, moves a little but not that much), one whose update error exceeds ``per_parameter``, a whole-model error
    above ``whole``. The whole-model bound, set near the measured error, catches what a loose per-parameter bound lets
    through (an update scaled by 0.5 scores 0.5 on every parameter)."""
    per, total = update_errors(state, reference, init)
    problems = [f"{n}: never moved" for n in reference if torch.equal(state[n], init[n])]
    for n in reference:
        want = float((reference[n] - init[n]).float().norm())
        got = float((state[n] - init[n]).float().norm())
        if 0 < got < min_movement * want:
            problems.append(f"{n}: moved {got / want:.3f} of the reference's update < {min_movement}")
    problems += [f"{n}: update error {e:.3f} > {per_parameter}" for n, e in per.items() if e > per_parameter]
    if total > whole:
        problems.append(f"whole model: update error {total:.4f} > {whole}")
    return problems


def scaled_update(
    state: dict[str, torch.Tensor], init: dict[str, torch.Tensor], factor: float
) -> dict[str, torch.Tensor]:
    """``init + factor * (state - init)``: a negative control (a gradient averaged over twice the ranks is 0.5)."""
    return {n: init[n] + factor * (state[n] - init[n]) for n in state}


def padded_shard_numel(shape: torch.Size, world_size: int) -> int:
    """FSDP2 pads dim 0 to a multiple of the world size: the per-rank numel of a parameter's shard."""
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / world_size) * rest


def unit_shard_numels(model: TinyLM, world_size: int) -> list[int]:
    """Per FSDP unit (each block, then the root's remaining parameters): the per-rank all-gather input numel."""
    blocks = list(model.net.blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [list(b.parameters()) for b in blocks]
    root = [p for p in model.parameters() if id(p) not in in_blocks]  # parameters() yields the tied weight once
    units.append(root)
    return [sum(padded_shard_numel(p.shape, world_size) for p in unit) for unit in units]


def fabric_train_worker(
    rank: int,
    world_size: int,
    strategy_kwargs: dict[str, Any],
    init_path: str,
    data_path: str,
    batch_size: int,
    steps: int,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trains TinyLM in a plain Fabric loop with ``lightning_zeropp.fabric.ZeroPPStrategy(**strategy_kwargs)``, on
    the same data and optimizer as :func:`train_worker`; returns the full weights (rank 0), the losses, the ledger,
    the gradient norms before clipping, and the per-step ledger metrics.

    ``options`` (keywords; spawned ranks take positional arguments only): ``precision``, ``num_nodes``;
    ``optimizer_first``: build the optimizer before ``fabric.setup(model, optimizer)`` (else ``setup_module``, then
    the optimizer, then ``setup_optimizers``). ``accumulate`` micro-batches per step, all but the last under
    ``fabric.no_backward_sync``; ``clip_norm``: ``fabric.clip_gradients`` before each step. ``save_to``: a
    checkpoint after the last step; ``resume_from``: load one first, with ``strict`` (default True), and train
    ``steps`` more on the batches after its ``step``. The state holds the model, the optimizer, a constant
    learning-rate scheduler and ``step``. After a load and after a save, one ``torch.rand`` draw is returned (the
    random state must continue across them).
    """
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from lightning_zeropp.fabric import ZeroPPStrategy

    opts = {"precision": "32-true", "num_nodes": 1, "optimizer_first": True, "accumulate": 1, **(options or {})}
    precision, num_nodes, accumulate = opts["precision"], opts["num_nodes"], opts["accumulate"]
    clip_norm, save_to, resume_from = opts.get("clip_norm"), opts.get("save_to"), opts.get("resume_from")
    x, y = torch.load(data_path, weights_only=True)
    strategy = ZeroPPStrategy(**strategy_kwargs)
    fabric = Fabric(
        accelerator="cpu", devices=world_size // num_nodes, num_nodes=num_nodes, strategy=strategy, precision=precision
    )
    fabric.launch()
    model = TinyLM(init_path)
    model.configure_model()
    hp = model.hparams
    if opts["optimizer_first"]:
        optimizer = torch.optim.SGD(model.parameters(), lr=hp.lr, momentum=hp.momentum)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=hp.lr, momentum=hp.momentum))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    rest, drawn_after_load, drawn_after_save = {}, None, None
    if resume_from is not None:
        rest = fabric.load(resume_from, state, strict=opts.get("strict", True))
        drawn_after_load = torch.rand(1).item()
    lx, ly = x[rank::world_size], y[rank::world_size]
    losses, norms, step_metrics = [], [], []
    for _ in range(steps):
        for m in range(accumulate):
            i = state["step"] * accumulate + m
            xb, yb = lx[i * batch_size : (i + 1) * batch_size], ly[i * batch_size : (i + 1) * batch_size]
            with fabric.no_backward_sync(model, enabled=m < accumulate - 1):
                logits = model(xb)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), yb.reshape(-1))
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
        if clip_norm is not None:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=clip_norm)))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        step_metrics.append(strategy.comm_ledger.step_metrics(unit="B", per_kind=True))
        state["step"] += 1
    if save_to is not None:
        fabric.save(save_to, state)
        drawn_after_save = torch.rand(1).item()
    weights = full_state(model)
    return {
        "state": weights if rank == 0 else None,
        "losses": losses,
        "ledger": ledger_table(strategy.comm_ledger),
        "norms": norms,
        "step_metrics": step_metrics,
        "step": state["step"],
        "rest": {k: v for k, v in rest.items() if k in ("epoch", "global_step")} | {"keys": sorted(rest)},
        "drawn_after_load": drawn_after_load,
        "drawn_after_save": drawn_after_save,
    }


# ------------------------------------------------------------------------------------------------ the example GPT
GPT_SHAPE = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=44, dropout=0.0)
"""The example GPT (``examples/gpt/model.py``) at a test's size: LayerNorms beside biases in each block, a head tied
to the token embedding, and a width (44) that is not a multiple of the block sizes."""


def example_gpt(root: Path | None = None):
    """The example's ``GPTModule`` class trained with SGD + momentum (lr 0.1) instead of AdamW, for the reason
    :class:`~lightning_zeropp.testing.models.TinyLM` gives. Loaded from ``examples/gpt/model.py`` of the repository
    this package is installed from (or ``root``)."""
    import importlib.util
    import sys

    root = root or Path(__file__).resolve().parents[2]
    path = root / "examples" / "gpt" / "model.py"
    if not path.is_file():
        raise FileNotFoundError(f"example_gpt: {path} does not exist; run the tests from a clone of the repository.")
    module = sys.modules.get("_zeropp_example_gpt_model")
    if module is None:
        spec = importlib.util.spec_from_file_location("_zeropp_example_gpt_model", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)

    class SGDGPTModule(module.GPTModule):
        def __init__(self, init_path: str | None = None, **shape: Any) -> None:
            super().__init__(**shape)
            self.init_path = init_path

        def configure_model(self) -> None:
            if self.net is not None:
                return
            super().configure_model()
            if self.init_path is not None:
                self.net.load_state_dict(torch.load(self.init_path, weights_only=True))

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return SGDGPTModule


def save_gpt_inputs(tmp: Path, n_samples: int, seed: int = 0) -> tuple[str, str, torch.Tensor, torch.Tensor]:
    """As :func:`save_inputs`, for the example GPT at :data:`GPT_SHAPE`."""
    return _save_model_inputs(tmp, "gpt_", lambda: example_gpt()(**GPT_SHAPE), GPT_SHAPE, n_samples, seed)


def gpt_reference_training(
    init_path: str, x: torch.Tensor, y: torch.Tensor, global_batch: int, steps: int
) -> dict[str, torch.Tensor]:
    """:func:`reference_training` for the example GPT: one process, the global batch; the final weights."""
    model = example_gpt()(init_path, **GPT_SHAPE)
    model.configure_model()
    optimizer = model.configure_optimizers()["optimizer"]
    for k in range(steps):
        sl = slice(k * global_batch, (k + 1) * global_batch)
        model._loss((x[sl], y[sl])).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {f"net.{k}": v.detach().clone() for k, v in model.net.state_dict().items()}


def gpt_train_worker(
    rank: int,
    world_size: int,
    strategy_kwargs: dict[str, Any],
    init_path: str,
    data_path: str,
    batch_size: int,
    steps: int,
) -> dict[str, Any]:
    """:func:`train_worker` for the example GPT at :data:`GPT_SHAPE`: the full weights (rank 0) and the units whose
    blocks could not follow the parameters."""
    from lightning_zeropp import ZeroPPStrategy

    x, y = torch.load(data_path, weights_only=True)
    model = example_gpt()(init_path, **GPT_SHAPE)
    strategy = ZeroPPStrategy(**strategy_kwargs)
    trainer = lightning_trainer(world_size, strategy, max_steps=steps, use_distributed_sampler=False)
    local = TensorDataset(x[rank::world_size], y[rank::world_size])
    trainer.fit(model, DataLoader(local, batch_size=batch_size, shuffle=False))
    comms = strategy.comms
    state = full_state(model)
    return {
        "state": state if rank == 0 else None,
        "unaligned_blocks": {unit.name: unit.unaligned for unit in comms.units if unit.unaligned},
        "units": len(comms.units),
    }
