"""Tensor parallelism on the shapes real models have: a small Llama under torch's usual plan.

:class:`~lightning_zeropp.testing.models.TinyLlama` (token embedding tied to the head, RMSNorm before attention and
MLP, grouped-query attention with rotary positions, SwiGLU; odd sizes) under
:func:`~lightning_zeropp.testing.models.parallelize_llama`: q/k/v, gate and up colwise, o and down rowwise, the
embedding rowwise and the head colwise over the vocabulary, the norms SequenceParallel (the residual stream split
along the sequence between the blocks' matmuls). ``configure_model`` is written for Lightning's ModelParallelStrategy
(``fully_shard`` each block and the root over ``device_mesh["data_parallel"]``) and runs unchanged under ours.

Two layouts, t = 2 each: 2 nodes x 2 ranks (r/t = 1: one data-parallel rank per node, qgZ in one hop across nodes)
and 2 nodes x 4 ranks (r/t = 2: two per node, qgZ's two hops). In each, 3 AdamW steps:

- quantization off: every rank's shard of every parameter bit-identical to ``ModelParallelStrategy`` on the same
  mesh, with the same placements; on 2 nodes x 2 also without sequence parallelism (the norms then plain parameters,
  sharded over the data-parallel dimension alone, in the same FSDP units as the 2-D ones);
- the defaults (qwZ INT8, qgZ INT4): every parameter moves, each update within bounds of the exact run's;
- every run: the embedding and the head stay one parameter; the RMSNorms move and stay bit-equal on the two ranks of
  each tensor-parallel group under the defaults, and (2 nodes x 2) with stochastic rounding.
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import DEFAULTS_BOUNDS, EIGHT_RANK_BOUNDS
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import LLAMA, LlamaModule, make_batches
from lightning_zeropp.testing.workers import update_errors, update_problems

pytestmark = pytest.mark.version_sensitive  # FSDP2 and DTensor across versions: run on the oldest torch too

STEPS, BATCH, SEQUENCE, T = 3, 2, 10, 2  # SEQUENCE / T = 5 positions per rank between the matmuls
NORMS = ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
         "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
         "model.norm.weight")  # fmt: skip


def _initial() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in LlamaModule().named_parameters()}


def _fit(rank: int, world: int, strategy, sequence_parallel: bool = True) -> dict:
    """3 steps of :class:`LlamaModule` on ``world`` ranks (t = 2), the Trainer's sampler splitting the data over the
    data-parallel ranks: this rank's shards, the full weights (rank 0), each parameter's placements, whether the head
    is still the embedding, how many parameters the model has."""
    model = LlamaModule(sequence_parallel)
    tokens, targets = make_batches(STEPS * BATCH * (world // T), SEQUENCE, LLAMA["vocab_size"])
    trainer = lightning_trainer(world, strategy, max_steps=STEPS)
    trainer.fit(model, DataLoader(TensorDataset(tokens, targets), batch_size=BATCH, shuffle=False))
    net = model.model
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # collective: every rank
    return {
        "local": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
        "full": full if rank == 0 else None,
        "placements": {n: (p.device_mesh.mesh_dim_names, str(p.placements)) for n, p in model.named_parameters()},
        "tied": net.lm_head.weight is net.embed_tokens.weight,
        "parameters": len(list(model.parameters())),
    }


def _worker(rank: int, world: int, per_node: int, more: bool) -> dict:
    """The runs on one layout; with ``more``, stochastic rounding and the exact runs without sequence parallelism."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.set_num_threads(1)  # up to 8 processes on a small machine
    exact = dict(tensor_parallel_size=T, ranks_per_node=per_node, quantize_weights=False, quantize_gradients=False)
    runs = {
        "reference": _fit(rank, world, ModelParallelStrategy(data_parallel_size=world // T, tensor_parallel_size=T)),
        "exact": _fit(rank, world, ZeroPPStrategy(**exact)),
    }
    strategy = ZeroPPStrategy(tensor_parallel_size=T, ranks_per_node=per_node)
    runs["defaults"] = _fit(rank, world, strategy)
    runs["describe"] = strategy.comms.describe()
    if more:
        stochastic = ZeroPPStrategy(tensor_parallel_size=T, ranks_per_node=per_node, gradient_rounding="stochastic")
        runs["stochastic"] = _fit(rank, world, stochastic)
        reference = ModelParallelStrategy(data_parallel_size=world // T, tensor_parallel_size=T)
        runs["reference_plain"] = _fit(rank, world, reference, sequence_parallel=False)
        runs["exact_plain"] = _fit(rank, world, ZeroPPStrategy(**exact), sequence_parallel=False)
    return runs


@pytest.fixture(scope="module")
def four_ranks():
    """2 nodes x 2, t = 2 (r/t = 1); also stochastic rounding, and the exact runs without sequence parallelism."""
    return spawn(_worker, 4, 2, True, timeout=600)


@pytest.fixture(scope="module")
def eight_ranks():
    """2 nodes x 4, t = 2 (r/t = 2)."""
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 10):
        pytest.skip(
            "torch 2.9: DTensor.full_tensor() of a parameter split unevenly over both dimensions (the vocabulary's 131"
            " rows over 4 x 2) sends mismatched sizes between ranks, under ModelParallelStrategy as under ours"
        )
    return spawn(_worker, 8, 4, False, timeout=900)


# Measured over 3 AdamW steps (lr 1e-2) against ModelParallelStrategy, defaults (qwZ INT8, qgZ INT4, the second-moment
# correction; hpZ off then, on since for 2 nodes x 4, where it gives the backward the forward's weights exactly):
# 2 nodes x 2: whole model 0.569, worst parameter 0.746 (the tied embedding; next the first
# block's post-attention norm 0.671, every other parameter 0.30 to 0.65); 2 nodes x 4: whole 0.587, worst 0.758 (the
# tied embedding; every other parameter 0.11 to 0.60). The whole-model bounds are tests/test_tensor_parallel.py's for
# the same layouts. Its per-parameter bounds (0.65, 0.72) do not hold for the tied embedding, and that is the model's,
# not tensor parallelism's: the same model without it (t = 1, 2 nodes x 1, the strategy's own sharding) measured 0.546
# whole and 0.713 for the embedding. Per parameter 0.85: 1.12x the worst, below 1.0 (what an update of zero scores;
# one of the right size in an unrelated direction scores 1.41). A sampler that splits the data over every rank (2 nodes
# x 2) measured 1.287 whole and above 0.85 on all 20 parameters (1.40 the embedding).
LAYOUTS = {
    "four_ranks": dict(per_parameter=0.85, whole=DEFAULTS_BOUNDS["whole"]),
    "eight_ranks": dict(per_parameter=0.85, whole=EIGHT_RANK_BOUNDS["whole"]),
}
QGZ = {"four_ranks": "qgZ INT4 gradients in one hop across nodes", "eight_ranks": "qgZ INT8 -> INT4 gradients"}


def _bit_identical(results: list[dict], reference: str, exact: str) -> list[str]:
    """What differs between two runs, rank by rank: placements, names, any bit of a shard."""
    problems = []
    for rank, result in enumerate(results):
        want, got = result[reference], result[exact]
        if got["placements"] != want["placements"]:
            problems.append(f"rank {rank}: placements {got['placements']} != {want['placements']}")
        if got["local"].keys() != want["local"].keys() or got["local"].keys() != _initial().keys():
            problems.append(f"rank {rank}: parameters {sorted(got['local'])} != {sorted(want['local'])}")
            continue
        problems += [f"rank {rank}: {n}" for n in want["local"] if not torch.equal(want["local"][n], got["local"][n])]
    return problems


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_llama_is_bit_identical_to_model_parallel_strategy_on_every_rank(layout, request):
    results = request.getfixturevalue(layout)
    assert _bit_identical(results, "reference", "exact") == []
    unmoved = [n for n, p in _initial().items() if torch.equal(p, results[0]["exact"]["full"][n])]
    assert not unmoved, unmoved


@pytest.mark.multiprocess
def test_without_sequence_parallelism_the_exact_llama_is_bit_identical_too(four_ranks):
    """Replicated activations, plain RMSNorms: each block's unit holds 2-D parameters beside 1-D ones."""
    assert _bit_identical(four_ranks, "reference_plain", "exact_plain") == []
    placements = four_ranks[0]["exact_plain"]["placements"]
    assert {placements[n] for n in NORMS} == {(("data_parallel",), "(Shard(dim=0),)")}, placements
    unmoved = [n for n, p in _initial().items() if torch.equal(p, four_ranks[0]["exact_plain"]["full"][n])]
    assert not unmoved, unmoved


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_parameter_is_split_over_the_tensor_parallel_dimension_as_planned(layout, request):
    """Matrices split (colwise: rows, rowwise: columns; the tied embedding and head: vocabulary rows), the RMSNorms
    replicated over the tensor-parallel dimension (SequenceParallel), everything sharded over the data-parallel one."""
    placements = request.getfixturevalue(layout)[0]["exact"]["placements"]
    want = {"embed_tokens": "Shard(dim=0)", "q_proj": "Shard(dim=0)", "k_proj": "Shard(dim=0)",
            "v_proj": "Shard(dim=0)", "o_proj": "Shard(dim=1)", "gate_proj": "Shard(dim=0)",
            "up_proj": "Shard(dim=0)", "down_proj": "Shard(dim=1)", "input_layernorm": "Replicate()",
            "post_attention_layernorm": "Replicate()", "norm": "Replicate()"}  # fmt: skip
    assert placements.keys() == _initial().keys()
    for name, (dims, placement) in placements.items():
        assert dims == ("data_parallel", "tensor_parallel"), (name, dims)
        assert placement.endswith(f", {want[name.split('.')[-2]]})"), (name, placement)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_tied_embedding_stays_one_parameter(layout, request):
    results = request.getfixturevalue(layout)
    initial = _initial()
    assert "model.lm_head.weight" not in initial and len(initial) == 2 + 9 * LLAMA["n_layer"]
    for rank, result in enumerate(results):
        for run in [r for r in result if r != "describe"]:
            assert result[run]["tied"] and result[run]["parameters"] == len(initial), (rank, run)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_defaults_move_every_parameter_and_every_norm_within_the_update_error_bounds(layout, request):
    """Every parameter, the RMSNorms included: moved, by at least half the exact run's update, within the bounds."""
    results = request.getfixturevalue(layout)
    init, reference, state = _initial(), results[0]["reference"]["full"], results[0]["defaults"]["full"]
    assert update_problems(state, reference, init, **LAYOUTS[layout]) == [], update_errors(state, reference, init)
    describe = results[0]["describe"]
    assert "qwZ INT8 weights across 2 nodes" in describe and QGZ[layout] in describe, describe


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "run"), [("four_ranks", "defaults"), ("four_ranks", "stochastic"),
                                             ("eight_ranks", "defaults")])  # fmt: skip
def test_the_norms_move_and_stay_the_same_on_the_ranks_of_a_tensor_parallel_group(layout, run, request):
    """The RMSNorms are replicated over the tensor-parallel dimension: each position of a pair runs its own qwZ and
    qgZ over the data-parallel ranks, and must round their (all-reduced, identical) gradients alike; with stochastic
    rounding that takes the same seeds at both positions. Bit for bit; ``full_tensor`` would not notice a difference
    (it reads one replica)."""
    results = request.getfixturevalue(layout)
    unmoved = [n for n in NORMS if torch.equal(results[0][run]["full"][n], _initial()[n])]
    assert not unmoved, unmoved
    for d in range(len(results) // T):
        pair = [results[d * T + j][run]["local"] for j in range(T)]
        differ = [n for n in NORMS if not all(torch.equal(pair[0][n], other[n]) for other in pair[1:])]
        assert not differ, (d, differ)
