"""FSDP's ``set_gradient_divide_factor``: the job's gradient is the sum over every rank divided by the factor.

Under quantized HSDP FSDP divides by the factor over its own mesh (the node), so the rail must then sum the nodes, not
average them, whatever reduce op FSDP passes (AVG where the factor equals the node's ranks; none at all with one rank
per node, where FSDP only copies and divides). Under qgZ the factor arrives as PREMUL_SUM, whose factor torch 2.9's
op object does not expose: it is read from the module."""

import pytest
import torch
from lightning.pytorch import Callback
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.core import HSDP_ARGUMENTS, QUANTIZED_HSDP_ARGUMENTS
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import TinyLM
from lightning_zeropp.testing.workers import save_inputs

pytestmark = [pytest.mark.multiprocess, pytest.mark.version_sensitive]
BATCH = 2


class DivideBy(Callback):
    """Sets every sharded module's gradient divide factor once the strategy has sharded the model."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_fit_start(self, trainer, pl_module) -> None:
        for module in pl_module.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(self.factor)


def _worker(rank, world, per_node, arguments, factors, init_path, data_path, precision="32-true"):
    """One SGD step per divide factor (None: FSDP's default mean); this rank's momentum shards after it (the first
    step's momentum buffer is the reduced gradient), in fp32."""
    x, y = torch.load(data_path, weights_only=True)
    loader = DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=BATCH, shuffle=False)
    out = {}
    for factor in factors:
        strategy = ZeroPPStrategy(ranks_per_node=per_node, **arguments)
        callbacks = [] if factor is None else [DivideBy(factor)]
        trainer = lightning_trainer(world, strategy, max_steps=1, callbacks=callbacks, use_distributed_sampler=False,
                                    precision=precision)  # fmt: skip
        model = TinyLM(init_path)
        trainer.fit(model, loader)
        optimizer = trainer.optimizers[0]
        state = optimizer.state
        out[factor] = {n: state[p]["momentum_buffer"].to_local().float() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize(
    ("arguments", "per_node"),
    [(QUANTIZED_HSDP_ARGUMENTS, 2), (QUANTIZED_HSDP_ARGUMENTS, 1), ({}, 2)],
    ids=["quantized-hsdp-2x2", "quantized-hsdp-2x1", "zeropp-2x2"],
)
def test_a_divide_factor_divides_the_jobs_sum(tmp_path, arguments, per_node):
    """2 nodes of ``per_node`` ranks, factors 1, the node's ranks (FSDP then passes AVG) and the world: every rank's
    reduced gradient is the job's sum over the factor, W / factor times the mean's (INT4 blocks are scale-free and W
    a power of two, so bit for bit up to that ratio). A rail that averaged the nodes whenever FSDP passed AVG, or
    always with one rank per node, gave 1 / K of that."""
    world = 2 * per_node
    init_path, data_path, *_ = save_inputs(tmp_path, world * BATCH)
    factors = sorted({1.0, float(per_node), float(world)})
    results = spawn(_worker, world, per_node, arguments, [None, *factors], init_path, data_path)
    for rank, r in enumerate(results):
        for name, mean in r[None].items():
            if not mean.abs().sum():
                continue
            for factor in factors:
                assert torch.allclose(r[factor][name], world / factor * mean, rtol=1e-5, atol=0), (rank, name, factor)


@pytest.mark.parametrize("divide_factor", [None, 8.0])
def test_the_premultiplier_comes_from_the_op_or_else_from_the_module(divide_factor):
    """An op that carries its factor gives it; one that does not (torch 2.9's NCCL-made PREMUL_SUM) takes 1 / the
    module's divide factor, and without either the reduction is refused in one line rather than guessed."""
    import types

    import torch.distributed as dist

    from lightning_zeropp.collectives import split_reduce_op

    assert split_reduce_op(dist.ReduceOp.AVG, divide_factor) == (dist.ReduceOp.AVG, None)
    bare = types.SimpleNamespace(op=dist.ReduceOp.PREMUL_SUM)  # no .factor
    if divide_factor is None:
        with pytest.raises(ValueError, match="PREMUL_SUM without a factor"):
            split_reduce_op(bare)
    else:
        assert split_reduce_op(bare, divide_factor) == (dist.ReduceOp.SUM, 0.125)
    carried = types.SimpleNamespace(op=dist.ReduceOp.PREMUL_SUM, factor=0.5)
    assert split_reduce_op(carried, divide_factor) == (dist.ReduceOp.SUM, 0.5)


@pytest.mark.parametrize("per_node", [2, 1], ids=["2x2", "2x1"])
def test_fp16_gradients_are_the_mean_over_every_node(tmp_path, per_node):
    """``precision="16-true"``: FSDP reduces fp16 gradients with SUM and divides around it by its own mesh's size
    (the node's N ranks), passing no AVG; the rail must still take the K nodes' mean. Quantized HSDP's reduced
    gradient against exact HSDP's (FSDP's own all-reduce), per parameter: the same size to INT4's error (a rail that
    summed the nodes gave K = 2 times it)."""
    world = 2 * per_node
    init_path, data_path, *_ = save_inputs(tmp_path, world * BATCH)
    runs = {}
    for name, arguments in (("quantized", QUANTIZED_HSDP_ARGUMENTS), ("exact", HSDP_ARGUMENTS)):
        runs[name] = spawn(_worker, world, per_node, arguments, [None], init_path, data_path, "16-true")
    for rank in range(world):
        quantized, exact = runs["quantized"][rank][None], runs["exact"][rank][None]
        for name, want in exact.items():
            if want.norm() < 1e-3:
                continue
            ratio = float(quantized[name].norm() / want.norm())
            assert 0.75 < ratio < 1.33, (rank, name, ratio)
