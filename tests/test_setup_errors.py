"""Arguments that can only be checked against the running job fail at setup, on every rank, with a clear error."""

import pytest
from helpers import spawn

pytestmark = pytest.mark.multiprocess

CASES = {
    "unknown wrap class": (dict(wrap_modules=["Blok"]), "32-true", r"`wrap_modules` names 'Blok'.*Block"),
    "absent wrap class": (dict(wrap_modules={"Conv2d"}), "32-true", r"`wrap_modules` names 'Conv2d'"),
    "unknown AC class": (dict(activation_checkpointing=["Blocks"]), "32-true", r"`activation_checkpointing` names"),
    "hpz does not divide": (dict(hpz_partition_size=3), "32-true", r"`hpz_partition_size=3`.*world size 2"),
    "ranks_per_node spans machines": (
        dict(ranks_per_node=2),
        "32-true",
        r"`ranks_per_node=2`.*must divide the 1 ranks",
    ),
    "fp16 mixed precision": ({}, "16-mixed", r"precision='16-mixed'"),
}


def _setup_worker(rank, world_size):
    import re

    import torch
    from helpers import lightning_trainer
    from torch.utils.data import DataLoader, TensorDataset
    from workers import tiny_gpt

    from lightning_zeropp import ZeroPPStrategy

    data = DataLoader(TensorDataset(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long)))
    failures = {}
    for name, (kwargs, precision, pattern) in CASES.items():
        try:
            trainer = lightning_trainer(
                world_size, ZeroPPStrategy(**kwargs), num_nodes=2, precision=precision, max_steps=1
            )
            trainer.fit(tiny_gpt(), data)
        except (ValueError, TypeError) as err:
            if not re.search(pattern, str(err), re.S):
                failures[name] = f"wrong message: {err}"
        else:
            failures[name] = "no error"
    return failures


def _triton_on_cpu_worker(rank, world_size):
    import torch
    from helpers import lightning_trainer
    from torch.utils.data import DataLoader, TensorDataset
    from workers import tiny_gpt

    from lightning_zeropp import ZeroPPStrategy

    data = DataLoader(TensorDataset(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long)))
    trainer = lightning_trainer(world_size, ZeroPPStrategy(kernel_backend="triton"), max_steps=1)
    try:
        trainer.fit(tiny_gpt(), data)
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
