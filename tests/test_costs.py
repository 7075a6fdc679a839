"""The cost model's bytes and memory (``lightning_zeropp.costs``) against the ledger and ``persistent_memory`` of real
steps: byte for byte, per kind, per rank, for every configuration and topology."""

import json
from pathlib import Path

import pytest
import torch

from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.costs import collective_buffers, gpt_units, kernel_bytes, persistent_memory, step_bytes, units_of
from lightning_zeropp.testing.distributed import spawn
from lightning_zeropp.testing.models import TinyLM
from lightning_zeropp.testing.workers import example_gpt, save_inputs, train_worker

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "comm_volume.json"  # the ledgers of benchmarks/comm_volume.py (example GPT, bf16)
COMM_VOLUME_MODEL = dict(block_size=128, n_layer=4, n_head=4, n_embd=256)  # comm_volume.py's MODEL
CONFIGS = {
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "hsdp": dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False, quantize_gradients=False),
    "qwz": dict(quantize_weights=True, hpz_partition_size=1, quantize_gradients=False),
    "hpz": dict(quantize_weights=False, hpz_partition_size="auto", quantize_gradients=False),
    "qgz": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=True),
    "zeropp": dict(),
    "zeropp_ef": dict(gradient_error_feedback=True),
    "zeropp_deltas": dict(weight_deltas=True),
    "zeropp_deltas8": dict(weight_deltas=True, weight_delta_bits=8),
}


def _measured_rows():
    return json.loads(MEASURED.read_text())


def test_gpt_units_are_the_example_gpts_units():
    """The shapes the planner assumes for a GPT are the units the strategy makes of the example's model."""
    module = example_gpt()(**dict(COMM_VOLUME_MODEL, vocab_size=256, n_head=4, dropout=0.0))
    module.configure_model()
    got = units_of(module)
    want = gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])
    assert [u.shapes for u in got] == [u.shapes for u in want]
    assert len(got) == COMM_VOLUME_MODEL["n_layer"] + 1


def test_bytes_and_memory_equal_the_measured_ledgers():
    rows = _measured_rows()
    topologies = {(r["nodes"], r["ranks_per_node"]) for r in rows}
    assert topologies >= {(2, 2), (3, 2), (4, 2)} and {r["config"] for r in rows} >= set(CONFIGS)
    units = gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])
    wrong = []
    for row in rows:
        world, per_node = row["nodes"] * row["ranks_per_node"], row["ranks_per_node"]
        config = ZeroPPConfig(**CONFIGS[row["config"]], ranks_per_node=per_node)
        planned = {k: [v[0], v[1]] for k, v in step_bytes(units, config, world, per_node, 0).items()}
        if planned != row["per_kind"]:
            wrong.append(f"{row['nodes']}x{per_node} {row['config']}: {planned} != {row['per_kind']}")
        memory = persistent_memory(units, config, world, per_node)
        if memory != row["persistent_memory"]:
            wrong.append(f"{row['nodes']}x{per_node} {row['config']}: memory {memory} != {row['persistent_memory']}")
    assert wrong == []
    assert any(r["persistent_memory"]["weight_deltas_node_copy"] > 0 for r in rows)  # measured inside the run
    assert any(r["persistent_memory"]["error_feedback"] > 0 for r in rows)


def test_the_comparison_can_fail():
    """Negative controls: the planner off by one padding rule, or for another topology, does not match."""
    row = next(r for r in _measured_rows() if (r["config"], r["nodes"]) == ("zeropp", 3))
    units = gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])
    flat = ZeroPPConfig(block_alignment="flat", ranks_per_node=2)
    planned = {k: [v[0], v[1]] for k, v in step_bytes(units, flat, 6, 2, 0).items()}
    assert planned != row["per_kind"]
    other = {k: [v[0], v[1]] for k, v in step_bytes(units, ZeroPPConfig(ranks_per_node=2), 8, 2, 0).items()}
    assert other != row["per_kind"]


def test_every_rank_and_precision_is_costed():
    """Ranks differ only where shards split unevenly; bf16 halves what fp32 gathers; HSDP's weights never cross."""
    model = TinyLM()
    model.configure_model()
    units = units_of(model)
    hsdp = ZeroPPConfig(**CONFIGS["hsdp"])
    for rank in range(6):
        by_kind = step_bytes(units, hsdp, 6, 2, rank, "32-true")
        assert by_kind["weight_all_gather"][1] == 0 and by_kind["gradient_all_reduce"][0] == 0
    fp32 = step_bytes(units, ZeroPPConfig(**CONFIGS["zero3"]), 4, 2, 0, "32-true")
    bf16 = step_bytes(units, ZeroPPConfig(**CONFIGS["zero3"]), 4, 2, 0, "bf16-mixed")
    assert all(2 * bf16[k][i] == fp32[k][i] for k in fp32 for i in (0, 1))


@pytest.mark.multiprocess
@pytest.mark.version_sensitive
def test_bytes_equal_every_ranks_ledger_at_three_nodes(tmp_path):
    """TinyLM in fp32 at 3 x 2 with weight deltas (whose holders differ by rank) and qgZ, every rank's ledger: each
    step's bytes are the planner's (the first step refreshes the node copies exactly; the steps after it are steady).
    qwZ's bytes, the same on every rank, are checked against the measured ledgers above."""
    name = "zeropp_deltas"
    world, per_node, batch, steps = 6, 2, 2, 3
    init_path, data_path, *_ = save_inputs(tmp_path, world * batch * steps)
    strategy = dict(CONFIGS[name], ranks_per_node=per_node)
    results = spawn(train_worker, world, strategy, init_path, data_path, batch, steps)
    model = TinyLM()
    model.configure_model()
    units = units_of(model)
    config = ZeroPPConfig(**strategy)
    after_first = {"weight_delta_all_to_all": steps - 1}  # the first step sends the shards themselves (refresh)
    for rank, r in enumerate(results):
        planned = step_bytes(units, config, world, per_node, rank, "32-true")
        for kind, per_step in planned.items():
            n = after_first.get(kind, steps)
            assert list(r["ledger"][kind]) == [n * v for v in per_step], f"rank {rank} {kind}: {r['ledger'][kind]}"
        unplanned = set(r["ledger"]) - set(planned)
        assert unplanned <= {"weight_delta_refresh"}, f"rank {rank}: the planner misses {unplanned}"
    assert torch.isfinite(torch.tensor(results[0]["losses"])).all()


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


def test_collective_buffers_are_the_largest_units_quantized_rows():
    """qwZ holds the packed shard and every gathered row; qgZ its sent and received rows of both hops; exact
    collectives use FSDP's own buffers (none of ours)."""
    units = gpt_units(256, COMM_VOLUME_MODEL["block_size"], COMM_VOLUME_MODEL["n_layer"], COMM_VOLUME_MODEL["n_embd"])
    block = units[0].numel  # the largest unit: a block (no padding at W = 8)
    assert collective_buffers(units, ZeroPPConfig(**CONFIGS["zero3"]), 8, 2) == 0
    assert collective_buffers(units, ZeroPPConfig(**CONFIGS["hsdp"]), 8, 2) == 0
    qwz = collective_buffers(units, ZeroPPConfig(quantize_gradients=False), 8, 2)
    assert qwz == pytest.approx(block * (1 + 4 / 256) * (1 + 1 / 8), rel=0.01)
    qgz = collective_buffers(units, ZeroPPConfig(quantize_weights=False), 8, 2)
    # sent and received: W INT8 rows of a chunk (block / W) inside the node, K = 4 INT4 rows on the rail
    assert qgz == pytest.approx(block * (2 * (1 + 4 / 128) + 2 * 4 / 8 * (0.5 + 4 / 128)), rel=0.02)
