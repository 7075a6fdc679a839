"""Tensor-parallel bytes in the communication ledger: the model's plan's collectives, counted apart, on request.

Fast tier: the byte accounting of each collective on made-up calls (per peer, the ledger's convention), the split
into same-node and other-node peers by the job's rank numbers, the totals staying data-parallel, the metrics, the
switch and the watch itself (a dispatch mode on plain tensors: it sees what it is handed and changes nothing).

Spawned (2 nodes x 2 ranks, t = 2, :class:`~lightning_zeropp.testing.models.LlamaModule` for 2 steps, exact
collectives): with ``CommVolumeMonitor`` attached, the tensor-parallel kinds hold exactly the bytes the plan's shapes
give (worked out below from the shapes, not from the product code), all of them inside the node; the data-parallel
ledger is the same as in the run without counting; the weights are bit-identical to the run without counting and to
ModelParallelStrategy's; without the monitor nothing tensor-parallel is counted.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import CommVolumeMonitor, ZeroPPStrategy
from lightning_zeropp.compat.funcol import Collective, CollectiveWatch
from lightning_zeropp.ledger import KINDS, TENSOR_PARALLEL_KINDS, CommLedger, all_reduce_chunks
from lightning_zeropp.tensor_parallel_comms import peer_bytes
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import LLAMA, LlamaModule, make_batches
from lightning_zeropp.topology import Topology


# ------------------------------------------------------------------------------------------------ fast: accounting
def test_each_collective_counts_per_peer_with_the_ledger_convention():
    # an fp32 all-gather of 6 elements: the 24-byte buffer to every member
    assert peer_bytes(Collective("all_gather", "g", ((6, 4),)), 4, 1) == [24, 24, 24, 24]
    # a bf16 reduce-scatter of 8 elements over 4: 2 elements (4 bytes) to each member
    assert peer_bytes(Collective("reduce_scatter", "g", ((8, 2),)), 4, 0) == [4, 4, 4, 4]
    # an all-to-all of 3 rows of 5 fp32 elements, rows (2, 0, 1): 40, 0 and 20 bytes
    assert peer_bytes(Collective("all_to_all", "g", ((15, 4),), (2, 0, 1)), 3, 2) == [40, 0, 20]
    assert peer_bytes(Collective("all_to_all", "g", ((12, 4),)), 3, 0) == [16, 16, 16]
    # an all-reduce of 10 fp32 over 4: pieces of 2, 3, 2, 3 elements; member i gets piece i and, as 1's piece
    # (3 elements) goes to every member, 12 bytes more: HSDP's gradient_all_reduce convention
    assert peer_bytes(Collective("all_reduce", "g", ((10, 4),)), 4, 1) == [20, 24, 20, 24]
    # a coalesced call: the inputs add up
    assert peer_bytes(Collective("all_gather", "g", ((6, 4), (1, 2))), 2, 0) == [26, 26]


def test_all_reduce_convention_is_hsdp_s():
    """The rail's exact all-reduce (quantized HSDP after its quantized steps) records the same chunks."""
    from lightning_zeropp.rail import record_exact

    topology = Topology(world_size=4, ranks_per_node=1, rank=1)  # 4 nodes: the rail is every rank
    ledger = CommLedger(topology)
    record_exact(torch.zeros(10), topology, ledger)
    assert ledger.total("gradient_all_reduce").inter_node_bytes == sum(all_reduce_chunks(10, 4, 4, 1)) - 24 == 64


def test_tensor_parallel_records_split_by_the_job_s_nodes_and_stay_out_of_the_totals():
    # 2 nodes x 4 ranks, t = 2: global rank 5 is data-parallel rank 2 (node 1) at position 1
    topology = Topology.of_job(8, 4, 5, tensor_parallel_size=2)
    ledger = CommLedger(topology)
    ledger.record_to_peers("gradient_reduce_scatter", [0, 1, 2, 3], 100)  # data-parallel: ranks 0, 1 on node 0
    ledger.record_tensor_parallel("tensor_parallel_all_gather", [4, 5], [7, 7])
    ledger.record_tensor_parallel("tensor_parallel_all_to_all", [2, 3, 4, 5], [1, 2, 3, 4])  # made up: across nodes
    assert (ledger.total().intra_node_bytes, ledger.total().inter_node_bytes) == (100, 200)
    assert ledger.inter_node_bytes == 200 and ledger.intra_node_bytes == 100
    assert set(ledger.by_kind()) == {"gradient_reduce_scatter"}
    tp = ledger.tensor_parallel_by_kind()
    assert (tp["tensor_parallel_all_gather"].intra_node_bytes, tp["tensor_parallel_all_gather"].inter_node_bytes) == (
        7,
        0,
    )
    assert (tp["tensor_parallel_all_to_all"].intra_node_bytes, tp["tensor_parallel_all_to_all"].inter_node_bytes) == (
        3,
        3,
    )
    assert ledger.tensor_parallel_total().total_bytes == 13 and ledger.tensor_parallel_step().calls == 2
    with pytest.raises(KeyError, match="tensor-parallel"):
        ledger.record_tensor_parallel("gradient_reduce_scatter", [4, 5], [1, 1])


def test_metrics_report_tensor_parallel_totals_apart_only_while_counting():
    ledger = CommLedger(Topology.of_job(4, 2, 0, tensor_parallel_size=2))
    ledger.record_all_gather("weight_all_gather", [0, 1], 2_000_000)  # data-parallel ranks 0 (node 0), 1 (node 1)
    ledger.record_tensor_parallel("tensor_parallel_all_reduce", [0, 1], [3_000_000, 3_000_000])
    assert ledger.step_metrics(restart=False) == {"comm/inter_node_MB": 2.0, "comm/intra_node_MB": 0.0}
    ledger.counts_tensor_parallel = True
    assert ledger.step_metrics(per_kind=True, restart=False) == {
        "comm/inter_node_MB": 2.0,
        "comm/intra_node_MB": 0.0,
        "comm/tensor_parallel/inter_node_MB": 0.0,
        "comm/tensor_parallel/intra_node_MB": 3.0,
        "comm/weight_all_gather/inter_node_MB": 2.0,
        "comm/weight_all_gather/intra_node_MB": 0.0,
        "comm/tensor_parallel_all_reduce/inter_node_MB": 0.0,
        "comm/tensor_parallel_all_reduce/intra_node_MB": 3.0,
    }
    assert not set(KINDS) & set(TENSOR_PARALLEL_KINDS)


def test_the_monitor_logs_tensor_parallel_totals_with_the_totals():
    from types import SimpleNamespace

    ledger = CommLedger(Topology.of_job(2, 2, 0, tensor_parallel_size=2))
    ledger.counts_tensor_parallel = True
    logged = []
    module = SimpleNamespace(automatic_optimization=True, log_dict=lambda m, **kw: logged.append(dict(m)))
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(comm_ledger=ledger))
    monitor = CommVolumeMonitor(per_kind=True, unit="B")
    monitor.on_train_start(trainer, module)
    monitor.on_train_batch_start(trainer, module, None, 0)
    ledger.record_tensor_parallel("tensor_parallel_all_gather", [0, 1], [5, 5])
    trainer.global_step = 1
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    totals, per_kind = logged
    assert totals == {"comm/inter_node_B": 0, "comm/intra_node_B": 0, "comm/tensor_parallel/inter_node_B": 0,
                      "comm/tensor_parallel/intra_node_B": 5}  # fmt: skip
    assert per_kind == {"comm/tensor_parallel_all_gather/inter_node_B": 0,
                        "comm/tensor_parallel_all_gather/intra_node_B": 5}  # fmt: skip


def test_the_switch_is_validated_and_returns_the_previous_setting():
    strategy = ZeroPPStrategy()
    assert strategy.count_tensor_parallel_bytes() is False and strategy.count_tensor_parallel_bytes(False) is True
    with pytest.raises(TypeError, match="`enabled` must be True or False"):
        strategy.count_tensor_parallel_bytes("yes")


def test_the_watch_sees_plain_operators_and_changes_nothing():
    seen = []
    x = torch.randn(5, 3)
    with CollectiveWatch(seen.append):
        y = (x @ x.T).softmax(-1)
    assert torch.equal(y, (x @ x.T).softmax(-1)) and seen == []


# ------------------------------------------------------------------------------------------------ spawned
STEPS, BATCH, SEQUENCE, T, WORLD, PER_NODE = 2, 2, 10, 2, 4, 2


def _fit(world: int, strategy, monitor: bool, sequence_parallel: bool) -> dict:
    model = LlamaModule(sequence_parallel)
    tokens, targets = make_batches(STEPS * BATCH * (world // T), SEQUENCE, LLAMA["vocab_size"])
    callbacks = [CommVolumeMonitor(per_kind=True)] if monitor else []
    trainer = lightning_trainer(world, strategy, max_steps=STEPS, callbacks=callbacks)
    trainer.fit(model, DataLoader(TensorDataset(tokens, targets), batch_size=BATCH, shuffle=False))
    out = {"local": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}
    if isinstance(strategy, ZeroPPStrategy):
        ledger = strategy.comm_ledger
        key = lambda t: (t.intra_node_bytes, t.inter_node_bytes, t.calls)  # noqa: E731
        out["data_parallel"] = {k: key(t) for k, t in ledger.by_kind().items()}
        out["tensor_parallel"] = {k: key(t) for k, t in ledger.tensor_parallel_by_kind().items()}
        out["switch_after"] = strategy.count_tensor_parallel_bytes(False)
    return out


def _worker(rank: int, world: int) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    exact = dict(tensor_parallel_size=T, ranks_per_node=PER_NODE, quantize_weights=False, quantize_gradients=False)
    runs = {}
    for sp in (False, True):
        name = "sp" if sp else "plain"
        reference = ModelParallelStrategy(data_parallel_size=world // T, tensor_parallel_size=T)
        runs[f"{name}/reference"] = _fit(world, reference, False, sp)
        runs[f"{name}/counted"] = _fit(world, ZeroPPStrategy(**exact), True, sp)
        runs[f"{name}/off"] = _fit(world, ZeroPPStrategy(**exact), False, sp)
    return runs


@pytest.fixture(scope="module")
def runs():
    return spawn(_worker, WORLD, timeout=600)


# The plan's traffic per step, worked out from the shapes (fp32, 4 bytes; t = 2, so each rank's one peer is the other
# rank of its pair, on its node). Activations: batch 2 x sequence 10 x width 48 = 960 values, 3840 bytes. Logits:
# the head's output is split over the vocabulary, 131 = 66 + 65 rows: DTensor pads each piece to 66 columns before it
# gathers them, 2 x 10 x 66 = 1320 values, 5280 bytes. An all-reduce of n values over 2 counts n / 2 (the peer's
# piece) + n / 2 (this rank's piece, gathered) per peer: 3840 bytes for the activation, all-reduced or not.
L, ACTIVATION, LOGITS = LLAMA["n_layer"], 2 * 10 * 48 * 4, 2 * 10 * 66 * 4
assert (BATCH, SEQUENCE, LLAMA["dim"]) == (2, 10, 48) and -(-LLAMA["vocab_size"] // T) == 66
# Without sequence parallelism (Megatron's layout): forward, the embedding's output (rows of the vocabulary: a partial
# sum) and each block's o_proj and down_proj outputs are all-reduced: 1 + 2 L; backward, the gradients of the inputs
# of each block's attention and MLP (q/k/v and gate/up, colwise) and of the head: 2 L + 1. The logits are gathered
# once in forward (their gradient is only cut in backward).
PLAIN = {
    "tensor_parallel_all_reduce": (STEPS * 2 * (2 * L + 1) * ACTIVATION, 0, STEPS * 2 * (2 * L + 1)),
    "tensor_parallel_all_gather": (STEPS * LOGITS, 0, STEPS),
}
# With sequence parallelism the residual stream is split along the sequence (5 positions each): every all-reduce
# above becomes a reduce-scatter (the peer's half of the activation, 1920 bytes) and, where the activation enters a
# block's matmuls or the head, an all-gather of this rank's half (1920 bytes). Forward: reduce-scatters at the
# embedding, o_proj and down_proj (1 + 2 L), all-gathers into attention, MLP and head (2 L + 1) and of the logits;
# backward the reverse of each: reduce-scatters of the input gradients of attention, MLP and head (2 L + 1),
# all-gathers of the output gradients of o_proj, down_proj and the embedding (2 L + 1). The RMSNorm weights are
# replicated over the pair and each rank's gradient covers its half of the sequence: each of the 2 L + 1 norms'
# 48-value gradients is all-reduced (2 x 24 values: 192 bytes per peer).
HALF, NORM = ACTIVATION // 2, 48 * 4
SEQUENCE_PARALLEL = {
    "tensor_parallel_reduce_scatter": (STEPS * 2 * (2 * L + 1) * HALF, 0, STEPS * 2 * (2 * L + 1)),
    "tensor_parallel_all_gather": (STEPS * (2 * (2 * L + 1) * HALF + LOGITS), 0, STEPS * (2 * (2 * L + 1) + 1)),
    "tensor_parallel_all_reduce": (STEPS * (2 * L + 1) * NORM, 0, STEPS * (2 * L + 1)),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "expected"), [("plain", PLAIN), ("sp", SEQUENCE_PARALLEL)])
def test_the_plan_s_bytes_are_counted_exactly_inside_the_node(runs, layout, expected):
    for rank, result in enumerate(runs):
        assert result[f"{layout}/counted"]["tensor_parallel"] == expected, rank


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["plain", "sp"])
def test_counting_changes_neither_the_weights_nor_the_data_parallel_ledger(runs, layout):
    for rank, result in enumerate(runs):
        counted, off, reference = (result[f"{layout}/{r}"] for r in ("counted", "off", "reference"))
        assert counted["data_parallel"] == off["data_parallel"] and counted["data_parallel"], rank
        assert off["tensor_parallel"] == {}, rank  # without the monitor nothing tensor-parallel is counted
        for name, value in reference["local"].items():
            assert torch.equal(counted["local"][name], value), (rank, name)
            assert torch.equal(off["local"][name], value), (rank, name)
        # the monitor switched counting on for its run and back off after it
        assert counted["switch_after"] is False and off["switch_after"] is False, rank


def test_the_watch_hands_dtensor_operators_back_to_dtensor():
    """DTensor desugars first (on torch 2.13 it runs before the mode anyway; the spawned runs cannot show this)."""
    from torch.distributed.tensor import DTensor

    seen = []
    watch = CollectiveWatch(seen.append)
    assert watch.__torch_dispatch__(torch.ops.aten.add.Tensor, (DTensor,), (1, 2)) is NotImplemented
    assert watch.__torch_dispatch__(torch.ops.aten.add.Tensor, (), (torch.ones(1), torch.ones(1))).item() == 2
