"""``ZeroGradientMonitor`` on one process without ``torch.distributed``: which parameters it reports as starved."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp.callback import ZeroGradientMonitor
from lightning_zeropp.testing.models import TinyLM, make_batches


class ZeroedBiasLM(TinyLM):
    """TinyLM whose final LayerNorm bias always receives an all-zero gradient (as if rounded away on the wire), and
    whose first block's LayerNorm weight is frozen."""

    def __init__(self) -> None:
        super().__init__(n_layer=1)
        self.backward_calls = 0

    def zero_now(self) -> bool:
        return True

    def configure_model(self) -> None:
        super().configure_model()
        self.net.blocks[0].ln1.weight.requires_grad_(False)
        self.net.ln_f.bias.register_hook(lambda g: g * 0 if self.zero_now() else g)

    def on_after_backward(self) -> None:
        self.backward_calls += 1


def _fit(model: TinyLM, monitor: ZeroGradientMonitor, steps: int, tmp_path) -> Trainer:
    dataset = TensorDataset(*make_batches(8, block_size=8))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[monitor],
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=4))
    return trainer


def test_reports_only_the_parameter_with_an_all_zero_gradient(tmp_path):
    torch.manual_seed(0)
    model, monitor = ZeroedBiasLM(), ZeroGradientMonitor()
    trainer = _fit(model, monitor, steps=2, tmp_path=tmp_path)
    assert monitor.starved == {"net.ln_f.bias"}  # not the frozen ln1.weight, not the trained others
    assert monitor.last_zero == ["net.ln_f.bias"]
    assert trainer.logged_metrics["zeropp/zero_gradient_parameters"] == 1
    assert trainer.logged_metrics["zeropp/starved_parameters"] == 1
    assert torch.count_nonzero(model.net.ln_f.bias.grad) == 0


def test_starved_is_remembered_after_the_gradient_comes_back(tmp_path):
    class ZeroOnlyFirst(ZeroedBiasLM):
        def zero_now(self) -> bool:
            return self.backward_calls == 0  # only the first step's gradient is zeroed

    torch.manual_seed(0)
    model, monitor = ZeroOnlyFirst(), ZeroGradientMonitor()
    trainer = _fit(model, monitor, steps=3, tmp_path=tmp_path)
    assert monitor.starved == {"net.ln_f.bias"}
    assert monitor.last_zero == []
    assert trainer.logged_metrics["zeropp/zero_gradient_parameters"] == 0
    assert trainer.logged_metrics["zeropp/starved_parameters"] == 1
