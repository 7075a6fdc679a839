"""Quantized HSDP (``sharding_strategy="HYBRID_SHARD"``, ``quantize_gradients=True``, registered as ``"qhsdp"``): the
replicas of every rail stay bit-identical (weights and optimizer state), each parameter's update stays near one
process's, the rail's INT4 reduce-scatter and INT8 / bf16 all-gather send the bytes the shapes give, the rail turns
exact after ``quantize_gradients_steps``, error feedback keeps the residuals a hand count gives and a resume continues
them exactly, checkpoints cross to exact HSDP and ZeRO-3 and back, and one node trains as exact HSDP.

Each spawn runs several trainings in its ranks (a spawn costs more than a run); the faults a check must catch are
injected in the ranks' own processes (``pytest.MonkeyPatch``), never into the package's files."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPConfig, ZeroPPStrategy
from lightning_zeropp import kernels as tk
from lightning_zeropp.core import HSDP_ARGUMENTS, QUANTIZED_HSDP_ARGUMENTS
from lightning_zeropp.testing.distributed import lightning_trainer, spawn
from lightning_zeropp.testing.models import TinyLM
from lightning_zeropp.testing.workers import (
    full_state,
    ledger_table,
    padded_shard_numel,
    reference_training,
    relative_error,
    save_inputs,
    update_errors,
    update_problems,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.version_sensitive]

BATCH, STEPS = 2, 3
QHSDP = dict(QUANTIZED_HSDP_ARGUMENTS)
HSDP = dict(HSDP_ARGUMENTS)
ZERO3 = dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False)
# every rail technique on: residuals in INT8, rotated blocks, stochastic rounding (its seeds count reductions)
FEEDBACK = dict(gradient_error_feedback=True, gradient_rotation="hadamard", gradient_rounding="stochastic")
RAIL_KINDS = ("gradient_rail_reduce_scatter", "gradient_rail_all_gather")
INTRA_KINDS = ("weight_all_gather", "weight_all_gather_backward", "gradient_reduce_scatter")


# ------------------------------------------------------------------------------------------------ by hand
def unit_segments(per_node: int) -> list[list[int]]:
    """Per FSDP unit of TinyLM (each block, then the root), each parameter's padded shard over ``per_node`` ranks, in
    the unit's flat-buffer order: every parameter is trained, so the gradient buffer holds them all."""
    model = TinyLM()
    model.configure_model()
    blocks = list(model.net.blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [list(b.parameters()) for b in blocks]
    units.append([p for p in model.parameters() if id(p) not in in_blocks])  # the tied head counted once
    return [[padded_shard_numel(p.shape, per_node) for p in unit] for unit in units]


def rail_pieces(segments: list[int], nodes: int, block: int = 128) -> list[tuple[int, int, tk.Blocks | None]]:
    """The shard cut into one piece per node at parameter-aligned block boundaries (``start``, ``size``, blocks)."""
    pieces = tk.cut_pieces(sum(segments), nodes, block, tk.Blocks.of_segments(segments, block))
    starts = [start for start, _, _ in pieces]
    assert starts[0] == 0 and all(s + n == t for (s, n, _), t in zip(pieces, starts[1:] + [sum(segments)]))
    return pieces


def piece_wire(piece: tuple[int, int, tk.Blocks | None], bits: int) -> int:
    """Bytes of a piece on the wire: bf16 (2 per element), or a quantized row of its blocks; 0 when empty."""
    _, size, blocks = piece
    if not size:
        return 0
    return 2 * size if bits == 16 else blocks.wire_size(bits)


def expected_ledger(nodes: int, per_node: int, steps: int, gather_bits: int) -> list[dict[str, tuple[int, int, int]]]:
    """Per rank, the ledger of ``steps`` quantized HSDP steps: the exact gathers and reduce-scatter inside the node
    (fp32), and per unit on the rail: the INT4 pieces this rank sends to the other nodes' owners, and its own reduced
    piece (INT8 or bf16) to each of the other ``nodes - 1`` rail ranks."""
    units = unit_segments(per_node)
    own = sum(4 * sum(u) for u in units)
    out = []
    for rank in range(nodes * per_node):
        node = rank // per_node
        reduce_bytes = gather_bytes = 0
        for segments in units:
            pieces = rail_pieces(segments, nodes)
            reduce_bytes += sum(piece_wire(p, 4) for k, p in enumerate(pieces) if k != node)
            gather_bytes += (nodes - 1) * piece_wire(pieces[node], gather_bits)
        intra = (steps * own * (per_node - 1), 0, steps * len(units))
        row = dict.fromkeys(INTRA_KINDS, intra)
        row["gradient_rail_reduce_scatter"] = (0, steps * reduce_bytes, steps * len(units))
        row["gradient_rail_all_gather"] = (0, steps * gather_bytes, steps * len(units))
        out.append(row)
    return out


def exact_all_reduce_bytes(nodes: int, per_node: int, rank: int) -> int:
    """Cross-node bytes of one step of exact HSDP's all-reduce on ``rank``'s rail (fp32; a reduce-scatter in one piece
    per node, as even as whole elements allow, then an all-gather of this rank's piece), as test_hsdp counts them."""
    node, total = rank // per_node, 0
    for segments in unit_segments(per_node):
        s = sum(segments)
        pieces = [4 * (s * (i + 1) // nodes - s * i // nodes) for i in range(nodes)]
        total += sum(p + pieces[node] for i, p in enumerate(pieces) if i != node)
    return total


def feedback_bytes(nodes: int, per_node: int) -> int:
    """What the INT8 residuals of the rail take on a rank: per unit, one row per piece it sends (all K, its own
    included), each piece's codes padded to 16 bytes and one fp32 scale per block of the piece."""
    total = 0
    for segments in unit_segments(per_node):
        for _, size, blocks in rail_pieces(segments, nodes):
            if size:
                total += -(-size // 16) * 16 + 4 * blocks.count
    return total


# ------------------------------------------------------------------------------------------------ faults
def _around_the_rail(mp: pytest.MonkeyPatch, change) -> None:
    """Runs every rail all-reduce with ``change(plan, kernels)`` patched in for that call: ``kernels`` holds the real
    ``dequantize_reduce``; ``change`` returns the one to use, and a function to run on ``(shard, plan)`` after."""
    from lightning_zeropp import rail

    real_all_reduce, real_reduce = rail.all_reduce, rail.tk.dequantize_reduce

    def all_reduce(shard, plan, group, ledger, residuals=None, gather_residual=None, vectors=()):
        reduce, after = change(plan, real_reduce)
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(rail.tk, "dequantize_reduce", reduce)
            real_all_reduce(shard, plan, group, ledger, residuals, gather_residual, vectors)
        after(shard, plan)

    mp.setattr(rail, "all_reduce", all_reduce)


def _owner_keeps_its_sum(mp: pytest.MonkeyPatch) -> None:
    """The fault the replica check must catch: the owner of a piece keeps its fp32 sum instead of reading back the
    rounded value it sent (the other replicas hold the rounded one)."""

    def change(plan, real_reduce):
        kept = []

        def keep(*args, **kwargs):
            kept.append(real_reduce(*args, **kwargs))
            return kept[-1]

        def after(shard, plan):
            if kept:
                mine = plan.mine
                shard.view(-1)[mine.start : mine.start + mine.size].copy_(kept[-1].view(-1))

        return keep, after

    _around_the_rail(mp, change)


def _own_node_only(mp: pytest.MonkeyPatch) -> None:
    """A fault the accuracy bound must catch: the owner reduces its own node's copy of its piece alone (the other
    nodes' copies arrive and are dropped), so each piece of the gradient is one node's."""

    def change(plan, real_reduce):
        node = plan.topology.node

        def one_row(received, size, bits, block, multiplier, **kwargs):
            return real_reduce(received[node : node + 1], size, bits, block, multiplier=1.0, **kwargs)

        return one_row, lambda shard, plan: None

    _around_the_rail(mp, change)


def _scale_forgotten(mp: pytest.MonkeyPatch) -> None:
    """A fault the accuracy bound must catch: the sum of the K nodes' pieces is not divided by K."""
    from lightning_zeropp import rail

    real = rail.RailReduction.of.__func__

    def of(cls, topology, gradients, shard, blocks, multiplier, call, backend):
        return real(cls, topology, gradients, shard, blocks, multiplier * topology.num_nodes, call, backend)

    mp.setattr(rail.RailReduction, "of", classmethod(of))


def _rotation_per_rank(mp: pytest.MonkeyPatch) -> None:
    """A fault only the accuracy bound can catch: each rank rotates the pieces it sends in a basis of its own (its
    rank in the seed, as stochastic rounding's seed has it), so the owner sums K copies rotated K ways and undoes one.
    The owner still sends every replica the same bits: the replica check sees nothing."""
    from lightning_zeropp import rail

    real = rail.RailReduction.rotation_seed

    def rotation_seed(self, piece):
        seed = real(self, piece)
        return None if seed is None else hash((seed, self.topology.rank)) & 0x7FFFFFFF

    mp.setattr(rail.RailReduction, "rotation_seed", rotation_seed)


FAULTS = {
    "owner_keeps_sum": _owner_keeps_its_sum,
    "scale_forgotten": _scale_forgotten,
    "own_node_only": _own_node_only,
    "rotation_per_rank": _rotation_per_rank,
}


# ------------------------------------------------------------------------------------------------ rank workers
class StepLedger(Callback):
    """The gradient kinds of the ledger, per optimizer step: ``{kind: (intra bytes, inter bytes, calls)}``."""

    def __init__(self) -> None:
        self.steps: list[dict[str, tuple[int, int, int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        trainer.strategy.comm_ledger.start_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        kinds = trainer.strategy.comm_ledger.by_kind(step=True)
        self.steps.append(
            {k: (t.intra_node_bytes, t.inter_node_bytes, t.calls) for k, t in kinds.items() if k.startswith("gradient")}
        )


def _local(rank: int, world: int, data_path: str, batches: slice = slice(0, STEPS)) -> DataLoader:
    """Rank ``rank``'s batches ``batches``: its samples r, r + W, ...; batch i of all ranks is global batch i."""
    x, y = torch.load(data_path, weights_only=True)
    x, y = x[rank::world], y[rank::world]
    sl = slice(batches.start * BATCH, batches.stop * BATCH)
    return DataLoader(TensorDataset(x[sl], y[sl]), batch_size=BATCH, shuffle=False)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's local shard of every parameter and of its momentum buffer, and (collective) the full weights."""
    shards, momenta = {}, {}
    for name, p in model.named_parameters():
        shards[name] = p.to_local().detach().clone()
        momenta[name] = optimizer.state[p]["momentum_buffer"].to_local().detach().clone()
    return {"shards": shards, "momenta": momenta, "state": full_state(model)}


def _trainer_run(rank, world, strategy, init_path, data_path, fault=None, num_nodes=1):
    """``STEPS`` steps of TinyLM with ``strategy`` (an instance, or a registered name), ``fault`` injected meanwhile;
    this rank's shards, momenta, full weights, ledger, startup line and persistent memory."""
    trainer = lightning_trainer(world, strategy, num_nodes=num_nodes, max_steps=STEPS, use_distributed_sampler=False)
    model = TinyLM(init_path)
    with pytest.MonkeyPatch.context() as mp:
        if fault is not None:
            FAULTS[fault](mp)
        trainer.fit(model, _local(rank, world, data_path))
    s = trainer.strategy
    return {
        **_snapshot(model, trainer.optimizers[0]),
        "ledger": ledger_table(s.comm_ledger),
        "describe": s.comms.describe(),
        "persistent_memory": s.persistent_memory,
    }


def _fabric_run(rank, world, name, init_path, data_path, num_nodes):
    """The same training in a plain Fabric loop with ``strategy=name``: full weights, ledger, startup line."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world // num_nodes, num_nodes=num_nodes, strategy=name)
    fabric.launch()
    model = TinyLM(init_path)
    model.configure_model()
    hp = model.hparams
    optimizer = torch.optim.SGD(model.parameters(), lr=hp.lr, momentum=hp.momentum)
    model, optimizer = fabric.setup(model, optimizer)
    for xb, yb in _local(rank, world, data_path):
        logits = model(xb)
        fabric.backward(F.cross_entropy(logits.float().view(-1, logits.size(-1)), yb.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    strategy = fabric.strategy
    return {
        **_snapshot(model, optimizer.optimizer),
        "ledger": ledger_table(strategy.comm_ledger),
        "describe": strategy.comms.describe(),
    }


def _front_doors_worker(rank, world, init_path, data_path, runs):
    """2 nodes x 2 as two machines: ``Trainer(strategy="qhsdp")``, Fabric's ``strategy="qhsdp"``, exact
    ``"hsdp"``, and the quantized runs with each fault of ``runs``."""
    import lightning_zeropp  # noqa: F401  (registers the names)

    out = {"qhsdp": _trainer_run(rank, world, "qhsdp", init_path, data_path, num_nodes=2)}
    out["fabric"] = _fabric_run(rank, world, "qhsdp", init_path, data_path, num_nodes=2)
    out["hsdp"] = _trainer_run(rank, world, "hsdp", init_path, data_path, num_nodes=2)
    for fault in runs:
        out[fault] = _trainer_run(rank, world, "qhsdp", init_path, data_path, fault, num_nodes=2)
    return out


def _three_nodes_worker(rank, world, init_path, data_path, kwargs, runs):
    """3 nodes x 2 on one machine, quantized HSDP with ``kwargs``, clean and with each fault of ``runs`` (or, for
    ``"matrices"``, clean with norm gains and biases carried exactly in the rail's all-to-alls)."""
    out = {}
    for fault in (None, *runs):
        scope = {"gradient_quantization_scope": "matrices"} if fault == "matrices" else {}
        strategy = ZeroPPStrategy(ranks_per_node=2, **QHSDP, **kwargs, **scope)
        out[fault or "clean"] = _trainer_run(rank, world, strategy, init_path, data_path, None if scope else fault)
    return out


# ------------------------------------------------------------------------------------------------ shared checks
def rail_replica_problems(results: list[dict], run: str, per_node: int) -> list[str]:
    """Where the K ranks of a rail (same local rank) hold different bits: any parameter's shard or momentum."""
    problems = []
    for local in range(per_node):
        rail = results[local::per_node]
        first = rail[0][run]
        for k, other in enumerate(rail[1:], start=1):
            for what in ("shards", "momenta"):
                for name, value in first[what].items():
                    if not torch.equal(other[run][what][name], value):
                        diff = float((other[run][what][name] - value).abs().max())
                        problems.append(f"local rank {local}, node {k}: {what} of {name} differ (max {diff:.1e})")
    return problems


def _init(init_path: str) -> dict[str, torch.Tensor]:
    return {f"net.{k}": v for k, v in torch.load(init_path, weights_only=True).items()}


def _report(errors: dict[str, float]) -> str:
    return ", ".join(f"{n.removeprefix('net.')} {e:.3f}" for n, e in sorted(errors.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------------------------ 2 nodes x 2
@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qhsdp_2x2")
    init_path, data_path, x, y = save_inputs(tmp, 4 * BATCH * STEPS)
    results = spawn(
        _front_doors_worker, 4, init_path, data_path, ["owner_keeps_sum", "scale_forgotten", "own_node_only"],
        ranks_per_machine=2,
    )  # fmt: skip
    ref, _ = reference_training(init_path, x, y, 4 * BATCH, STEPS)
    return results, ref, _init(init_path)


# measured at 2 x 2 (INT4 + INT8, nearest rounding, 3 steps): whole model 0.165, worst parameter 0.29
# (blocks.1.attn.qkv.bias); bounds at about 1.3x
BOUNDS_2X2 = dict(per_parameter=0.4, whole=0.22)


def test_replicas_stay_bit_identical_2x2(two_nodes):
    results, _, _ = two_nodes
    assert rail_replica_problems(results, "qhsdp", 2) == []
    assert rail_replica_problems(results, "fabric", 2) == []
    broken = rail_replica_problems(results, "owner_keeps_sum", 2)
    assert broken, "an owner that keeps its fp32 sum must leave the replicas different"


def test_every_parameter_near_one_process_2x2(two_nodes, capsys):
    results, ref, init = two_nodes
    state = results[0]["qhsdp"]["state"]
    errors, whole = update_errors(state, ref, init)
    with capsys.disabled():
        print(f"\nqhsdp 2 x 2: update error whole {whole:.4f}; " + _report(errors))
    assert update_problems(state, ref, init, **BOUNDS_2X2) == [], _report(errors)
    # exact HSDP passes the same bounds with room to spare; the broken rails do not
    assert update_problems(results[0]["hsdp"]["state"], ref, init, 1e-5, 1e-5, min_movement=0.99) == []
    for fault in ("scale_forgotten", "own_node_only"):
        broken = results[0][fault]["state"]
        with capsys.disabled():
            print(f"{fault}: update error whole {update_errors(broken, ref, init)[1]:.4f}")
        problems = update_problems(broken, ref, init, **BOUNDS_2X2)
        assert any("whole model" in p for p in problems), f"{fault}: passes the bounds; they cannot tell a broken rail"


def test_ledger_by_hand_int8_2x2(two_nodes):
    results, _, _ = two_nodes
    for rank, (r, want) in enumerate(zip(results, expected_ledger(2, 2, STEPS, 8), strict=True)):
        assert r["qhsdp"]["ledger"] == want, f"rank {rank}: {r['qhsdp']['ledger']} != by hand {want}"
        assert r["fabric"]["ledger"] == want, f"rank {rank} (Fabric): {r['fabric']['ledger']} != by hand {want}"
        rail = sum(want[k][1] for k in RAIL_KINDS)
        exact = STEPS * exact_all_reduce_bytes(2, 2, rank)
        assert rail <= 0.3 * exact, f"rank {rank}: {rail} bytes across nodes, exact HSDP's all-reduce {exact}"


def test_front_doors_and_startup_line_2x2(two_nodes):
    results, _, _ = two_nodes
    trainer, fabric = results[0]["qhsdp"], results[0]["fabric"]
    for name, value in trainer["state"].items():
        assert torch.equal(fabric["state"][name], value), f"{name}: Fabric's qhsdp differs from the Trainer's"
    line = trainer["describe"]
    assert line == fabric["describe"]
    for text in ("2 nodes x 2 ranks", "quantized HSDP across nodes", "INT4 reduce-scatter", "INT8 all-gather"):
        assert text in line, line
    assert "error feedback" not in line and "first" not in line, line
    assert all(r["qhsdp"]["persistent_memory"]["error_feedback"] == 0 for r in results)


# ------------------------------------------------------------------------------------------------ 3 nodes x 2
@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qhsdp_3x2")
    init_path, data_path, x, y = save_inputs(tmp, 6 * BATCH * STEPS)
    kwargs = dict(FEEDBACK, hsdp_gather_bits=16)
    runs = ["owner_keeps_sum", "rotation_per_rank", "matrices"]
    results = spawn(_three_nodes_worker, 6, init_path, data_path, kwargs, runs)
    ref, _ = reference_training(init_path, x, y, 6 * BATCH, STEPS)
    return results, ref, _init(init_path)


def test_replicas_stay_bit_identical_3x2_with_feedback(three_nodes):
    results, _, _ = three_nodes
    assert rail_replica_problems(results, "clean", 2) == []
    assert rail_replica_problems(results, "matrices", 2) == []  # the vectors' uneven parts, written by every rank
    assert rail_replica_problems(results, "owner_keeps_sum", 2), "an owner keeping its fp32 sum must be caught"


# measured at 3 x 2 (INT4 + bf16, error feedback, rotation, stochastic rounding, 3 steps): whole model 0.094, worst
# parameters the biases (blocks.0.attn.proj.bias 0.29). The bounds are about 1.3x what was measured when they were set
# (2026-12-04: whole 0.129, blocks.1.mlp.fc.bias 0.56); the ranks rotating in bases of their own (rotation_per_rank)
# measure 1.34 on the whole model and 0.78 to 4.1 per parameter
BOUNDS_3X2 = dict(per_parameter=0.75, whole=0.17)


def test_every_parameter_near_one_process_3x2_with_feedback(three_nodes, capsys):
    results, ref, init = three_nodes
    state = results[0]["clean"]["state"]
    errors, whole = update_errors(state, ref, init)
    with capsys.disabled():
        print(f"\nqhsdp 3 x 2, bf16 gather, feedback, rotation: update error whole {whole:.4f}; " + _report(errors))
    assert update_problems(state, ref, init, **BOUNDS_3X2) == [], _report(errors)
    # the bounds can fail on a broken rail, one whose replicas still match bit for bit
    broken = results[0]["rotation_per_rank"]["state"]
    broken_errors, broken_whole = update_errors(broken, ref, init)
    with capsys.disabled():
        print(f"rotation_per_rank: update error whole {broken_whole:.4f}; " + _report(broken_errors))
    assert rail_replica_problems(results, "rotation_per_rank", 2) == []
    problems = update_problems(broken, ref, init, **BOUNDS_3X2)
    per_parameter = [p for p in problems if ": update error" in p and not p.startswith("whole model")]
    assert any(p.startswith("whole model") for p in problems), f"rotation_per_rank passes the whole model: {problems}"
    assert per_parameter, f"rotation_per_rank passes every per-parameter bound: {problems}"


def test_ledger_and_residuals_by_hand_bf16_3x2(three_nodes):
    results, _, _ = three_nodes
    memory = feedback_bytes(3, 2)
    for rank, (r, want) in enumerate(zip(results, expected_ledger(3, 2, STEPS, 16), strict=True)):
        run = r["clean"]
        assert run["ledger"] == want, f"rank {rank}: {run['ledger']} != by hand {want}"
        rail = sum(want[k][1] for k in RAIL_KINDS)
        exact = STEPS * exact_all_reduce_bytes(3, 2, rank)
        # bf16 on the all-gather: (0.5 + 2) / (2 x 4) of the exact all-reduce's bytes, plus scales and padding
        assert rail <= 0.34 * exact, f"rank {rank}: {rail} bytes across nodes, exact HSDP's all-reduce {exact}"
        assert run["persistent_memory"]["error_feedback"] == memory, (rank, run["persistent_memory"], memory)
    line = results[0]["clean"]["describe"]
    for text in ("3 nodes x 2 ranks", "INT4 reduce-scatter, bf16 all-gather", "stochastic rounding", "error feedback",
                 "Hadamard-rotated blocks"):  # fmt: skip
        assert text in line, line


# ------------------------------------------------------------------------------------------------ checkpoints
def _checkpoint_worker(rank, world, init_path, data_path, tmp):
    """2 nodes x 2 on one machine, quantized HSDP with error feedback, rotation and stochastic rounding: 3 steps
    uninterrupted; 2 steps saved (sharded, and full) and resumed for the third (and once with the residuals dropped on
    load); each file loaded into exact HSDP and ZeRO-3, which step once and save, and those files loaded back."""
    from lightning_zeropp.feedback import ErrorFeedback

    x, y = torch.load(data_path, weights_only=True)
    val = DataLoader(TensorDataset(x[:4], y[:4]), batch_size=4)
    first, third = slice(0, 2), slice(2, 3)
    quantized = dict(QHSDP, **FEEDBACK)

    def trainer(kwargs, steps, state_dict_type="sharded"):
        strategy = ZeroPPStrategy(ranks_per_node=2, state_dict_type=state_dict_type, **kwargs)
        return lightning_trainer(world, strategy, max_steps=steps, use_distributed_sampler=False)

    out = {}
    t, model = trainer(quantized, STEPS), TinyLM(init_path)
    t.fit(model, _local(rank, world, data_path))
    out["uninterrupted"] = full_state(model)
    files = {"sharded": f"{tmp}/qhsdp", "full": f"{tmp}/qhsdp.ckpt"}
    for kind, path in files.items():
        t, model = trainer(quantized, 2, kind), TinyLM(init_path)
        t.fit(model, _local(rank, world, data_path, first))
        t.save_checkpoint(path)
        out[f"saved_{kind}"] = full_state(model)
    # a plain DataLoader restarts from its first batch on a resume: the resumed runs get the third batch alone
    for run, drop in (("resumed", False), ("resumed_without_residuals", True)):
        t, model = trainer(quantized, STEPS), TinyLM(init_path)
        with pytest.MonkeyPatch.context() as mp:
            if drop:
                mp.setattr(ErrorFeedback, "load_state_dict", lambda self, state: self.clear())
            t.fit(model, _local(rank, world, data_path, third), ckpt_path=files["sharded"])
        out[run] = full_state(model)
    # out to exact HSDP and ZeRO-3 (each file into both); the second of each pair steps once and saves; back in
    for kind, path in files.items():
        for name, kwargs in (("hsdp", HSDP), ("zero3", ZERO3)):
            t, model = trainer(kwargs, STEPS, kind), TinyLM(init_path)
            t.validate(model, val, ckpt_path=path, verbose=False)
            out[f"{name}_loaded_{kind}"] = full_state(model)
            if (name, kind) not in (("hsdp", "sharded"), ("zero3", "full")):
                continue
            t.fit(model, _local(rank, world, data_path, third), ckpt_path=path)
            back = f"{tmp}/{name}" + (".ckpt" if kind == "full" else "")
            t.save_checkpoint(back)
            out[f"{name}_saved_{kind}"] = full_state(model)
            t, model = trainer(quantized, STEPS, kind), TinyLM(init_path)
            t.validate(model, val, ckpt_path=back, verbose=False)
            out[f"back_from_{name}_{kind}"] = full_state(model)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qhsdp_checkpoints")
    init_path, data_path, _, _ = save_inputs(tmp, 4 * BATCH * STEPS)
    return spawn(_checkpoint_worker, 4, init_path, data_path, str(tmp))[0]


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_resume_with_feedback_continues_bit_for_bit(checkpoints):
    r = checkpoints
    assert _differing(r["saved_sharded"], r["saved_full"]) == []  # the same two steps, whatever the file
    assert _differing(r["resumed"], r["uninterrupted"]) == []
    # the residuals carried in the file matter to the third step: dropping them on load changes it
    assert _differing(r["resumed_without_residuals"], r["uninterrupted"]), "the check of the residuals is vacuous"


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_checkpoints_cross_to_exact_hsdp_and_zero3_and_back(checkpoints, kind):
    r = checkpoints
    for name in ("hsdp", "zero3"):
        assert _differing(r[f"{name}_loaded_{kind}"], r[f"saved_{kind}"]) == [], f"{kind} file into {name}"
    name = "hsdp" if kind == "sharded" else "zero3"
    stepped = r[f"{name}_saved_{kind}"]
    assert _differing(stepped, r[f"saved_{kind}"]), f"{name} did not step after the load"
    assert _differing(r[f"back_from_{name}_{kind}"], stepped) == [], f"{kind} file of {name} into quantized HSDP"


# ------------------------------------------------------------------------------------------------ until a step; K = 1
def _until_worker(rank, world, init_path, data_path, tmp):
    """2 nodes x 2, ``quantize_gradients_steps=2``: 2 steps and a save; the third step from that file with the same
    strategy, with exact HSDP, and with the rail quantized throughout. Then 1 node x 4: quantized and exact HSDP."""
    x, y = torch.load(data_path, weights_only=True)
    path, out = f"{tmp}/until", {}

    def run(kwargs, steps, batches, ckpt_path=None, per_node=2):
        ledger = StepLedger()
        strategy = ZeroPPStrategy(ranks_per_node=per_node, **kwargs)
        t = lightning_trainer(world, strategy, max_steps=steps, callbacks=[ledger], use_distributed_sampler=False)
        model = TinyLM(init_path)
        t.fit(model, _local(rank, world, data_path, batches), ckpt_path=ckpt_path)
        return t, {"steps": ledger.steps, "state": full_state(model), "ledger": ledger_table(strategy.comm_ledger),
                   "describe": strategy.comms.describe()}  # fmt: skip

    until = dict(QHSDP, quantize_gradients_steps=2)
    t, out["first"] = run(until, 2, slice(0, 2))
    t.save_checkpoint(path)
    for name, kwargs in (("until", until), ("hsdp", HSDP), ("quantized", QHSDP)):
        _, out[name] = run(kwargs, STEPS, slice(2, 3), path)
    for name, kwargs in (("one_node_qhsdp", QHSDP), ("one_node_hsdp", HSDP)):
        _, out[name] = run(kwargs, STEPS, slice(0, STEPS), per_node=4)
    return out


@pytest.fixture(scope="module")
def until_and_one_node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qhsdp_until")
    init_path, data_path, _, _ = save_inputs(tmp, 4 * BATCH * STEPS)
    return spawn(_until_worker, 4, init_path, data_path, str(tmp))


def test_exact_rail_after_quantize_gradients_steps(until_and_one_node):
    results = until_and_one_node
    units = len(unit_segments(2))
    hand = expected_ledger(2, 2, 1, 8)
    assert "for the first 2 steps" in results[0]["first"]["describe"], results[0]["first"]["describe"]
    for rank, r in enumerate(results):
        intra = hand[rank]["gradient_reduce_scatter"]
        for step, kinds in enumerate(r["first"]["steps"]):
            want = {k: hand[rank][k] for k in ("gradient_reduce_scatter", *RAIL_KINDS)}
            assert kinds == want, f"rank {rank}, step {step + 1} (quantized): {kinds} != {want}"
        # the third step (after the resume: the step count came back with the file): FSDP's exact all-reduce's bytes
        exact = (0, exact_all_reduce_bytes(2, 2, rank), units)
        want = {"gradient_reduce_scatter": intra, "gradient_all_reduce": exact}
        assert r["until"]["steps"] == [want], f"rank {rank}, step 3: {r['until']['steps']} != {want}"
    # that step's update is exact HSDP's from the same state, per parameter; a quantized one is far from it
    r = results[0]
    before = r["first"]["state"]
    for name, value in r["hsdp"]["state"].items():
        update = value - before[name]
        err = relative_error(r["until"]["state"][name] - before[name], update)
        assert err <= 1e-5, f"{name}: the exact third step is {err:.1e} (relative) from exact HSDP's"
    _, quantized = update_errors(r["quantized"]["state"], r["hsdp"]["state"], before)
    assert quantized > 1e-2, f"a quantized third step is only {quantized:.1e} from exact HSDP's; the check is vacuous"


def test_one_node_trains_as_exact_hsdp_bit_for_bit(until_and_one_node):
    for rank, r in enumerate(until_and_one_node):
        q, e = r["one_node_qhsdp"], r["one_node_hsdp"]
        assert _differing(q["state"], e["state"]) == [], f"rank {rank}"
        assert q["ledger"] == e["ledger"] and not any(k.startswith("gradient_rail") for k in q["ledger"]), q["ledger"]
        assert "1 node x 4 ranks" in q["describe"] and "quantized HSDP" not in q["describe"], q["describe"]


# ------------------------------------------------------------------------------------------------ 2 nodes x 1
def _one_rank_per_node_worker(rank, world, init_path, data_path):
    """2 nodes x 1 rank (FSDP's mesh is one rank: it calls no reduce-scatter, the all-reduce hook runs the rail),
    INT4 gather with the owner's error feedback; and exact HSDP on the same shape."""
    out = {}
    for name, kwargs in (("int4", dict(QHSDP, hsdp_gather_bits=4, gradient_error_feedback=True)), ("hsdp", HSDP)):
        out[name] = _trainer_run(rank, world, ZeroPPStrategy(ranks_per_node=1, **kwargs), init_path, data_path)
    return out


@pytest.fixture(scope="module")
def one_rank_per_node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qhsdp_2x1")
    init_path, data_path, x, y = save_inputs(tmp, 2 * BATCH * STEPS)
    results = spawn(_one_rank_per_node_worker, 2, init_path, data_path)
    ref, _ = reference_training(init_path, x, y, 2 * BATCH, STEPS)
    return results, ref, _init(init_path)


def test_one_rank_per_node_reduces_on_the_rail_int4_gather(one_rank_per_node, capsys):
    """Before the all-reduce hook ran the rail, each node trained on its own gradients: the replicas drifted apart
    (0.18 after 2 steps) and the ledger stayed empty."""
    from lightning_zeropp.costs import persistent_memory, units_of

    results, ref, init = one_rank_per_node
    assert rail_replica_problems(results, "int4", 1) == []
    model = TinyLM()
    model.configure_model()
    config = ZeroPPConfig(ranks_per_node=1, **QHSDP, hsdp_gather_bits=4, gradient_error_feedback=True)
    for rank, r in enumerate(results):
        ledger = r["int4"]["ledger"]
        assert set(ledger) == set(RAIL_KINDS), ledger  # one rank per node: nothing inside the node
        # the INT4 gather sends about what the INT4 reduce-scatter does (same pieces, same width)
        reduce, gather = (ledger[k][1] for k in RAIL_KINDS)
        assert 0.9 * reduce <= gather <= 1.1 * reduce, ledger
        want = persistent_memory(units_of(model), config, 2, 1, "32-true", rank=rank)
        assert r["int4"]["persistent_memory"] == want, (rank, r["int4"]["persistent_memory"], want)
    state = results[0]["int4"]["state"]
    errors, whole = update_errors(state, ref, init)
    with capsys.disabled():
        print(f"\nqhsdp 2 x 1, INT4 gather + feedback: update error whole {whole:.4f}; " + _report(errors))
    assert update_problems(state, ref, init, **BOUNDS_2X2) == [], _report(errors)
    assert update_problems(results[0]["hsdp"]["state"], ref, init, 1e-5, 1e-5, min_movement=0.99) == []
