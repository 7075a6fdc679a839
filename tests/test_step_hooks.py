"""The steps run through the sharded root's forward, yet the user's forward hooks on the LightningModule behave as
without the strategy: they fire on the step's own ``self(x)``, with ``x``, and never on the redirected step call.

FSDP2's root hooks must fire exactly once per step (on the outer call): a nested post-forward would reshard the root's
parameters in the middle of the step (the step's later use of them would then mix Tensors and DTensors).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp.spawn import run_local_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.version_sensitive]


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return type(value).__name__


class HookedLM(LightningModule):
    """A small LM whose root holds parameters of its own (embedding, final norm, head: the root's FSDP unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 13)
        self.calls: list[tuple[str, str]] = []
        self.register_forward_pre_hook(self.before)  # registered before sharding
        self.register_forward_hook(self.after)
        self.root_sharded_after_forward: list[bool] = []

    def before(self, module, args):
        self.calls.append(("pre", _describe(args[0])))

    def after(self, module, args, output):
        self.calls.append(("post", _describe(output)))

    def late(self, module, args):
        self.calls.append(("late-pre", _describe(args[0])))

    def on_fit_start(self) -> None:
        self.register_forward_pre_hook(self.late)  # registered after sharding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        # FSDP2 swaps the root's parameters for DTensor shards when it reshards: inside the step they stay unsharded
        self.root_sharded_after_forward.append(type(self.head.weight).__name__ == "DTensor")
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0 * self.head.bias.sum()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(rank: int, world: int) -> dict:
    from lightning_zeropp import ZeroPPStrategy

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 13, (8 * world, 5), generator=g)
    data = DataLoader(TensorDataset(x, (x + 1) % 13), batch_size=2)
    model = HookedLM()
    trainer = Trainer(
        accelerator="cpu", devices=world, strategy=ZeroPPStrategy(ranks_per_node=world // 2),  # 2 nodes x 2
        max_steps=3, limit_val_batches=1, num_sanity_val_steps=0, val_check_interval=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data, data)
    return {"calls": model.calls, "root_sharded": model.root_sharded_after_forward}


def test_user_forward_hooks_fire_on_the_steps_own_forward_calls():
    for rank, result in enumerate(run_local_ranks(_fit, 4)):
        calls = result["calls"]
        # 3 training steps and 1 validation step, each calling self(x) once: each hook fires once per call, with
        # the (2, 5) token batch as input and the (2, 5, 13) logits as output -- never with the step's (x, y) list
        step_call = [("pre", "tensor(2, 5)"), ("late-pre", "tensor(2, 5)"), ("post", "tensor(2, 5, 13)")]
        assert calls == step_call * 4, f"rank {rank}: {calls}"
        assert result["root_sharded"] == [False, False, False], f"rank {rank}: the nested call resharded the root"
