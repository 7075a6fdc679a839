"""The whole Lightning lifecycle under ZeroPPStrategy, on 4 gloo ranks as 2 nodes x 2 (ZeRO-3 + hpZ, exact paths, so
results can be compared with one process to 1e-5): gradient accumulation, clipping by norm and by value, activation
checkpointing, CPU offload, frozen weights, manual optimization with two optimizers, no optimizer, the evaluation
loops, bf16-true and 16-true, and a single process."""

import math

import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import TINY, TinyLM, freeze_all_but_biases_and_norms
from lightning_zeropp.testing.workers import LossRecorder, reference_training, relative_error, save_inputs

pytestmark = pytest.mark.multiprocess

WORLD, PER_NODE, BATCH, STEPS = 4, 2, 2, 2
EXACT = dict(ranks_per_node=PER_NODE, hpz_partition_size=PER_NODE, quantize_weights=False, quantize_gradients=False)


def _fit(rank, world, init_path, data_path, *, steps=STEPS, accumulate=1, strategy=None, trainer_kwargs=None,
         model=None, precision="32-true", val_loader=None):  # fmt: skip
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_zeropp import ZeroPPStrategy

    x, y = torch.load(data_path, weights_only=True)
    model = model or TinyLM(init_path)
    strat = ZeroPPStrategy(**(EXACT if strategy is None else strategy)) if not isinstance(strategy, str) else strategy
    recorder = LossRecorder()
    trainer_kwargs = dict(trainer_kwargs or {})
    callbacks = [recorder, *trainer_kwargs.pop("callbacks", [])]
    trainer = lightning_trainer(
        world, strat, max_steps=steps, precision=precision, callbacks=callbacks, use_distributed_sampler=False,
        accumulate_grad_batches=accumulate, **trainer_kwargs,
    )  # fmt: skip
    local = TensorDataset(x[rank::world], y[rank::world])
    trainer.fit(model, DataLoader(local, batch_size=BATCH, shuffle=False), val_loader)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ledger = trainer.strategy.comm_ledger
    return (
        trainer,
        model,
        {
            "state": {k: v.float() for k, v in state.items()} if rank == 0 else None,
            "dtypes": sorted({str(v.dtype) for v in state.values()}),
            "losses": recorder.losses,
            "ledger": {k: (t.intra_node_bytes, t.inter_node_bytes, t.calls) for k, t in ledger.by_kind().items()},
        },
    )


def _accumulation(rank, world, init_path, data_path):
    return _fit(rank, world, init_path, data_path, accumulate=2)[2]


def _hsdp_accumulation_clip_norm(rank, world, init_path, data_path):
    strategy = dict(ranks_per_node=PER_NODE, sharding_strategy="HYBRID_SHARD", quantize_weights=False,
                    quantize_gradients=False)  # fmt: skip
    kw = dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    return _fit(rank, world, init_path, data_path, accumulate=2, strategy=strategy, trainer_kwargs=kw)[2]


def _clip_norm(rank, world, init_path, data_path):
    kw = dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    return _fit(rank, world, init_path, data_path, trainer_kwargs=kw)[2]


def _clip_value(rank, world, init_path, data_path):
    kw = dict(gradient_clip_val=2e-3, gradient_clip_algorithm="value")
    return _fit(rank, world, init_path, data_path, trainer_kwargs=kw)[2]


class BlockForwardCounter(Callback):
    """Counts, per block, the forward calls of its first layer norm: recomputation in backward calls it again."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.calls = [0] * len(pl_module.net.blocks)
        for i, block in enumerate(pl_module.net.blocks):
            block.ln1.register_forward_hook(lambda module, args, output, i=i: self.count(i))

    def count(self, i: int) -> None:
        self.calls[i] += 1


def _activation_checkpointing(rank, world, init_path, data_path):
    counter = BlockForwardCounter()
    strategy = {**EXACT, "activation_checkpointing_policy": ["Block"]}
    out = _fit(rank, world, init_path, data_path, strategy=strategy, trainer_kwargs={"callbacks": [counter]})[2]
    return {**out, "block_forwards": counter.calls}


def _cpu_offload(rank, world, init_path, data_path):
    counter = BlockForwardCounter()  # without activation checkpointing: one forward per block and step
    strategy = {**EXACT, "cpu_offload": True}
    out = _fit(rank, world, init_path, data_path, strategy=strategy, trainer_kwargs={"callbacks": [counter]})[2]
    return {**out, "block_forwards": counter.calls}


def _frozen(rank, world, init_path, data_path):
    class Frozen(TinyLM):
        def configure_model(self):
            super().configure_model()
            freeze_all_but_biases_and_norms(self)

    return _fit(rank, world, init_path, data_path, model=Frozen(init_path))[2]


def _manual_two_optimizers(rank, world, init_path, data_path):
    class Manual(TinyLM):
        def __init__(self, init_path):
            super().__init__(init_path)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            blocks, rest = self.optimizers()
            loss = self.loss(batch)
            self.manual_backward(loss)
            blocks.step()
            rest.step()
            blocks.zero_grad()
            rest.zero_grad()
            return loss

        def configure_optimizers(self):
            in_blocks = {id(p) for p in self.net.blocks.parameters()}
            others = [p for p in self.parameters() if id(p) not in in_blocks]
            return [
                torch.optim.SGD(self.net.blocks.parameters(), lr=0.3, momentum=0.9),
                torch.optim.SGD(others, lr=0.3, momentum=0.9),
            ]

    # Lightning counts every optimizer.step() as a global step: two optimizers -> 2 x STEPS
    return _fit(rank, world, init_path, data_path, model=Manual(init_path), steps=2 * STEPS)[2]


def _no_optimizer(rank, world, init_path, data_path):
    class NoOptimizer(TinyLM):
        def configure_optimizers(self):
            return None

    return _fit(rank, world, init_path, data_path, model=NoOptimizer(init_path))[2]


def _evaluation_loops(rank, world, init_path, data_path):
    trainer, model, out = _fit(rank, world, init_path, data_path)
    x, y = torch.load(data_path, weights_only=True)
    every = DataLoader(TensorDataset(x[:8], y[:8]), batch_size=4)  # every rank evaluates the same 8 windows
    ledger = trainer.strategy.comm_ledger
    before = ledger.by_kind()
    trainer.limit_val_batches = trainer.limit_test_batches = 1.0
    out["val"] = trainer.validate(model, every, verbose=False)[0]["val/loss"]
    predictions = trainer.predict(model, DataLoader(TensorDataset(x[:4]), batch_size=4))
    out["predicted_shape"] = tuple(predictions[0].shape)
    after = ledger.by_kind()
    out["eval_kinds"] = sorted(k for k in after if after[k].calls != before.get(k, after[k]).calls or k not in before)
    return out


def _weights_swapped_for_validation(rank, world, init_path, data_path):
    """A callback that swaps other weights in for validation (as EMA callbacks do) and restores them after: the
    hpZ copies made during validation hold the swapped-in weights and must not serve the next training step."""

    class SwapForValidation(Callback):
        swaps = 0

        def on_validation_start(self, trainer, pl_module):
            self.swaps += 1
            self.saved = [p.detach().clone() for p in pl_module.parameters()]
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.zero_()

        def on_validation_end(self, trainer, pl_module):
            with torch.no_grad():
                for p, saved in zip(pl_module.parameters(), self.saved):
                    p.copy_(saved)

    x, y = torch.load(data_path, weights_only=True)
    val = DataLoader(TensorDataset(x[:4], y[:4]), batch_size=2)
    swap = SwapForValidation()
    kw = dict(val_check_interval=1, limit_val_batches=2, callbacks=[swap])
    trainer, model, out = _fit(rank, world, init_path, data_path, trainer_kwargs=kw, val_loader=val)
    return {**out, "validations": swap.swaps}


def _bf16_true(rank, world, init_path, data_path):
    return _fit(rank, world, init_path, data_path, precision="bf16-true", steps=3)[2]


def _fp16_true(rank, world, init_path, data_path):
    return _fit(rank, world, init_path, data_path, precision="16-true", steps=3)[2]


SCENARIOS = {
    f.__name__.lstrip("_"): f
    for f in (_accumulation, _hsdp_accumulation_clip_norm, _clip_norm, _clip_value, _activation_checkpointing,
              _cpu_offload, _frozen, _manual_two_optimizers, _no_optimizer, _evaluation_loops,
              _weights_swapped_for_validation, _bf16_true, _fp16_true)
}  # fmt: skip


def _worker(rank, world, names, init_path, data_path):
    return {name: SCENARIOS[name](rank, world, init_path, data_path) for name in names}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    init_path, data_path, x, y = save_inputs(tmp_path_factory.mktemp("lifecycle"), WORLD * BATCH * STEPS * 2)
    results = spawn(_worker, WORLD, list(SCENARIOS), init_path, data_path, timeout=900)
    init = {f"net.{k}": v for k, v in torch.load(init_path).items()}
    return init_path, x, y, init, results


def _assert_matches(state, ref_state, tol=1e-6):
    # measured: at most 1.8e-7 (accumulation 1.3e-7, clipping 5e-8, one process 3e-8)
    for name, ref in ref_state.items():
        err = relative_error(state[name], ref)
        assert err <= tol, f"{name}: relative error {err:.2e}"


def test_gradient_accumulation_reduces_once_per_step(run):
    init_path, x, y, _, results = run
    ref, _ = reference_training(init_path, x, y, WORLD * BATCH, STEPS, accumulate=2)
    _assert_matches(results[0]["accumulation"]["state"], ref)
    units = 3  # 2 blocks + the root
    for r in results:
        assert r["accumulation"]["ledger"]["gradient_reduce_scatter"][2] == STEPS * units  # not 2 x per step
        assert r["accumulation"]["ledger"]["weight_all_gather"][2] == 2 * STEPS * units  # every micro-batch gathers


def test_hsdp_accumulates_and_clips_by_the_global_norm(run):
    """HSDP (2-D mesh): no gradient traffic on the first micro-batch, one reduce-scatter and one all-reduce per unit
    and step, and the clip by the norm over every shard of both mesh dimensions."""
    init_path, x, y, _, results = run
    ref, _ = reference_training(init_path, x, y, WORLD * BATCH, STEPS, accumulate=2, clip=("norm", 0.05))
    unclipped, _ = reference_training(init_path, x, y, WORLD * BATCH, STEPS, accumulate=2)
    assert relative_error(ref["net.blocks.0.mlp.fc.weight"], unclipped["net.blocks.0.mlp.fc.weight"]) > 1e-3
    _assert_matches(results[0]["hsdp_accumulation_clip_norm"]["state"], ref)
    units = 3
    for r in results:
        ledger = r["hsdp_accumulation_clip_norm"]["ledger"]
        assert ledger["gradient_reduce_scatter"][2] == ledger["gradient_all_reduce"][2] == STEPS * units
        assert ledger["weight_all_gather"][1] == 0  # weights never leave the node


@pytest.mark.parametrize(("name", "clip"), [("clip_norm", ("norm", 0.05)), ("clip_value", ("value", 2e-3))])
def test_gradient_clipping(run, name, clip):
    init_path, x, y, init, results = run
    ref, _ = reference_training(init_path, x, y, WORLD * BATCH, STEPS, clip=clip)
    unclipped, _ = reference_training(init_path, x, y, WORLD * BATCH, STEPS)
    # the clip changes the result far beyond the parity tolerance (measured: 0.027 by norm, 0.0097 by value)
    assert relative_error(ref["net.blocks.0.mlp.fc.weight"], unclipped["net.blocks.0.mlp.fc.weight"]) > 1e-3
    _assert_matches(results[0][name]["state"], ref)


@pytest.mark.parametrize(
    "name", ["activation_checkpointing", "cpu_offload", "manual_two_optimizers", "weights_swapped_for_validation"]
)
def test_matches_single_process(run, name):
    init_path, x, y, _, results = run
    ref, _ = reference_training(init_path, x, y, WORLD * BATCH, STEPS)
    _assert_matches(results[0][name]["state"], ref)
    for rank, r in enumerate(results):
        if name in ("activation_checkpointing", "cpu_offload"):
            # with activation checkpointing each block runs forward again in backward; without it, once per step
            per_step = 2 if name == "activation_checkpointing" else 1
            forwards = r[name]["block_forwards"]
            assert forwards == [per_step * STEPS] * TINY["n_layer"], f"rank {rank}: block forwards {forwards}"
        if name == "weights_swapped_for_validation":  # validation ran (and swapped) after every step
            assert r[name]["validations"] == STEPS, f"rank {rank}: {r[name]['validations']} validations"


def test_frozen_weights(run):
    init_path, x, y, init, results = run
    ref, _ = reference_training(init_path, x, y, WORLD * BATCH, STEPS, freeze_matrices=True)
    state = results[0]["frozen"]["state"]
    _assert_matches(state, ref)
    for name, value in init.items():
        if value.dim() >= 2:
            assert torch.equal(state[name], value), f"{name} is frozen but changed"
    assert not torch.equal(state["net.ln_f.weight"], init["net.ln_f.weight"])


def test_no_optimizer(run):
    *_, init, results = run
    state = results[0]["no_optimizer"]["state"]
    assert all(torch.equal(state[k], v) for k, v in init.items())
    assert len(results[0]["no_optimizer"]["losses"]) == STEPS


def test_evaluation_loops_do_not_communicate_gradients(run):
    init_path, x, y, _, results = run
    ref_state, _ = reference_training(init_path, x, y, WORLD * BATCH, STEPS)
    model = TinyLM(init_path)
    model.configure_model()
    model.net.load_state_dict({k[len("net.") :]: v for k, v in ref_state.items()})
    with torch.no_grad():
        expected = model.loss((x[:4], y[:4])).item() / 2 + model.loss((x[4:8], y[4:8])).item() / 2
    for r in results:
        out = r["evaluation_loops"]
        assert out["val"] == pytest.approx(expected, rel=1e-6)  # measured: equal
        assert out["predicted_shape"] == (4, TINY["block_size"], TINY["vocab_size"])
        assert out["eval_kinds"] == ["weight_all_gather"], out["eval_kinds"]  # weights only, no gradient traffic


@pytest.mark.parametrize(("name", "dtype"), [("bf16_true", "torch.bfloat16"), ("fp16_true", "torch.float16")])
def test_half_precision_trains(run, name, dtype):
    *_, init, results = run
    assert results[0][name]["dtypes"] == [dtype]
    for rank, r in enumerate(results):
        losses = r[name]["losses"]
        assert len(losses) == 3 and all(map(math.isfinite, losses)), f"rank {rank}: losses {losses}"
    weight = "net.blocks.0.mlp.fc.weight"
    assert relative_error(results[0][name]["state"][weight], init[weight]) > 1e-2  # it trained (measured: 0.046)


def _single_process(rank, world, init_path, data_path):
    return _fit(rank, world, init_path, data_path, strategy="zeropp")[2]


def test_single_process_zeropp(tmp_path):
    init_path, data_path, x, y = save_inputs(tmp_path, BATCH * STEPS)
    (result,) = spawn(_single_process, 1, init_path, data_path)
    ref, _ = reference_training(init_path, x, y, BATCH, STEPS)
    _assert_matches(result["state"], ref)
    assert result["ledger"] == {}  # one rank: FSDP issues no collectives
