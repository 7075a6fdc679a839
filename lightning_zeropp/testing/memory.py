"""Peak host memory of a rank while the Trainer sets up a model built on the meta device (``benchmarks/init_memory.py``
and ``tests/test_big_model.py``). The rank imports the example GPT (``examples/gpt/model.py``): pass that folder on
the spawned ranks' import path."""

from __future__ import annotations

from typing import Any

__all__ = ["CONFIGS", "measure_rank", "peak_rss"]


def peak_rss() -> int:
    """This process's peak resident set size so far, in bytes (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


CONFIGS: dict[str, dict[str, Any]] = {
    "zeropp": {},
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
}


def measure_rank(rank: int, world: int, n_layer: int, n_embd: int, config: str, steps: int) -> dict:
    """One rank: builds the widened GPT on meta, fits ``steps`` steps; returns its peaks (bytes)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import torch
    from lightning.pytorch import Callback, Trainer
    from model import GPTModule
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy

    class SGDModule(GPTModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    peaks: dict[str, int] = {}

    class Peaks(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            peaks["setup"] = peak_rss()
            trainer.should_stop = steps == 0  # setup alone: no step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            peaks["first_step"] = peaks.get("first_step") or peak_rss()

    tokens = torch.randint(0, 256, (1, 65))
    strategy = ZeroPPStrategy(ranks_per_node=max(1, world // 2), **CONFIGS[config])
    trainer = Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=max(steps, 1), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[Peaks()], use_distributed_sampler=False,
    )  # fmt: skip
    peaks["baseline"] = peak_rss()
    with trainer.init_module(empty_init=True):
        module = SGDModule(block_size=64, n_layer=n_layer, n_head=n_embd // 128, n_embd=n_embd)
        module.configure_model()  # the whole network on the meta device
    params = sum(p.numel() for p in module.parameters())
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1))
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in module.parameters())
    return {"rank": rank, "params": params, "local_bytes": local, **peaks}
