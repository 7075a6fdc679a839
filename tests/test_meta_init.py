"""A model built on the meta device starts from a real initialization on CPU ranks: the weights materialized at 2
and 4 ranks equal, bit for bit, what the same seed gives at 1 rank, and at 1 rank what it gives a model built on
the CPU; each rank's generator leaves materialization in the same state as at 1 rank.

The fault these tests name: on a CPU mesh DTensor has no RNG tracker, so ``reset_parameters()`` on a sharded
parameter drew its local shard with each rank's generator in the same state (the halves of a matrix came out
identical at 2 ranks) and the generators then drifted apart; and ``nn.MultiheadAttention``, initialized by a private
``_reset_parameters()``, was refused as uninitialized.

Models (odd sizes, no dimension divisible by 2 or 4: the last ranks' chunks are short or empty): an MLP; a small
transformer of ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` inside) with an embedding tied to the head and
LayerNorms beside biases; and the example GPT (``examples/gpt``, its own ``reset_parameters`` after its children's).
Each is built under ``trainer.init_module(empty_init=True)`` and set up by the Trainer (``ZeroPPStrategy``), and every
parameter is gathered whole on every rank at the start of training. One spawn per world size serves every test.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp.testing.distributed import lightning_trainer, spawn

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.version_sensitive]

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "gpt")
SEED = 1234
VOCAB, WIDTH, HEADS, FEEDFORWARD = 13, 15, 3, 7  # 13 and 7 rows: chunks of 4/4/4/1 and 2/2/2/1 at 4 ranks


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(WIDTH, VOCAB), nn.ReLU(), nn.Linear(VOCAB, FEEDFORWARD),
                                    nn.LayerNorm(FEEDFORWARD), nn.Linear(FEEDFORWARD, 3))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.float())


class EncoderLM(nn.Module):
    """Token embedding, two ``nn.TransformerEncoderLayer`` (each its own: ``nn.TransformerEncoder`` would deep-copy
    one), a final LayerNorm and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, FEEDFORWARD, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _gpt() -> nn.Module:
    from model import GPT  # examples/gpt, on the ranks' import path

    return GPT(vocab_size=VOCAB, block_size=7, n_layer=2, n_head=HEADS, n_embd=WIDTH, dropout=0.0)


NETS = {"mlp": MLP, "encoder": EncoderLM, "gpt": _gpt}


class Holder(LightningModule):
    """The network as a LightningModule; training stops before the first step (only the setup is under test)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.net = NETS[name]()

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Capture(Callback):
    """At the start of training (setup done, no step yet): every parameter gathered whole, and the generator's state."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {n: p.full_tensor().clone() for n, p in pl_module.named_parameters()}
        self.rng = torch.get_rng_state()
        trainer.should_stop = True


def _materialized(world: int, name: str) -> dict:
    from lightning_zeropp import ZeroPPStrategy

    capture = Capture()
    trainer = lightning_trainer(world, ZeroPPStrategy(ranks_per_node=min(world, 2)), max_steps=1, callbacks=[capture],
                                use_distributed_sampler=False)  # fmt: skip
    data = torch.arange(10).view(2, 5) % VOCAB if name != "mlp" else torch.ones(2, WIDTH)  # draws nothing
    torch.manual_seed(SEED)
    with trainer.init_module(empty_init=True):
        module = Holder(name)
    meta = all(p.is_meta for p in module.parameters())
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=2))
    return {"meta": meta, "weights": capture.weights, "rng": capture.rng}


# ------------------------------------------------------------------------------------------------ initializers
def _initializers(generator: torch.Generator) -> dict:
    """name -> (global shape, the call). The nn.init functions and Tensor methods a ``reset_parameters`` reaches."""
    return {
        "normal_": ((13, 5), lambda t: nn.init.normal_(t, std=0.02)),
        "uniform_ generator=": ((13, 5), lambda t: nn.init.uniform_(t, -1.0, 1.0, generator=generator)),
        "kaiming_uniform_": ((7, 9), lambda t: nn.init.kaiming_uniform_(t, a=5**0.5)),
        "kaiming_normal_": ((7, 9), nn.init.kaiming_normal_),
        "xavier_uniform_": ((45, 15), nn.init.xavier_uniform_),
        "xavier_normal_": ((7, 9), nn.init.xavier_normal_),
        "trunc_normal_ (redraws)": ((13, 5), lambda t: nn.init.trunc_normal_(t, std=1.0, a=-0.5, b=0.5)),
        "trunc_normal_ (rejection sampling)": ((13, 5), lambda t: nn.init.trunc_normal_(t, std=1.0, a=0.0, b=0.2)),
        "orthogonal_": ((13, 5), nn.init.orthogonal_),
        "exponential_": ((7, 3), lambda t: t.exponential_()),
        "geometric_": ((7, 3), lambda t: t.geometric_(0.3)),
        "log_normal_": ((7, 3), lambda t: t.log_normal_()),
        "cauchy_": ((7, 3), lambda t: t.cauchy_()),
        "random_": ((7, 3), lambda t: t.random_(0, 1000)),
        "bernoulli_": ((13,), lambda t: t.bernoulli_(0.3)),
        "randn_like": ((7, 3), lambda t: t.copy_(torch.randn_like(t))),
    }


def _drawn(world: int) -> dict:
    """Each initializer on a tensor sharded over the ranks (and, at 4 ranks, over HSDP's 2 x 2 mesh, replicated
    across the first dimension), under :class:`WholeDraws`: the whole result and the generators' states after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_zeropp.materialize import WholeDraws

    layouts = {"Shard(0)": (init_device_mesh("cpu", (world,)), [Shard(0)])}
    if world == 4:
        layouts["HSDP (Replicate, Shard(0))"] = (init_device_mesh("cpu", (2, 2)), [Replicate(), Shard(0)])
    out = {}
    for layout, (mesh, placements) in layouts.items():
        generator = torch.Generator()
        for name, (shape, init) in _initializers(generator).items():
            torch.manual_seed(SEED)
            generator.manual_seed(SEED + 1)
            t = distribute_tensor(torch.zeros(shape), mesh, placements)
            try:  # one initializer's error does not hide the others' results
                with torch.no_grad(), WholeDraws():
                    init(t)
            except (NotImplementedError, RuntimeError, ValueError) as err:
                out[(layout, name)] = repr(err)
                continue
            out[(layout, name)] = (t.full_tensor(), torch.rand(4), torch.rand(4, generator=generator))
    t = distribute_tensor(torch.full((13,), 0.5), layouts["Shard(0)"][0], [Shard(0)])
    try:
        with torch.no_grad(), WholeDraws():
            torch.bernoulli(t)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    return out


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name in NETS:  # a model refused does not hide the others' results
        try:
            out[name] = _materialized(world, name)
        except ValueError as err:
            out[name] = {"error": str(err)}
    out["drawn"] = _drawn(world)
    if world == 1:  # the same seed on a model built on the CPU, without the meta device
        for name in NETS:
            torch.manual_seed(SEED)
            out[name]["cpu"] = {n: p.detach().clone() for n, p in Holder(name).named_parameters()}
    return out


@functools.cache
def _results(world: int) -> list[dict]:
    return spawn(_worker, world, sys_path=[EXAMPLE], timeout=900)


@pytest.mark.parametrize("name", list(NETS))
def test_meta_init_at_one_rank_is_the_init_of_a_model_built_on_the_cpu(name):
    """At 1 rank every parameter equals, bit for bit, the same seed's on a model built on the CPU (the initializers
    run in the constructors' order; ``nn.MultiheadAttention`` by its own ``_reset_parameters``)."""
    out = _results(1)[0][name]
    assert "error" not in out, out.get("error")
    assert out["meta"], name
    assert sorted(out["weights"]) == sorted(out["cpu"]), name
    differ = [n for n in out["cpu"] if not torch.equal(out["weights"][n], out["cpu"][n])]
    assert differ == [], (name, differ)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(NETS))
def test_meta_init_at_several_ranks_equals_one_rank(name, world):
    """Every parameter gathered whole on every rank equals the 1-rank one, bit for bit (the shards of one matrix are
    different slices of one draw, not the same numbers), and every rank's generator ends where 1 rank's does."""
    reference = _results(1)[0][name]
    for rank, results in enumerate(_results(world)):
        out = results[name]
        assert "error" not in reference and "error" not in out, (reference.get("error"), out.get("error"))
        assert out["meta"], (name, world, rank)
        assert sorted(out["weights"]) == sorted(reference["weights"]), (name, world, rank)
        differ = [n for n in reference["weights"] if not torch.equal(out["weights"][n], reference["weights"][n])]
        assert differ == [], (name, world, rank, differ)
        assert torch.equal(out["rng"], reference["rng"]), (name, world, rank, "the generator drifted")


@pytest.mark.parametrize("world", [2, 4])
def test_every_random_initializer_draws_as_on_one_rank(world):
    """Per initializer (nn.init and the Tensor methods; an explicit ``generator=``; HSDP's 2-D mesh at 4 ranks): the
    sharded result equals the 1-rank result bit for bit on every rank, and both generators end where 1 rank's do."""
    reference = _results(1)[0]["drawn"]
    for rank, results in enumerate(_results(world)):
        draws = [(key, value) for key, value in results["drawn"].items() if key != "refused"]
        assert len(draws) == len(reference) - 1 + (len(reference) - 1 if world == 4 else 0), (world, rank)
        for (layout, name), drawn in draws:
            where = (world, rank, layout, name)
            assert not isinstance(reference[("Shard(0)", name)], str), (name, reference[("Shard(0)", name)])
            assert not isinstance(drawn, str), (*where, drawn)
            whole, default_after, explicit_after = drawn
            want, want_default, want_explicit = reference[("Shard(0)", name)]
            assert torch.equal(whole, want), where
            assert torch.equal(default_after, want_default), (*where, "default generator drifted")
            assert torch.equal(explicit_after, want_explicit), (*where, "explicit generator drifted")


def _plain_draws() -> dict:
    """Each initializer on a plain tensor in this process: no mesh, no DTensor, no :class:`WholeDraws`. What the
    sharded draws must equal; made apart from the code under test (a draw that dropped an explicit ``generator=``
    would draw alike at every rank count, so the ranks agreeing with one rank proves nothing about it)."""
    out = {}
    generator = torch.Generator()
    for name, (shape, init) in _initializers(generator).items():
        torch.manual_seed(SEED)
        generator.manual_seed(SEED + 1)
        t = torch.zeros(shape)
        with torch.no_grad():
            init(t)
        out[name] = (t, torch.rand(4), torch.rand(4, generator=generator))
    return out


def test_the_sharded_draws_are_a_plain_tensors_draws():
    """The 1-rank draws (which every rank count's equal: the test above) equal the same calls on a plain tensor,
    per initializer: the values, and where the default and an explicit generator end."""
    plain = _plain_draws()
    reference = _results(1)[0]["drawn"]
    for name, (want, want_default, want_explicit) in plain.items():
        whole, default_after, explicit_after = reference[("Shard(0)", name)]
        assert torch.equal(whole, want), name
        assert torch.equal(default_after, want_default), (name, "default generator")
        assert torch.equal(explicit_after, want_explicit), (name, "explicit generator")


def test_a_random_op_that_needs_a_sharded_input_is_refused():
    """``torch.bernoulli`` of a sharded probability tensor cannot be drawn whole without the whole input: refused, by
    name, rather than drawn alike on every rank."""
    for results in _results(2):
        message = results["drawn"]["refused"]
        assert message is not None and "`bernoulli`" in message and "sharded" in message, message
