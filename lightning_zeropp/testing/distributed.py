"""Spawned gloo ranks for tests, and a quiet CPU Trainer for one of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer

from lightning_zeropp.spawn import free_port, run_local_ranks

__all__ = ["free_port", "lightning_trainer", "spawn"]


def spawn(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`~lightning_zeropp.spawn.run_local_ranks` for tests: a failing or hanging rank fails the test.

    ``fn`` must be importable by name (a module-level function of an importable module): the ranks are fresh
    processes. Keyword arguments (``ranks_per_machine``, ``timeout``, ``env``) go to ``run_local_ranks``.
    """
    try:
        return run_local_ranks(fn, world_size, *args, **kwargs)
    except RuntimeError as err:
        raise AssertionError(str(err)) from None


def lightning_trainer(world_size: int, strategy: Any, num_nodes: int = 1, **kwargs: Any) -> Trainer:
    """A quiet CPU Trainer for one of the spawned ranks (the processes exist already: Lightning only joins them).

    ``world_size // num_nodes`` devices per node; ``kwargs`` override the defaults (no logger, no checkpointing,
    no progress bar, no validation).
    """
    defaults = dict(
        accelerator="cpu",
        devices=world_size // num_nodes,
        num_nodes=num_nodes,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)
