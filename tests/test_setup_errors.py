"""Arguments that can only be checked against the running job fail at setup, on every rank, with a clear error."""

import re

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import TINY, TinyLM

pytestmark = pytest.mark.multiprocess

CASES = {
    "unknown wrap class": (dict(auto_wrap_policy=["Blok"]), "32-true", r"`auto_wrap_policy` names 'Blok'.*Block"),
    "absent wrap class": (dict(auto_wrap_policy={"Conv2d"}), "32-true", r"`auto_wrap_policy` names 'Conv2d'"),
    "unknown AC class": (
        dict(activation_checkpointing_policy=["Blocks"]),
        "32-true",
        r"`activation_checkpointing_policy` names 'Blocks'",
    ),
    "hpz does not divide": (dict(hpz_partition_size=3), "32-true", r"`hpz_partition_size=3`.*world size 2"),
    "ranks_per_node spans machines": (
        dict(ranks_per_node=2),
        "32-true",
        r"`ranks_per_node=2`.*must divide the 1 ranks",
    ),
    "fp16 mixed precision": ({}, "16-mixed", r"precision='16-mixed'"),
}


def _data() -> DataLoader:
    tokens = torch.zeros(4, TINY["block_size"], dtype=torch.long)
    return DataLoader(TensorDataset(tokens, tokens))


def _setup_worker(rank, world_size):
    data = _data()
    failures = {}
    for name, (kwargs, precision, pattern) in CASES.items():
        try:
            trainer = lightning_trainer(
                world_size, ZeroPPStrategy(**kwargs), num_nodes=2, precision=precision, max_steps=1
            )
            trainer.fit(TinyLM(), data)
        except (ValueError, TypeError) as err:
            if not re.search(pattern, str(err), re.S):
                failures[name] = f"wrong message: {err}"
        else:
            failures[name] = "no error"
    return failures


def _triton_on_cpu_worker(rank, world_size):
    data = _data()
    trainer = lightning_trainer(world_size, ZeroPPStrategy(kernel_backend="triton"), max_steps=1)
    try:
        trainer.fit(TinyLM(), data)
    except ValueError as err:
        return str(err)
    return "no error"


def test_triton_backend_on_cpu_refused_at_setup():
    for message in spawn(_triton_on_cpu_worker, 2, env={"TRITON_INTERPRET": "0"}):
        assert 'kernel_backend="triton"` needs CUDA devices' in message, message


def test_errors_at_setup():
    # 2 ranks launched as 2 machines x 1, so ranks_per_node=2 would merge ranks of different machines
    for rank, failures in enumerate(spawn(_setup_worker, 2, ranks_per_machine=1)):
        assert failures == {}, f"rank {rank}: {failures}"
