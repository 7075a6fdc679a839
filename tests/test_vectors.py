"""Norm gains and biases reduced exactly beside qgZ (``gradient_quantization_scope="matrices"``): which spans of a
chunk are vectors, that their updates are the exact reduction's while the matrices stay quantized, and that the
planner counts their bytes as the ledger does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zeropp import ZeroPPConfig
from lightning_zeropp.blocks import UnitBlocks
from lightning_zeropp.costs import collective_buffers, step_bytes, units_of
from lightning_zeropp.testing.distributed import spawn
from lightning_zeropp.testing.models import TinyLM
from lightning_zeropp.testing.workers import relative_error, save_inputs, train_worker
from lightning_zeropp.vectors import KIND, RAIL_KIND

pytestmark = pytest.mark.version_sensitive  # FSDP2's parameter layout (compat) and its reduce-scatter hook


def _unit(monkeypatch, params) -> UnitBlocks:
    """A unit whose FSDP parameters are ``params``: ``(sharded parameter, padded shard elements)`` pairs."""
    import lightning_zeropp.blocks as blocks

    monkeypatch.setattr(blocks, "unit_fsdp_parameters", lambda module: params)
    return UnitBlocks(nn.Linear(2, 2), "blocks.0", aligned=True, weight_block_size=256, gradient_block_size=128)


def test_the_spans_are_the_parameters_of_fewer_than_two_dimensions(monkeypatch):
    """A weight, then a gain, a scalar, a matrix and a bias: the gain and the scalar are one span (adjacent), the bias
    another; the dimensions are the parameter's own (global) ones, the sizes its padded shard's."""
    params = [(torch.empty(8, 4), 16), (torch.empty(8), 4), (torch.empty(()), 1), (torch.empty(6, 2), 6)]
    unit = _unit(monkeypatch, [*params, (torch.empty(3), 2)])
    assert unit.vector_spans(29) == ((16, 21), (27, 29))
    assert unit.vector_spans(29) is unit.vector_spans(29)  # made once per chunk length


def test_no_spans_without_vectors_and_none_when_the_layout_is_unknown(monkeypatch):
    """Matrices alone: no span. A chunk whose length is not its parameters' (one received no gradient): None, and
    the reduction quantizes the chunk whole."""
    unit = _unit(monkeypatch, [(torch.empty(8, 4), 16), (torch.empty(2, 2), 2)])
    assert unit.vector_spans(18) == ()
    assert unit.vector_spans(16) is None


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 4), (2, 1), (1, 4)])
def test_the_planner_counts_the_vectors_in_two_hops_in_the_reduce_dtype(nodes, per_node):
    """Per unit, carried by qgZ's two hops (no call of their own): K x V elements of a rank's shard to each of its
    N - 1 node peers, then V to each of its K - 1 rail peers, at the reduce dtype's width (so a vector element crosses
    nodes once per node, not once per rank); a hop with no peer is skipped; no such bytes where every gradient is
    quantized, or reduced exactly."""
    model = TinyLM()
    model.configure_model()
    units = units_of(model)
    W = nodes * per_node
    vectors = sum(u.vector_shard(W) for u in units)
    assert 0 < vectors < sum(sum(u.shards(W)) for u in units) // 10
    on = ZeroPPConfig(ranks_per_node=per_node, gradient_quantization_scope="matrices")
    for precision, width in (("32-true", 4), ("bf16-mixed", 2)):
        planned = step_bytes(units, on, W, per_node, 0, precision)
        if nodes == 1:  # one node: gradients are reduced exactly, no vector apart
            assert KIND not in planned
            continue
        intra, inter, calls = planned[KIND]
        assert intra == (per_node - 1) * nodes * vectors * width
        assert inter == (nodes - 1) * vectors * width
        assert calls == 0  # carried by qgZ's own all-to-alls: bytes, not a collective's latency
        assert planned["gradient_all_to_all_inter"][2] > 0
    off = ZeroPPConfig(ranks_per_node=per_node, gradient_quantization_scope="all")
    assert KIND not in step_bytes(units, off, W, per_node, 0)
    exact = ZeroPPConfig(ranks_per_node=per_node, gradient_quantization_scope="matrices", quantize_gradients=False)
    assert KIND not in step_bytes(units, exact, W, per_node, 0)
    if nodes > 1:
        assert collective_buffers(units, on, W, per_node) > collective_buffers(units, off, W, per_node)


def test_the_plan_reduces_vectors_exactly_only_with_parameter_aligned_blocks():
    """Flat blocks can hold a vector's and a matrix's elements together (their spans are not whole blocks), so the
    ablation quantizes every gradient, and the startup line says which runs."""
    from lightning_zeropp.commplan import resolve
    from lightning_zeropp.topology import Topology

    topology = Topology(8, 2, 0, 2)
    for alignment, exact in (("parameter", True), ("flat", False)):
        for kwargs in ({}, {"sharding_strategy": "HYBRID_SHARD"}):
            config = ZeroPPConfig(ranks_per_node=2, block_alignment=alignment, gradient_quantization_scope="matrices",
                                  **kwargs)  # fmt: skip
            plan = resolve(config, topology)
            assert plan.gradients.exact_vectors is exact, (alignment, kwargs)
            assert ("norm gains and biases exact" in plan.describe()) is exact, plan.describe()
    assert not resolve(ZeroPPConfig(), topology).gradients.exact_vectors  # the default in 1-D: every gradient quantized


def test_auto_reduces_vectors_exactly_where_tensor_parallelism_runs():
    """The default, "auto": "matrices" with a tensor-parallel dimension, "all" without one; the startup line says so.
    Set outright, either scope holds whatever the tensor-parallel size (and flat blocks quantize every gradient)."""
    from lightning_zeropp.commplan import job_topology, resolve

    def plan(world: int, t: int, **kwargs):
        config = ZeroPPConfig(tensor_parallel_size=t, **kwargs)
        return resolve(config, job_topology(config, world, 4, 0), "32-true")

    assert ZeroPPConfig().gradient_quantization_scope == "auto"
    for world, t, kwargs, exact in [
        (8, 1, {}, False), (8, 2, {}, True), (8, 4, {}, True), (16, 2, {}, True),
        (8, 2, {"gradient_quantization_scope": "all"}, False),
        (8, 1, {"gradient_quantization_scope": "matrices"}, True),
        (8, 2, {"block_alignment": "flat"}, False),
    ]:  # fmt: skip
        p = plan(world, t, **kwargs)
        assert p.gradients.exact_vectors is exact, (world, t, kwargs)
        assert ("norm gains and biases exact" in p.describe()) is exact, p.describe()


def _worker(rank, world, configs, *args):
    return {name: train_worker(rank, world, kwargs, *args) for name, kwargs in configs.items()}


def _one_step_each(tmp_path, world: int, base: dict) -> tuple[list[dict], dict[str, dict]]:
    """One SGD step of TinyLM from the same start under ``base`` three ways (gradients exact, norm gains and biases
    exact, every gradient quantized), checked per parameter against the exact run's update: every vector's the exact
    one's to float rounding with ``"matrices"``, no matrix's, and with ``"all"`` the vectors carry the rounding (what
    makes the first check able to fail). Returns every rank's runs and the configurations."""
    init_path, data_path, *_ = save_inputs(tmp_path, world * 2)
    configs = {
        "exact": dict(base, quantize_gradients=False),
        "matrices": dict(base, gradient_quantization_scope="matrices"),
        "all": dict(base, gradient_quantization_scope="all"),
    }
    results = spawn(_worker, world, configs, init_path, data_path, 2, 1)
    init = {f"net.{k}": v for k, v in torch.load(init_path).items()}
    states = {name: results[0][name]["state"] for name in configs}
    exact = states["exact"]

    def errors(name: str, vectors: bool) -> list[float]:
        return [relative_error(states[name][n] - init[n], exact[n] - init[n])
                for n in exact if (exact[n].dim() < 2) == vectors and not torch.equal(exact[n], init[n])]  # fmt: skip

    assert errors("matrices", vectors=True) and max(errors("matrices", vectors=True)) < 1e-6
    assert min(errors("matrices", vectors=False)) > 1e-4
    assert max(errors("all", vectors=True)) > 1e-3
    return results, configs


@pytest.mark.multiprocess
@pytest.mark.parametrize(("nodes", "per_node"), [(3, 2), (2, 1)], ids=["3x2", "2x1"])
def test_vectors_take_the_exact_reduction_and_matrices_stay_quantized(tmp_path, nodes, per_node):
    """TinyLM, 3 nodes x 2 (both hops; K != N, so rows regrouped the wrong way round land on the wrong rank) and 2 x 1
    (the rail alone), weights gathered exactly (so the first step's gradients are the exact run's), one SGD step: with
    ``"matrices"`` every norm gain's and bias's update is the exact reduction's to float rounding, and every matrix's
    is not (qgZ still quantizes it); with ``"all"`` the vectors carry INT4's error (what makes the first check able to
    fail). The ledger's vector bytes are the planner's, on every rank."""
    world = nodes * per_node
    base = dict(ranks_per_node=per_node, quantize_weights=False, hpz_partition_size=1)
    results, configs = _one_step_each(tmp_path, world, base)
    model = TinyLM()
    model.configure_model()
    units = units_of(model)
    for rank, r in enumerate(results):
        assert not r["matrices"]["unaligned_blocks"]
        planned = step_bytes(units, ZeroPPConfig(**configs["matrices"]), world, per_node, rank, "32-true")[KIND]
        assert tuple(r["matrices"]["ledger"][KIND]) == planned
        assert KIND not in r["all"]["ledger"] and KIND not in r["exact"]["ledger"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_quantized_hsdp_takes_the_vectors_off_its_rail_too(tmp_path, nodes, per_node):
    """Quantized HSDP, ``nodes`` nodes of ``per_node`` ranks (one rank per node: the path FSDP's all-reduce hook
    takes; 3 nodes: the vectors' parts are uneven), one SGD step: with ``"matrices"`` the vectors' updates are exact
    HSDP's to float rounding and the matrices' are not; with ``"all"`` the vectors carry the rail's rounding. The
    vectors' all-reduce bytes are the planner's."""
    world = nodes * per_node
    base = dict(ranks_per_node=per_node, sharding_strategy="HYBRID_SHARD", quantize_weights=False)
    results, configs = _one_step_each(tmp_path, world, base)
    model = TinyLM()
    model.configure_model()
    units = units_of(model)
    for rank, r in enumerate(results):
        planned = step_bytes(units, ZeroPPConfig(**configs["matrices"]), world, per_node, rank, "32-true")
        assert tuple(r["matrices"]["ledger"][RAIL_KIND]) == planned[RAIL_KIND]
        assert RAIL_KIND not in r["all"]["ledger"]


@pytest.mark.multiprocess
def test_vectors_beside_error_feedback_and_rotation_in_bf16(tmp_path):
    """Norm gains and biases exact beside error feedback, rotated blocks and stochastic rounding, bf16-mixed (the
    vectors reduced in bf16, FSDP's reduce dtype), 3 nodes x 2, three steps: every rank's ledger is the planner's,
    step by step (the vectors' two hops included), no unit fell back to flat blocks, and the losses stay finite."""
    world, batch, steps = 6, 2, 3
    init_path, data_path, *_ = save_inputs(tmp_path, world * batch * steps)
    kwargs = dict(ranks_per_node=2, gradient_error_feedback=True, gradient_rotation="hadamard",
                  gradient_rounding="stochastic", gradient_quantization_scope="matrices")  # fmt: skip
    results = spawn(train_worker, world, kwargs, init_path, data_path, batch, steps, "bf16-mixed")
    model = TinyLM()
    model.configure_model()
    units = units_of(model)
    for rank, r in enumerate(results):
        assert not r["unaligned_blocks"] and all(torch.isfinite(torch.tensor(r["losses"])))
        planned = step_bytes(units, ZeroPPConfig(**kwargs), world, 2, rank, "bf16-mixed")
        assert planned[KIND][0] > 0 and planned[KIND][1] > 0
        for kind, per_step in planned.items():
            assert tuple(r["ledger"][kind]) == tuple(steps * v for v in per_step), (rank, kind)
        assert set(r["ledger"]) == set(planned)


def test_a_bad_scope_is_refused_in_one_line_naming_the_choices():
    with pytest.raises(ValueError, match=r"`gradient_quantization_scope='vectors'` is not allowed; choose one of"):
        ZeroPPConfig(gradient_quantization_scope="vectors")


def _carriage_worker(rank, world, per_node, pieces, dtype):
    """One qgZ reduce-scatter of a chunk laid out as a few parameters (matrices and vectors), with and without the
    vectors carried: this rank's output both ways and the exact (fp64) reduction of its chunk."""
    import torch.distributed as dist

    from lightning_zeropp import kernels as tk
    from lightning_zeropp.commplan import two_hop
    from lightning_zeropp.ledger import CommLedger
    from lightning_zeropp.qgz import Reduction, quantized_reduce_scatter
    from lightning_zeropp.topology import ProcessGroups, Topology

    dist.init_process_group("gloo")
    topology = Topology(world, per_node, rank)
    groups = ProcessGroups.build(topology)
    # a weight, a gain and a bias (adjacent: one span), a weight, a bias, a weight, a lone scalar: odd sizes
    segments, is_vector = [300, 7, 5, 259, 13, 140, 1], [False, True, True, False, True, False, True]
    spans, at = [], 0
    for size, vector in zip(segments, is_vector, strict=True):
        if vector and spans and spans[-1][1] == at:
            spans[-1] = (spans[-1][0], at + size)
        elif vector:
            spans.append((at, at + size))
        at += size
    chunk = sum(segments)
    every = []
    for r in range(world):
        g = torch.Generator().manual_seed(7 + r)
        scales = torch.logspace(-2, 1, world * chunk, dtype=torch.float64)[torch.randperm(world * chunk, generator=g)]
        every.append((torch.randn(world * chunk, generator=g, dtype=torch.float64) * scales).to(dtype))
    exact = sum(e.double().view(world, chunk)[rank] for e in every) / world
    config = ZeroPPConfig(ranks_per_node=per_node, gradient_pieces=pieces)
    blocks = tk.Blocks.of_segments(segments, 128)
    outputs, noise = {}, {}
    for name, vectors in (("carried", tuple(spans)), ("quantized", ())):
        reduction = Reduction.of(topology, two_hop(config), chunk, dist.ReduceOp.AVG, None, blocks=blocks,
                                 backend="torch")  # fmt: skip
        out, noise[name] = torch.empty(chunk, dtype=dtype), torch.zeros(blocks.count)
        quantized_reduce_scatter(out, every[rank].clone(), reduction, groups, CommLedger(topology),
                                 noise=noise[name], vectors=vectors)  # fmt: skip
        outputs[name] = out
    dist.destroy_process_group()
    return {"spans": spans, "exact": exact, "starts": blocks.starts, "noise": noise, **outputs}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("nodes", "per_node", "pieces", "dtype"),
    [(3, 2, 3, torch.bfloat16), (2, 2, 1, torch.float32), (3, 1, 2, torch.float32), (1, 4, 2, torch.float32)],
    ids=["3x2-3-pieces-bf16", "2x2-1-piece", "3x1-rail-alone", "1x4-node-alone"],
)
def test_the_carriage_reduces_the_spans_exactly_and_leaves_the_matrices_alone(nodes, per_node, pieces, dtype):
    """qgZ's reduce-scatter alone on gloo ranks, in each layout its hops take (both hops, the rail alone, the node
    alone), with the spans of several vectors in different pipeline stages: on every rank, the spans of the output
    are the exact mean to the dtype's rounding (INT4 or INT8 misses them by far more: the check can fail), and every
    other element is bit for bit what qgZ gives without the carriage (zeroed spans change no other block)."""
    world = nodes * per_node
    results = spawn(_carriage_worker, world, per_node, pieces, dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for rank, r in enumerate(results):
        on = torch.zeros(r["exact"].numel(), dtype=torch.bool)
        for a, b in r["spans"]:
            on[a:b] = True
        exact = r["exact"][on]

        def error(out: torch.Tensor, exact: torch.Tensor = exact) -> float:
            return float((out.double() - exact).norm() / exact.norm())

        assert error(r["carried"][on]) < tolerance, (rank, error(r["carried"][on]))
        assert error(r["quantized"][on]) > 3 * tolerance, (rank, error(r["quantized"][on]))
        assert torch.equal(r["carried"][~on], r["quantized"][~on]), rank
        # the second-moment correction's noise: none from the vectors' blocks (their spans were zeroed before
        # quantization), the matrices' blocks as without the carriage (the rail's INT4 hop adds it; no rail, no noise)
        vector_block = torch.tensor([bool(on[a]) for a in r["starts"][:-1]])
        carried, quantized = r["noise"]["carried"], r["noise"]["quantized"]
        assert torch.all(carried[vector_block] == 0), rank
        assert torch.equal(carried[~vector_block], quantized[~vector_block]), rank
        assert bool((quantized[vector_block] > 0).all()) == (nodes > 1), rank
