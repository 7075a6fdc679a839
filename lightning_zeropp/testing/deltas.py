"""A Fabric rank worker that probes weight deltas: what every forward pass computes with, on every rank, against the
exact weights, through training, an EMA-style swap, a checkpoint load and a write behind the version counters."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch import nn

from .models import TinyLM
from .workers import full_state, ledger_table

__all__ = ["ForwardWeights", "SwapInForValidation", "WireCounter", "deltas_worker", "trainer_swap_worker"]


class WireCounter:
    """Counts, while active, the bytes this rank hands ``torch.distributed.all_to_all_single`` for each peer (by
    global rank): what really goes on the wire, independent of the strategy's ledger. Weight deltas send through it."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        self.calls = 0
        self._original: Any = None

    def __enter__(self) -> WireCounter:
        self._original = original = dist.all_to_all_single

        def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            splits = input_split_sizes or [input.numel() // len(ranks)] * len(ranks)
            for peer, count in zip(ranks, splits, strict=True):
                self.sent[peer] = self.sent.get(peer, 0) + count * input.element_size()
            self.calls += 1
            return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_to_all_single = self._original


class ForwardWeights:
    """Records the weights each module of a sharded model computes with in its forward (FSDP2 swaps the gathered
    weights in for the call), by parameter name as in the model's state dict."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        for prefix, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(self._hook(prefix))

    def _hook(self, prefix: str):
        def hook(module: nn.Module, args: Any) -> None:
            for name, p in module.named_parameters(recurse=False):
                key = f"{prefix}.{name}" if prefix else name
                self.seen.setdefault(key, p.detach().float().clone())

        return hook

    def forward(self, model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weights one forward pass (no grad) used."""
        self.seen = {}
        with torch.no_grad():
            model(x)
        return dict(self.seen)


def _digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].numpy().tobytes())
    return h.hexdigest()


def _compare(seen: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Whether a forward used exactly ``exact``, and its relative L2 error over the model; ``exact`` is the whole
    weights on rank 0 (:func:`full_state`), ``{}`` elsewhere, where only the digest of what the forward used is
    kept (every rank's must equal rank 0's)."""
    if not exact:
        return {"digest": _digest(seen)}
    keys = sorted(set(seen) & set(exact))
    err = sum(float((seen[k] - exact[k]).square().sum()) for k in keys)
    norm = sum(float(exact[k].square().sum()) for k in keys)
    return {
        "equal": len(keys) == len(exact) and all(torch.equal(seen[k], exact[k]) for k in keys),
        "relative_error": (err / norm) ** 0.5 if norm else 0.0,
        "missing": sorted(set(exact) - set(seen)),
        "digest": _digest(seen),
    }


def deltas_worker(
    rank: int,
    world_size: int,
    strategy_kwargs: dict[str, Any],
    init_path: str,
    data_path: str,
    batch_size: int,
    steps: int,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trains TinyLM ``steps`` steps in a Fabric loop, recording the forward's weight error at each step as weight
    deltas track it. Options: ``num_nodes``, ``precision``; ``model``: TinyLM's shape arguments; ``optimizer``:
    ``"sgd"`` (TinyLM's) or ``"adamw"`` (weight decay 0.1), ``lr``; ``probe_steps``: also compare every training
    forward's weights with the exact ones (rank 0; any configuration); ``probes``: then run the checks below;
    ``folder``: where their checkpoint goes. Returns, per rank: the strategy's error figure per step, the probed
    errors (``probe_steps``), the ledger, the update counts, the weights after training (rank 0), this rank's node
    copy slices, its persistent memory, and the probes' results (on rank 0 against the exact weights; on every rank
    the digest of the weights the forward used):

    - ``after_training``: a forward after the last step (a delta update) against the exact weights;
    - ``swapped_in`` / ``swapped_back``: every weight scaled in place (as a callback swapping EMA weights in would),
      then restored;
    - ``loaded``: a checkpoint saved, two more steps, the checkpoint loaded;
    - ``behind_counters`` / ``after_refresh_call``: a write through ``param.data`` (invisible to version counters),
      then ``strategy.refresh_weight_copies()``.
    """
    from lightning.fabric import Fabric

    from lightning_zeropp.fabric import ZeroPPStrategy

    opts = {"num_nodes": 1, "precision": "32-true", "probes": False, "optimizer": "sgd", **(options or {})}
    x, y = torch.load(data_path, weights_only=True)
    strategy = ZeroPPStrategy(**strategy_kwargs)
    fabric = Fabric(
        accelerator="cpu",
        devices=world_size // opts["num_nodes"],
        num_nodes=opts["num_nodes"],
        strategy=strategy,
        precision=opts["precision"],
    )
    fabric.launch()
    model = TinyLM(init_path, **opts.get("model", {}))
    model.configure_model()
    hp = model.hparams
    model = fabric.setup_module(model)
    if opts["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=opts.get("lr", 1e-3), weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=opts.get("lr", hp.lr), momentum=hp.momentum)
    optimizer = fabric.setup_optimizers(optimizer)
    probe = ForwardWeights(model.module)
    deltas = strategy.comms.deltas
    lx, ly = x[rank::world_size], y[rank::world_size]
    errors: list[float] = []
    measured: list[float] = []  # with ``probe_steps``: each training forward's weights against the exact ones
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}

    def step() -> None:
        i = state["step"] % (len(lx) // batch_size)
        xb, yb = lx[i * batch_size : (i + 1) * batch_size], ly[i * batch_size : (i + 1) * batch_size]
        exact = full_state(model.module) if opts.get("probe_steps") else {}  # whole weights on rank 0 only
        probe.seen = {}
        logits = model(xb)
        if opts.get("probe_steps"):
            measured.append(_compare(probe.seen, exact).get("relative_error", 0.0))  # the figure: rank 0's
        if deltas is not None:
            pair = torch.tensor(deltas.error(), dtype=torch.float64)
            dist.all_reduce(pair)
            errors.append(float((pair[0] / pair[1]) ** 0.5) if pair[1] else 0.0)
        fabric.backward(F.cross_entropy(logits.float().view(-1, logits.size(-1)), yb.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1

    with WireCounter() as wire:
        for _ in range(steps):
            step()
    probe_x = lx[:batch_size]
    probes: dict[str, Any] = {}
    trained = full_state(model.module)
    seen = probe.forward(model, probe_x)
    probes["after_training"] = _compare(seen, trained)
    if opts["probes"]:
        originals = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        probes["swapped_in"] = _compare(probe.forward(model, probe_x), full_state(model.module))
        with torch.no_grad():
            for p, original in zip(model.parameters(), originals, strict=True):
                p.copy_(original)
        probes["swapped_back"] = _compare(probe.forward(model, probe_x), full_state(model.module))
        path = str(Path(opts["folder"]) / "deltas.ckpt")
        fabric.save(path, state)
        step()
        step()
        fabric.load(path, state)
        probes["loaded"] = _compare(probe.forward(model, probe_x), full_state(model.module))
        for p in model.parameters():
            p.data.mul_(0.5)
        probes["behind_counters"] = _compare(probe.forward(model, probe_x), full_state(model.module))
        strategy.refresh_weight_copies()
        probes["after_refresh_call"] = _compare(probe.forward(model, probe_x), full_state(model.module))
    slices = {} if deltas is None else {u.name: deltas.node_copy(u.name).clone() for u in strategy.comms.units}
    return {
        "state": trained if rank == 0 else None,  # after the training steps, before the probes
        "errors": errors,
        "measured": measured,
        "wire_sent": dict(wire.sent),
        "ledger": ledger_table(strategy.comm_ledger),
        "counts": {} if deltas is None else dict(deltas.counts),
        "slices": slices,
        "probes": probes,
        "memory": strategy.persistent_memory,
        "units": [unit.name for unit in strategy.comms.units],
    }


class SwapInForValidation(Callback):
    """Swaps other weights in for validation and back afterwards, in place, as an EMA callback does, and records
    whether the first validation forward and the first training forward after it used exactly the weights in place
    (rank 0 compares; every rank keeps the digests)."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any]] = {}
        self._originals: list[torch.Tensor] = []
        self._expected: dict[str, torch.Tensor] = {}
        self._probe: ForwardWeights | None = None
        self._pending: str | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._probe = ForwardWeights(pl_module)

    def _arm(self, name: str, pl_module) -> None:
        assert self._probe is not None
        self._expected = full_state(pl_module)
        self._probe.seen = {}
        self._pending = name

    def _check(self) -> None:
        assert self._probe is not None
        if self._pending is not None and self._pending not in self.results:
            self.results[self._pending] = _compare(dict(self._probe.seen), self._expected)
        self._pending = None

    def on_validation_start(self, trainer, pl_module) -> None:
        self._originals = [p.detach().clone() for p in pl_module.parameters()]
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.9)
        self._arm("validation", pl_module)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._check()

    def on_validation_end(self, trainer, pl_module) -> None:
        with torch.no_grad():
            for p, original in zip(pl_module.parameters(), self._originals, strict=True):
                p.copy_(original)
        self._arm("training_after", pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._check()


def trainer_swap_worker(
    rank: int, world_size: int, strategy_kwargs: dict[str, Any], init_path: str, data_path: str, batch_size: int
) -> dict[str, Any]:
    """Four Trainer steps with validation after the second, under :class:`SwapInForValidation`; returns what it
    recorded and the ledger."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy

    from .distributed import lightning_trainer

    x, y = torch.load(data_path, weights_only=True)
    strategy = ZeroPPStrategy(**strategy_kwargs)
    swap = SwapInForValidation()
    trainer = lightning_trainer(
        world_size, strategy, max_steps=4, val_check_interval=2, limit_val_batches=1, callbacks=[swap],
        use_distributed_sampler=False,
    )  # fmt: skip
    local = DataLoader(TensorDataset(x[rank::world_size], y[rank::world_size]), batch_size=batch_size)
    trainer.fit(TinyLM(init_path), local, local)
    return {"results": swap.results, "ledger": ledger_table(strategy.comm_ledger)}
