"""The cost model's bytes and memory (``lightning_zeropp.costs``) against the ledger and ``persistent_memory`` of real
steps: byte for byte, per kind, per rank, for every configuration and topology. Each comparison is shown to fail on a
plausible fault of the planner (a copy of ``costs.py`` with one line changed, or a monkeypatched wire size)."""

import inspect
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from lightning_zeropp import costs, rail
from lightning_zeropp import kernels as tk
from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.core import QUANTIZED_HSDP_ARGUMENTS
from lightning_zeropp.costs import collective_buffers, gpt_units, kernel_bytes, step_bytes, units_of
from lightning_zeropp.testing.distributed import spawn
from lightning_zeropp.testing.models import TinyLM
from lightning_zeropp.testing.workers import example_gpt, save_inputs, train_worker

ROOT = Path(__file__).resolve().parents[1]
# the ledgers of benchmarks/comm_volume.py (example GPT, bf16)
MEASURED = ROOT / "benchmarks" / "data" / "bytes_per_step" / "comm_volume.json"
COMM_VOLUME_MODEL = dict(block_size=128, n_layer=4, n_head=4, n_embd=256)  # comm_volume.py's MODEL
CONFIGS = {
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "hsdp": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=False),
    "qhsdp": dict(QUANTIZED_HSDP_ARGUMENTS),
    "qhsdp_bf16": dict(QUANTIZED_HSDP_ARGUMENTS, hsdp_gather_bits=16),
    "qhsdp_ef": dict(QUANTIZED_HSDP_ARGUMENTS, gradient_error_feedback=True),
    "qhsdp_int4": dict(QUANTIZED_HSDP_ARGUMENTS, hsdp_gather_bits=4),
    "qwz": dict(quantize_weights=True, hpz_partition_size=1, quantize_gradients=False),
    "hpz": dict(quantize_weights=False, hpz_partition_size="auto", quantize_gradients=False),
    "qgz": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=True),
    "zeropp": dict(),
    "zeropp_matrices": dict(gradient_quantization_scope="matrices"),
    "zeropp_ef": dict(gradient_error_feedback=True),
    "zeropp_deltas": dict(weight_deltas=True),
    "zeropp_deltas8": dict(weight_deltas=True, weight_delta_bits=8),
}


RAIL_CONFIGS = {  # quantized HSDP beside comm_volume's rows: flat blocks, fp32 residuals, empty rail pieces
    "qhsdp_flat_ef": dict(QUANTIZED_HSDP_ARGUMENTS, block_alignment="flat", gradient_error_feedback=True),
    # blocks of 1024: TinyLM's node shards (3332 and 2026 elements) leave some of 3 or 4 rail pieces empty
    "qhsdp_flat_bf16_ef32": dict(QUANTIZED_HSDP_ARGUMENTS, block_alignment="flat", hsdp_gather_bits=16,
                                 gradient_error_feedback=True, error_feedback_bits=32, gradient_block_size=1024),
    "qhsdp_ef_1024": dict(QUANTIZED_HSDP_ARGUMENTS, gradient_error_feedback=True, gradient_block_size=1024),
}  # fmt: skip

RAIL_FAULTS = {  # the planner's plausible faults on quantized HSDP: (line of costs.py, as the fault writes it)
    "the gather sent once per rail, not to every peer": (
        "ledger.record_to_peers(GATHER_KIND, rail, cut[topo.node].wire(gradients.gather_bits, bs))",
        "ledger.record_to_peers(GATHER_KIND, rail, [cut[topo.node].wire(gradients.gather_bits, bs) if i =="
        " (topo.node + 1) % K else 0 for i in range(K)])",
    ),
    "every rank's own piece taken as piece 0": (
        "cut[topo.node].wire(gradients.gather_bits, bs)",
        "cut[0].wire(gradients.gather_bits, bs)",
    ),
    "the gather at the reduce-scatter's width": (
        "cut[topo.node].wire(gradients.gather_bits, bs)",
        "cut[topo.node].wire(gradients.inter_bits, bs)",
    ),
    "the rail pieces cut at parameter blocks even when blocks are flat": (
        "blocks = tk.Blocks.of_segments(segments, block_size) if aligned else None\n    return pieces(",
        "blocks = tk.Blocks.of_segments(segments, block_size)\n    return pieces(",
    ),
    "the residual's INT8 scales forgotten": (
        "rows, pieces = 1, [(p.size, p.block_count(g.block_size)) for p in cut]",
        "rows, pieces = 1, [(p.size, 0) for p in cut]",
    ),
    "the residual kept for K rows, as qgZ's": (
        "rows, pieces = 1, [(p.size, p.block_count(g.block_size)) for p in cut]",
        "rows, pieces = K, [(p.size, p.block_count(g.block_size)) for p in cut]",
    ),
}


def _faulty_costs(monkeypatch, fault: str) -> types.ModuleType:
    """A copy of :mod:`lightning_zeropp.costs` with :data:`RAIL_FAULTS` ``fault`` written into it (the shared file
    is not touched)."""
    old, new = RAIL_FAULTS[fault]
    source = inspect.getsource(costs)
    assert source.count(old) >= 1, f"{fault}: the line to break is gone from costs.py; update RAIL_FAULTS"
    module = types.ModuleType("lightning_zeropp._faulty_costs")
    module.__package__ = "lightning_zeropp"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(source.replace(old, new), "<faulty costs.py>", "exec"), module.__dict__)
    return module


def _without_scales(self, bits: int, block_size: int) -> int:
    """:meth:`rail.Piece.wire` that forgets the fp32 block scales (and the 16-byte padding): the codes alone."""
    return 0 if not self.size else self.size * bits // 8


def _measured_rows():
    return json.loads(MEASURED.read_text())


def _gpt_units():
    return gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])


def _measured_mismatches(rows: list[dict], model: types.ModuleType = costs) -> list[str]:
    """Where ``model`` (the cost model, or a faulty copy) differs from comm_volume's ledgers, rank by rank."""
    units, wrong = _gpt_units(), []
    for row in rows:
        world, per_node = row["nodes"] * row["ranks_per_node"], row["ranks_per_node"]
        config = ZeroPPConfig(**CONFIGS[row["config"]], ranks_per_node=per_node)
        for rank, measured in enumerate(row["per_rank"]):
            memory = model.persistent_memory(units, config, world, per_node, rank=rank)
            planned = {k: [v[0], v[1]] for k, v in model.step_bytes(units, config, world, per_node, rank).items()}
            where = f"{row['nodes']}x{per_node} {row['config']} rank {rank}"
            if planned != measured["per_kind"]:
                wrong.append(f"{where}: {planned} != {measured['per_kind']}")
            if memory != measured["persistent_memory"]:
                wrong.append(f"{where}: memory {memory} != {measured['persistent_memory']}")
    return wrong


def test_gpt_units_are_the_example_gpts_units():
    """The shapes the planner assumes for a GPT are the units the strategy makes of the example's model."""
    module = example_gpt()(**dict(COMM_VOLUME_MODEL, vocab_size=256, n_head=4, dropout=0.0))
    module.configure_model()
    got = units_of(module)
    want = gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])
    assert [u.shapes for u in got] == [u.shapes for u in want]
    assert len(got) == COMM_VOLUME_MODEL["n_layer"] + 1


def test_bytes_and_memory_equal_the_measured_ledgers():
    """Every rank of every row of comm_volume.py (rank 0's is also the row's ``per_kind``, what plan_check reads)."""
    rows = _measured_rows()
    topologies = {(r["nodes"], r["ranks_per_node"]) for r in rows}
    assert topologies >= {(2, 2), (3, 2), (4, 2)} and {r["config"] for r in rows} >= set(CONFIGS)
    assert all(len(r["per_rank"]) == r["nodes"] * r["ranks_per_node"] for r in rows)
    assert all(r["per_rank"][0]["per_kind"] == r["per_kind"] for r in rows)
    assert _measured_mismatches(rows) == []
    assert any(r["persistent_memory"]["weight_deltas_node_copy"] > 0 for r in rows)  # measured inside the run
    assert any(r["persistent_memory"]["error_feedback"] > 0 for r in rows if r["config"] == "qhsdp_ef")
    # the defaults' second-moment correction keeps one fp32 per gradient block: measured, and planned alike
    assert all(r["persistent_memory"]["second_moment_noise"] > 0 for r in rows if r["config"] == "zeropp")
    assert all(r["persistent_memory"]["second_moment_noise"] == 0 for r in rows if r["config"].startswith("qhsdp"))
    # the busiest rank differs from rank 0 somewhere (a rail piece that is not rank 0's), or every rank is rank 0
    rail_rows = [r for r in rows if r["config"].startswith("qhsdp")]
    assert any(len({json.dumps(p["per_kind"]) for p in r["per_rank"]}) > 1 for r in rail_rows)


def test_the_comparison_can_fail():
    """Negative controls: the planner off by one padding rule, or for another topology, does not match."""
    row = next(r for r in _measured_rows() if (r["config"], r["nodes"]) == ("zeropp", 3))
    units = gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])
    flat = ZeroPPConfig(block_alignment="flat", ranks_per_node=2)
    planned = {k: [v[0], v[1]] for k, v in step_bytes(units, flat, 6, 2, 0).items()}
    assert planned != row["per_kind"]
    other = {k: [v[0], v[1]] for k, v in step_bytes(units, ZeroPPConfig(ranks_per_node=2), 8, 2, 0).items()}
    assert other != row["per_kind"]


@pytest.mark.parametrize("fault", [f for f in RAIL_FAULTS if "flat" not in f])
def test_the_quantized_hsdp_comparison_can_fail(monkeypatch, fault):
    """Quantized HSDP's rows of comm_volume.py tell each fault of the planner apart (at some rank of some topology);
    flat blocks are told apart by the spawned runs below."""
    rows = [r for r in _measured_rows() if r["config"].startswith("qhsdp")]
    assert _measured_mismatches(rows, _faulty_costs(monkeypatch, fault)) != [], fault


def test_the_quantized_hsdp_comparison_can_fail_on_the_scales(monkeypatch):
    rows = [r for r in _measured_rows() if r["config"].startswith("qhsdp")]
    monkeypatch.setattr(rail.Piece, "wire", _without_scales)
    assert _measured_mismatches(rows) != []


def test_every_rank_and_precision_is_costed():
    """Ranks differ only where shards split unevenly; bf16 halves what fp32 gathers; HSDP's weights never cross."""
    model = TinyLM()
    model.configure_model()
    units = units_of(model)
    hsdp = ZeroPPConfig(**CONFIGS["hsdp"])
    for rank in range(6):
        by_kind = step_bytes(units, hsdp, 6, 2, rank, "32-true")
        assert by_kind["weight_all_gather"][1] == 0 and by_kind["gradient_all_reduce"][0] == 0
        quantized = step_bytes(units, ZeroPPConfig(**CONFIGS["qhsdp"]), 6, 2, rank, "32-true")
        assert "gradient_all_reduce" not in quantized and quantized["gradient_reduce_scatter"][1] == 0
        assert quantized["gradient_rail_reduce_scatter"][0] == 0 == quantized["gradient_rail_all_gather"][0]
    fp32 = step_bytes(units, ZeroPPConfig(**CONFIGS["zero3"]), 4, 2, 0, "32-true")
    bf16 = step_bytes(units, ZeroPPConfig(**CONFIGS["zero3"]), 4, 2, 0, "bf16-mixed")
    assert all(2 * bf16[k][i] == fp32[k][i] for k in fp32 for i in (0, 1))


def _ledgers_worker(rank: int, world: int, configs: dict[str, dict], *args) -> dict[str, dict]:
    """:func:`train_worker` for each of ``configs`` in turn, in the same ranks (one spawn for all of them)."""
    runs = {name: train_worker(rank, world, kwargs, *args) for name, kwargs in configs.items()}
    return {name: {k: r[k] for k in ("ledger", "persistent_memory", "losses")} for name, r in runs.items()}


def _ledger_mismatches(results, configs, units, world, per_node, steps, model=costs) -> list[str]:
    """Where ``model`` (the cost model, or a faulty copy) differs from every rank's ledger and persistent memory."""
    wrong = []
    after_first = {"weight_delta_all_to_all": steps - 1}  # the first step sends the shards themselves (refresh)
    for name, kwargs in configs.items():
        config = ZeroPPConfig(**kwargs)
        for rank, r in enumerate(results):
            memory = model.persistent_memory(units, config, world, per_node, "32-true", rank=rank)
            run = r[name]
            planned = model.step_bytes(units, config, world, per_node, rank, "32-true")
            for kind, per_step in planned.items():
                n = after_first.get(kind, steps)
                if list(run["ledger"].get(kind, ())) != [n * v for v in per_step]:
                    wrong.append(f"{name} rank {rank} {kind}: {run['ledger'].get(kind)} != {n} x {per_step}")
            unplanned = set(run["ledger"]) - set(planned) - {"weight_delta_refresh"}
            if unplanned:
                wrong.append(f"{name} rank {rank}: the planner misses {unplanned}")
            if run["persistent_memory"] != memory and not kwargs.get("weight_deltas"):  # teardown frees node copies
                wrong.append(f"{name} rank {rank}: memory {run['persistent_memory']} != {memory}")
    return wrong


@pytest.mark.multiprocess
@pytest.mark.version_sensitive
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2), (4, 2)], ids=["2x2", "3x2", "4x2"])
def test_bytes_equal_every_ranks_ledger(tmp_path, monkeypatch, nodes, per_node):
    """TinyLM in fp32, every rank's ledger and persistent memory, each step's bytes the planner's: quantized HSDP
    with flat and parameter-aligned blocks, INT8 and bf16 gathers, INT8 and fp32 residuals and empty rail pieces
    (every rank owns another piece); at 2 x 2 also exact HSDP (whose cross-node all-reduce is FSDP's alone); at 3 x 2
    also weight deltas (whose holders differ by rank; the first step refreshes the node copies exactly, the steps after
    it are steady) and qgZ. qwZ's bytes, the same on every rank, are checked against the measured ledgers above. Then
    each of the planner's faults is told apart."""
    world, batch, steps = nodes * per_node, 2, 3
    init_path, data_path, *_ = save_inputs(tmp_path, world * batch * steps)
    others = {2: ["hsdp"], 3: ["zeropp_deltas"]}.get(nodes, [])  # exact HSDP: one all-reduce across nodes, FSDP's
    names = {**{name: CONFIGS[name] for name in others}, **RAIL_CONFIGS}
    configs = {name: dict(kwargs, ranks_per_node=per_node) for name, kwargs in names.items()}
    results = spawn(_ledgers_worker, world, configs, init_path, data_path, batch, steps)
    model = TinyLM()
    model.configure_model()
    units = units_of(model)
    assert _ledger_mismatches(results, configs, units, world, per_node, steps) == []
    for r in results:
        assert all(torch.isfinite(torch.tensor(run["losses"])).all() for run in r.values())
    rail_configs = {name: configs[name] for name in RAIL_CONFIGS}
    for fault in RAIL_FAULTS:
        if fault == "the gather sent once per rail, not to every peer" and nodes == 2:
            continue  # a rail of two has one peer: the same bytes
        faulty = _faulty_costs(monkeypatch, fault)
        assert _ledger_mismatches(results, rail_configs, units, world, per_node, steps, faulty) != [], fault
    with monkeypatch.context() as patched:
        patched.setattr(rail.Piece, "wire", _without_scales)
        assert _ledger_mismatches(results, rail_configs, units, world, per_node, steps) != []


def test_kernel_bytes_follow_the_techniques():
    """The quantization kernels' memory traffic: none for exact collectives; qwZ's own shard in and out, then every
    gathered INT8 row in and bf16 row out (twice without hpZ); error feedback reads and writes its residual."""
    units = gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])
    W, nodes = 8, 4
    params = sum(u.numel for u in units)  # no padding at W = 8 for this model

    def moved(**kwargs):
        return kernel_bytes(units, ZeroPPConfig(ranks_per_node=2, **kwargs), W, 2)

    assert moved(**CONFIGS["zero3"]) == 0 == moved(**CONFIGS["hsdp"])
    qwz_hpz = moved(quantize_weights=True, quantize_gradients=False)
    assert moved(quantize_weights=True, quantize_gradients=False, hpz_partition_size=1) == 2 * qwz_hpz
    int8 = 1 + 4 / 256  # bytes per element with the scales
    assert qwz_hpz == pytest.approx(params * (2 + int8) * (1 + 1 / W), rel=0.01)
    residual = nodes * params // W  # elements: K rows of each rank's chunk
    for bits in (8, 16, 32):
        extra = moved(gradient_error_feedback=True, error_feedback_bits=bits) - moved()
        assert extra == 2 * residual * bits // 8
    # quantized HSDP, per element of the node shard: the shard in and its K INT4 pieces out; K INT4 rows of one piece
    # in, fp32 out; that piece rounded to INT8 (or cast to bf16); the K gathered pieces into the shard (bf16 both)
    shard, int4, int8 = params // 2, 0.5 + 4 / 128, 1 + 4 / 128
    assert moved(**CONFIGS["qhsdp"]) == pytest.approx(shard * (2 + 2 * int4 + 8 / nodes + int8 / nodes + int8 + 2),
                                                      rel=0.002)  # fmt: skip
    assert moved(**CONFIGS["qhsdp_bf16"]) == pytest.approx(shard * (2 + 2 * int4 + 10 / nodes + 2 + 2), rel=0.002)
    owned = [  # rank 0 owns piece 0 of each unit's node shard: the gather's residual
        rail.pieces(sum(u.shards(2)), nodes, 128, tk.Blocks.of_segments(u.shards(2), 128))[0].size for u in units
    ]
    for bits in (8, 16, 32):  # one residual row per rail piece (the node shard once), and one for the owned piece
        extra = moved(**CONFIGS["qhsdp_ef"], error_feedback_bits=bits) - moved(**CONFIGS["qhsdp"])
        assert extra == 2 * shard * bits // 8 + sum(2 * size * bits // 8 for size in owned)
        bf16 = dict(CONFIGS["qhsdp_ef"], hsdp_gather_bits=16)  # a bf16 gather keeps no residual
        assert moved(**bf16, error_feedback_bits=bits) - moved(**CONFIGS["qhsdp_bf16"]) == 2 * shard * bits // 8


def test_collective_buffers_are_the_largest_units_quantized_rows():
    """qwZ holds the packed shard and every gathered row; qgZ its sent and received rows of both hops; quantized HSDP
    its rail pieces sent and received, INT4 then INT8 or bf16; exact collectives use FSDP's own buffers (none of
    ours)."""
    units = gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])
    block = units[0].numel  # the largest unit: a block (no padding at W = 8)
    assert collective_buffers(units, ZeroPPConfig(**CONFIGS["zero3"]), 8, 2) == 0
    assert collective_buffers(units, ZeroPPConfig(**CONFIGS["hsdp"]), 8, 2) == 0
    qwz = collective_buffers(units, ZeroPPConfig(quantize_gradients=False), 8, 2)
    assert qwz == pytest.approx(block * (1 + 4 / 256) * (1 + 1 / 8), rel=0.01)
    qgz = collective_buffers(units, ZeroPPConfig(quantize_weights=False), 8, 2)
    # sent and received: W INT8 rows of a chunk (block / W) inside the node, K = 4 INT4 rows on the rail
    assert qgz == pytest.approx(block * (2 * (1 + 4 / 128) + 2 * 4 / 8 * (0.5 + 4 / 128)), rel=0.02)
    # quantized HSDP: a node shard (block / N) in INT4 pieces sent and K copies of one piece received, then that piece
    # to each of K ranks and K pieces received, INT8 or bf16
    int4, int8 = 0.5 + 4 / 128, 1 + 4 / 128
    qhsdp = collective_buffers(units, ZeroPPConfig(**CONFIGS["qhsdp"], ranks_per_node=2), 8, 2)
    assert qhsdp == pytest.approx(block / 2 * (2 * int4 + 2 * int8), rel=0.002)
    qhsdp_bf16 = collective_buffers(units, ZeroPPConfig(**CONFIGS["qhsdp_bf16"], ranks_per_node=2), 8, 2)
    assert qhsdp_bf16 == pytest.approx(block / 2 * (2 * int4 + 2 * 2), rel=0.002)
    # with norm gains and biases carried exactly by the rail's rows: every row copied once more, and the vectors'
    # parts of the node shard, fp32 at most
    vectors = collective_buffers(units, ZeroPPConfig(**CONFIGS["qhsdp"], ranks_per_node=2,
                                                     gradient_quantization_scope="matrices"), 8, 2)  # fmt: skip
    assert vectors == 2 * qhsdp + 6 * 4 * units[0].vector_shard(2)
    # and by qgZ's: the last stage's rows copied once more on both hops (two pieces: half the rows), and the
    # vectors' columns of the W chunks, fp32 at most
    carried = collective_buffers(units, ZeroPPConfig(quantize_weights=False, gradient_quantization_scope="matrices"),
                                 8, 2)  # fmt: skip
    assert carried - qgz == pytest.approx(qgz / 2 + (4 * 8 + 3 * 4 + 1) * 4 * units[0].vector_shard(8), rel=0.02)
