"""Helpers for the tests: spawning gloo ranks (with the example importable) and a quiet CPU Trainer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_zeropp.spawn import free_port, run_local_ranks  # noqa: F401  (free_port: for tests that need one)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt"
TESTS = ROOT / "tests"


def spawn(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``run_local_ranks`` with the example on the ranks' import path; a failing rank fails the test."""
    try:
        return run_local_ranks(fn, world_size, *args, sys_path=[str(EXAMPLE), str(TESTS)], **kwargs)
    except RuntimeError as err:
        raise AssertionError(str(err)) from None


def lightning_trainer(world_size: int, strategy: Any, num_nodes: int = 1, **kwargs: Any):
    """A quiet CPU Trainer for one of the spawned ranks (the processes exist already: Lightning only joins)."""
    from lightning.pytorch import Trainer

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
