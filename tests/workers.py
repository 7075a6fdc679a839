"""Training workers shared by the multi-process tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from model import GPTModule
from torch.utils.data import DataLoader, TensorDataset

TINY = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, warmup_steps=1, learning_rate=1e-2)


def make_batches(n_samples: int, block_size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token windows the tests make themselves: a noisy periodic byte sequence (learnable, not random)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(n_samples * (block_size + 1)) % 97 + 32
    noise = torch.randint(0, 3, base.shape, generator=g)
    seq = (base + noise).clamp(max=255).view(n_samples, block_size + 1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class TinyGPT(GPTModule):
    """The example's GPTModule, tiny; with ``init_path`` its weights come from that file (same start everywhere)."""

    def __init__(self, init_path: str | None = None, **kwargs: Any) -> None:
        super().__init__(**{**TINY, **kwargs})
        self.init_path = init_path

    def configure_model(self) -> None:
        fresh = self.net is None
        super().configure_model()
        if fresh and self.init_path is not None:
            self.net.load_state_dict(torch.load(self.init_path, weights_only=True))

    def configure_optimizers(self):
        # SGD with momentum, not the example's AdamW: Adam divides by the root of the squared gradient, so
        # parameters whose true gradient is zero (the key bias: softmax ignores it) turn rounding noise into
        # full-size steps, and parity checks would measure that noise instead of the strategy.
        optimizer = torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


def tiny_gpt(init_path: str | None = None, **overrides: Any) -> TinyGPT:
    return TinyGPT(init_path, **overrides)


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
):
    """Single-process training on the global batch: what every data-parallel run must reproduce."""
    model = tiny_gpt(init_path)
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
            loss = model._loss((x[sl], y[sl]))
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


def freeze_all_but_biases_and_norms(model) -> None:
    """Most weights frozen (every matrix and embedding), as when fine-tuning only a few parameters."""
    for p in model.net.parameters():
        p.requires_grad_(p.dim() < 2)


class LossRecorder(Callback):
    """Collects the training loss of every step on this rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class WeightProbe(Callback):
    """Checks that every Linear in the blocks computes backward with bit-identical weights to its forward."""

    def __init__(self) -> None:
        self.compared, self.mismatched = 0, 0
        self._seen: dict[int, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        for module in pl_module.net.blocks.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._forward)
                module.register_full_backward_pre_hook(self._backward)

    def _forward(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            self._seen[id(module)] = module.weight.detach().clone()

    def _backward(self, module, grad_output) -> None:
        self.compared += 1
        self.mismatched += int(not torch.equal(self._seen.pop(id(module)), module.weight.detach()))


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
) -> dict[str, Any]:
    """Trains the tiny GPT with ZeroPPStrategy; returns the full weights (rank 0), losses and the ledger."""
    from helpers import lightning_trainer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_zeropp import ZeroPPStrategy

    x, y = torch.load(data_path, weights_only=True)
    model = tiny_gpt(init_path)
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
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ledger = {k: (t.intra_node_bytes, t.inter_node_bytes, t.calls) for k, t in strategy.comm_ledger.by_kind().items()}
    return {
        "state": {k: v.float() for k, v in state.items()} if rank == 0 else None,
        "losses": recorder.losses,
        "ledger": ledger,
        "weights_compared": probe.compared,
        "weights_mismatched": probe.mismatched,
    }


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def padded_shard_numel(shape: torch.Size, world_size: int) -> int:
    """FSDP2 pads dim 0 to a multiple of the world size: the per-rank numel of a parameter's shard."""
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / world_size) * rest


def unit_shard_numels(model, world_size: int) -> list[int]:
    """Per FSDP unit (each block, then the root's remaining parameters): the per-rank all-gather input numel."""
    blocks = list(model.net.blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [[p for p in b.parameters()] for b in blocks]
    seen, root = set(), []
    for p in model.parameters():
        if id(p) not in in_blocks and id(p) not in seen:
            seen.add(id(p))
            root.append(p)
    units.append(root)
    return [sum(padded_shard_numel(p.shape, world_size) for p in unit) for unit in units]


def save_inputs(tmp: Path, n_samples: int, seed: int = 0) -> tuple[str, str, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = tiny_gpt()
    model.configure_model()
    init_path, data_path = str(tmp / "init.pt"), str(tmp / "data.pt")
    torch.save(model.net.state_dict(), init_path)
    x, y = make_batches(n_samples, TINY["block_size"], seed)
    torch.save((x, y), data_path)
    return init_path, data_path, x, y
