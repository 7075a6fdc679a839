"""The optimizer contract: what users really train with, under the defaults, on 2 emulated nodes x 2 ranks, gradient
clipping on, a few steps through the Trainer.

Every optimizer of torch.optim that a sharded model can use, a closure optimizer that calls its closure twice (SAM
style), an Adam subclass, an Adam subclass with a step of its own, a three-beta Adam variant, a hand-written sign
optimizer, and optimizers from third-party packages (pinned in the ``test`` extra): each either trains with finite
losses, its second-moment verdict asserted, or is refused before its first step in one sentence that names it. The
corrected ones end within quantization error of one process running the same optimizer on the global batch, parameter
by parameter; so does Adam with coupled weight decay at a learning rate that drove it to NaN before.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.testing.distributed import spawn

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

N, K = 2, 2
W = N * K
STEPS = 3
CLIP = 1.0
BATCH = 2  # per rank


def _torch_optimizers():
    from lightning_zeropp.testing.optimizers import SAM, LoggingAdam, MyAdam, SignDescent, ThreeBetaAdam

    o = torch.optim
    return {
        # name: (factory, expected: "corrected" / "off" / a pattern of the refusal)
        "SGD": (lambda ps: o.SGD(ps, lr=0.05, momentum=0.9), "off"),
        "Adam": (lambda ps: o.Adam(ps, lr=1e-3), "corrected"),
        "AdamW": (lambda ps: o.AdamW(ps, lr=1e-3, weight_decay=0.1), "corrected"),
        "Adam coupled L2": (lambda ps: o.Adam(ps, lr=1e-2, weight_decay=0.1), "corrected"),
        "AdamW amsgrad": (lambda ps: o.AdamW(ps, lr=1e-3, amsgrad=True), "corrected"),
        "Adam foreach": (lambda ps: o.Adam(ps, lr=1e-3, foreach=True), "corrected"),
        "AdamW fused": (lambda ps: o.AdamW(ps, lr=1e-3, fused=True), "corrected"),
        "NAdam": (lambda ps: o.NAdam(ps, lr=1e-3, weight_decay=0.01), "corrected"),
        "RAdam": (lambda ps: o.RAdam(ps, lr=1e-3), "corrected"),
        "Adamax": (lambda ps: o.Adamax(ps, lr=1e-3), "off"),
        "Adagrad": (lambda ps: o.Adagrad(ps, lr=1e-2), "off"),
        "Adadelta": (lambda ps: o.Adadelta(ps), "off"),
        "RMSprop": (lambda ps: o.RMSprop(ps, lr=1e-3), "off"),
        "ASGD": (lambda ps: o.ASGD(ps, lr=1e-2), "off"),
        "LBFGS": (lambda ps: o.LBFGS(ps, lr=0.1, max_iter=2), r"LBFGS cannot step the model.s sharded parameters"),
        "Rprop": (lambda ps: o.Rprop(ps, lr=1e-3), r"Rprop cannot step the model's sharded parameters"),
        "Adafactor": (lambda ps: o.Adafactor(ps, lr=1e-2), r"Adafactor cannot step the model's sharded parameters"),
        "SAM": (lambda ps: SAM(ps, lr=1e-3), "off"),
        "MyAdam": (lambda ps: MyAdam(ps, lr=1e-3), "corrected"),
        "LoggingAdam": (lambda ps: LoggingAdam(ps, lr=1e-3), "off"),
        "ThreeBetaAdam": (lambda ps: ThreeBetaAdam(ps, lr=1e-3), "off"),
        "SignDescent": (lambda ps: SignDescent(ps, lr=1e-3), "off"),
    }


def _third_party_optimizers():
    def make(module, cls, **kwargs):
        def factory(ps):
            return getattr(importlib.import_module(module), cls)(ps, **kwargs)

        return factory

    return {
        "Lion": (make("lion_pytorch", "Lion", lr=1e-4), "off"),
        "Prodigy": (make("prodigyopt", "Prodigy", lr=1.0), r"Prodigy cannot step the model.s sharded parameters"),
        "Adan": (make("adan_pytorch", "Adan", lr=1e-3), "off"),  # three betas
        "DAdaptAdam": (make("dadaptation", "DAdaptAdam", lr=1.0), r"DAdaptAdam cannot step the model.s sharded param"),
        "Lamb": (make("torch_optimizer", "Lamb", lr=1e-3), "off"),
        "CAME": (make("came_pytorch", "CAME", lr=1e-3), r"CAME cannot step the model's sharded parameters"),
    }


THIRD_PARTY = ("lion_pytorch", "prodigyopt", "adan_pytorch", "dadaptation", "torch_optimizer", "came_pytorch")


def _catalogue(kind):
    return _torch_optimizers() if kind == "torch" else _third_party_optimizers()


def _contract_worker(rank, world, init_path, data_path, kind, names):
    """Each of ``names`` trained through a Trainer in turn; ``NAME|uncorrected``: with the correction off."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp.testing.distributed import lightning_trainer
    from lightning_zeropp.testing.models import TinyLM
    from lightning_zeropp.testing.workers import LossRecorder, full_state

    catalogue = _catalogue(kind)
    x, y = torch.load(data_path, weights_only=True)
    results = {}
    for name in names:
        base, _, variant = name.partition("|")

        class Module(TinyLM):
            factory = staticmethod(catalogue[base][0])

            def configure_optimizers(self):
                return self.factory(self.parameters())

            def on_train_end(self):
                moments = self.trainer.strategy.comms.moments
                self.verdicts = [v.describe() for v in moments.verdicts.values()] if moments is not None else None

        loader = DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=BATCH, shuffle=False)
        recorder = LossRecorder()
        strategy = ZeroPPStrategy(ranks_per_node=N, second_moment_correction=variant != "uncorrected")
        if not variant:
            strategy = ZeroPPStrategy(ranks_per_node=N)  # the defaults
        trainer = lightning_trainer(world, strategy, max_steps=STEPS, callbacks=[recorder],
                                    gradient_clip_val=CLIP, use_distributed_sampler=False)  # fmt: skip
        module = Module(init_path)
        try:
            trainer.fit(module, loader)
        except ValueError as error:
            results[name] = {"refused": str(error)}
            continue
        except Exception as error:
            raise RuntimeError(f"{name} failed: {error}") from error
        weights = full_state(module)
        results[name] = {"losses": recorder.losses, "verdicts": module.verdicts,
                         "weights": weights if rank == 0 else None}  # fmt: skip
    return results


def _reference(init_path, x, y, factory):
    """One process, the global batch, the same clipping and optimizer: the final weights."""
    from lightning_zeropp.testing.models import TinyLM

    model = TinyLM(init_path)
    model.configure_model()
    optimizer = factory(model.parameters())
    for step in range(STEPS):
        sl = slice(step * W * BATCH, (step + 1) * W * BATCH)

        def closure(sl=sl):
            optimizer.zero_grad()
            loss = model.loss((x[sl], y[sl]))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
            return loss

        optimizer.step(closure)
    return {f"net.{k}": v.detach().clone() for k, v in model.net.state_dict().items()}


def _check(kind, tmp_path):
    from lightning_zeropp.testing.workers import save_inputs, update_errors

    catalogue = _catalogue(kind)
    names = sorted(catalogue)
    corrected = [name for name in names if catalogue[name][1] == "corrected"]
    init_path, data_path, x, y = save_inputs(tmp_path, W * BATCH * STEPS)
    runs = names + [f"{name}|uncorrected" for name in corrected]
    results = spawn(_contract_worker, W, init_path, data_path, kind, runs, timeout=900)
    init = {f"net.{k}": v for k, v in torch.load(init_path, weights_only=True).items()}
    worst = {}
    for name in names:
        expected = catalogue[name][1]
        for rank, per_rank in enumerate(results):
            r = per_rank[name]
            if expected not in ("corrected", "off"):
                assert "refused" in r, (name, rank, r)
                message = r["refused"]
                assert expected and re.search(expected, message), (name, message)
                assert message.count("; ") <= 1 and "\n" not in message, message  # one sentence
                continue
            assert "refused" not in r, (name, rank, r["refused"])
            assert len(r["losses"]) == STEPS and all(torch.isfinite(torch.tensor(r["losses"]))), (name, rank, r)
            want = "corrected" if expected == "corrected" else None
            (verdict,) = r["verdicts"]
            assert (verdict.endswith(" corrected")) == (want is not None), (name, verdict)
        if expected == "corrected":
            reference = _reference(init_path, x, y, catalogue[name][0])
            per, whole = update_errors(results[0][name]["weights"], reference, init)
            per_off, whole_off = update_errors(results[0][f"{name}|uncorrected"]["weights"], reference, init)
            worst[name] = (whole, whole_off, max(per.values()), max(per_off.values()))
    print("\n| optimizer | update error, corrected | uncorrected | worst parameter, corrected | uncorrected |")
    print("|---|---|---|---|---|")
    for name, row in worst.items():
        print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    for name, (whole, whole_off, per, per_off) in worst.items():
        # qwZ's INT8 weights and qgZ's INT4 gradients against exact ones (no update at all would be 1.0); the
        # correction's run as far from the exact one as the same run without it, to the noise of 3 steps (the runs
        # differ by one rounding of each step, which moves the figure by several percent either way)
        assert whole < 0.5 and whole <= whole_off * 1.25, (name, worst[name])
        assert per <= per_off * 1.25, (name, worst[name])
    return worst


def test_every_torch_optimizer_trains_or_is_refused_in_one_sentence(tmp_path):
    _check("torch", tmp_path)


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in THIRD_PARTY),
    reason="the third-party optimizer packages of the `test` extra are not installed (pip install -e '.[test]')",
)
def test_third_party_optimizers_train_or_are_refused_in_one_sentence(tmp_path):
    _check("third party", tmp_path)
