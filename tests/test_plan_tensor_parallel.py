"""The planner with tensor parallelism: ``predict(..., tensor_parallel_size=t)`` and
``--tensor-parallel-size t|auto``.

- the model's pieces under a Megatron-style plan, read from the shapes;
- at t = 2 on 2 nodes x 4, every figure of a ZeRO-3 row worked out by hand: the data-parallel bytes on 4 ranks, 2 per
  node, of the tensor-parallel pieces; the memory; the activations' all-reduces, inside the node and apart from the
  data-parallel bytes; the ring time with the node's link shared by the t data-parallel groups;
- the bytes of a tensor-parallel job are those of the smaller data-parallel job (one INT4 hop when t fills the node);
- refusals, each one line naming the argument and the fix: t not dividing the node, t < 1, an hpZ size that does
  not divide the data-parallel ranks;
- t = 1 as before: the same rows, the same printed plan, the same JSON keys;
- the recommendation: by the verdict's rule (fit first, then a step more than the margin shorter), t = 1 ("don't use
  it") where nothing larger is enough faster, t > 1 where the model does not fit without it.
"""

from __future__ import annotations

import json

import pytest
from test_plan_cli import refused  # the CLI's one-line refusal, as its own tests read it

from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.costs import Unit, activation_all_reduce_bytes, gpt_units, step_bytes, tensor_parallel_units
from lightning_zeropp.planner import main, table
from lightning_zeropp.prediction import CONFIGS, Cluster, Row, Workload, collective_seconds, predict
from lightning_zeropp.recommendation import (
    choose_tensor_parallel,
    compare_tensor_parallel,
    label,
    plannable,
    verdict,
    verdict_text,
)

SMALL = gpt_units(256, 128, 2, 64)  # two blocks 64 wide, a vocabulary of 256, 128 positions
ZERO3 = {"zero3": CONFIGS["zero3"]}


# ------------------------------------------------------------------------------------------------ the pieces
def test_a_gpt_is_split_as_megatron_splits_it():
    """In a block: the widening matrices (qkv, the MLP's first) and their biases split over rows, the projections
    back to the width over columns, their biases and the norms whole; in the root the vocabulary-sized matrix (token
    embedding and tied head) over rows, positions and the final norm whole. A Llama-like block (no biases, a gated MLP
    of two widening matrices) and sizes that 4 does not divide: the first ranks take one row more."""
    block = ((64,), (64,), (96, 64), (96,), (64, 32), (64,), (64,), (64,), (128, 64), (128,), (64, 128), (64,))
    local = tensor_parallel_units(SMALL, 2)
    assert [u.shapes for u in local] == [block, block, ((128, 64), (128, 64), (64,), (64,))]
    assert [u.name for u in local] == ["blocks.0", "blocks.1", "<root>"]
    assert tensor_parallel_units(SMALL, 1) == SMALL
    llama = [
        Unit("layers.0", ((10,), (18, 10), (10, 10), (10,), (27, 10), (27, 10), (10, 27))),
        Unit("<root>", ((50, 10), (10,), (50, 10))),
    ]
    assert [u.shapes for u in tensor_parallel_units(llama, 4)] == [
        ((10,), (5, 10), (10, 3), (10,), (7, 10), (7, 10), (10, 7)),
        ((13, 10), (10,), (13, 10)),
    ]


# ------------------------------------------------------------------------------------------------ by hand
def test_a_zero3_row_at_t2_worked_out_by_hand():
    """2 nodes x 4 GPUs, t = 2: ZeRO-3 on 4 data-parallel ranks, 2 per node, each holding a quarter (dim 0 padded to
    4) of its group's pieces; bf16-mixed, 512 tokens per GPU (the group computes on 1024), activation checkpointing."""
    cluster = Cluster(2, 4, 80.0, 800.0)  # 10 GB/s into each node, 100 GB/s per GPU; latencies 5 us and 2 us
    row = predict(SMALL, cluster, Workload(512), ZERO3, n_embd=64, tensor_parallel_size=2)[0]
    # one rank's shard of a block's pieces: norms and the projections' biases (64 each) whole, so 16 each
    block = 16 + 16 + 24 * 64 + 24 + 16 * 32 + 16 + 16 + 16 + 32 * 64 + 32 + 16 * 128 + 16
    root = 32 * 64 + 32 * 64 + 16 + 16  # half the vocabulary over 4 ranks; the 128 positions whole over 4
    C = 2 * block + root
    assert (block, root, C) == (6296, 4128, 16720)
    # each all-gather and the reduce-scatter: the rank's bf16 buffer to its 1 peer in the node, its 2 in the other
    per_kind = (1 * 2 * C, 2 * 2 * C, 3)
    kinds = ("weight_all_gather", "weight_all_gather_backward", "gradient_reduce_scatter")
    assert row.bytes_by_kind == dict.fromkeys(kinds, per_kind)
    assert row.inter_node_gb == 3 * 4 * C / 1e9 and row.intra_node_gb == 3 * 2 * C / 1e9  # the data-parallel bytes only
    # the activations: 2 layers x (2 forward, 2 backward, 2 recomputed) all-reduces of 1024 tokens x 64, bf16; a ring
    # of 2 sends half of the buffer to the peer twice (reduce-scatter, all-gather)
    calls, buffer = 2 * 6, 1024 * 64 * 2
    assert activation_all_reduce_bytes(2, 512, 64, 2, "bf16-mixed", True) == (calls * buffer, calls)
    assert row.tensor_parallel_gb == calls * buffer / 1e9 == 0.001572864
    tp_s = calls * buffer / 100e9 + calls * 2 * 2e-6  # on the GPU's own link; 2 ring steps per all-reduce
    assert row.tensor_parallel_s == pytest.approx(tp_s, rel=1e-12)
    # a ring over the 4 ranks: 3 shards through the node's link, which the 2 groups (one per position) share
    ring = max(3 * 2 * C / (10e9 / 2), 3 * 2 * C / 100e9) + 3 * 3 * 5e-6
    assert row.comm_s == pytest.approx(3 * ring, rel=1e-12)
    pieces = 2 * (64 * 6 + 96 * 64 + 96 + 64 * 32 + 128 * 64 + 128 + 64 * 128) + (128 * 64 * 2 + 128)
    assert pieces == 2 * 25184 + 16512
    compute = 8 * pieces * 1024 / (989e12 * 0.645)  # every GPU computes with its pieces on the group's tokens
    assert row.compute_s == pytest.approx(compute, rel=1e-12)
    assert row.step_s == pytest.approx(compute + tp_s + 3 * ring, rel=1e-12)  # overlap 0; TP on the compute's path
    memory = {k: v * 2**30 for k, v in row.memory_gib.items() if k != "total"}
    assert memory == {
        "parameters": 4 * C,  # fp32 master
        "gradients": 4 * C,
        "optimizer": 2 * 4 * C,
        "hpz_copy": 0,
        "unsharded_units": 2 * 2 * (25184 + 25184),  # the two largest pieces gathered in bf16
        "collective_buffers": 0,
        "activations": 1024 * 64 * (10 + 24 // 2) + 2 * 2 * 1024 * 64,  # one layer whole, every layer's input
        "error_feedback": 0,
        "second_moment_noise": 0,
        "weight_deltas_node_copy": 0,
        "weight_deltas_tracked_copy": 0,
    }
    # t = 1 shards everything over 8: the split matrices cost each rank the same, the norms, the projections' biases
    # and the positions (kept whole by every GPU of a group) twice as much at t = 2
    one = predict(SMALL, cluster, Workload(512), ZERO3, n_embd=64)[0]
    block1 = 8 + 8 + 24 * 64 + 24 + 8 * 64 + 8 + 8 + 8 + 32 * 64 + 32 + 8 * 256 + 8
    C1 = 2 * block1 + 32 * 64 + 16 * 64 + 8 + 8
    assert (block1, C1) == (6248, 15584) and C - C1 == 2 * 6 * 8 + 1024 + 16
    assert one.memory_gib["parameters"] * 2**30 == 4 * C1
    assert one.bytes_by_kind["weight_all_gather"] == (3 * 2 * C1, 4 * 2 * C1, 3)
    assert one.tensor_parallel_gb == one.tensor_parallel_s == 0


def test_the_node_link_is_shared_by_the_data_parallel_groups():
    """A ring on t = 2: 4 data-parallel ranks, 2 per node (3 shards through the link, at half its rate each); an
    all-to-all: the node's 4 GPUs each send theirs over the link, whatever t."""
    cluster = Cluster(2, 4, 80.0, 800.0, inter_latency_us=0.0, intra_latency_us=0.0)
    t2, t1 = ZeroPPConfig(tensor_parallel_size=2), ZeroPPConfig()
    shard = 1_000_000
    assert collective_seconds("weight_all_gather", shard, 2 * shard, 1, cluster, t2) == pytest.approx(3 * shard / 5e9)
    assert collective_seconds("weight_all_gather", 3 * shard, 4 * shard, 1, cluster, t1) == pytest.approx(
        7 * shard / 10e9
    )
    for config in (t1, t2):
        assert collective_seconds("gradient_all_to_all_inter", 0, shard, 1, cluster, config) == pytest.approx(
            4 * shard / 10e9
        )


def test_a_tensor_parallel_job_sends_what_its_data_parallel_job_sends():
    """Global rank 5 of 8 (nodes of 4) at t = 2 is data-parallel rank 2 of 4 (nodes of 2), hpZ inside its node's 2
    data-parallel ranks included; at t = 4 (the node filled) qgZ is one INT4 hop across nodes, nothing inside the
    node, and hpZ is off."""
    local = tensor_parallel_units(SMALL, 2)
    for kwargs in (CONFIGS["zero3"], CONFIGS["zeropp"]):
        tp = step_bytes(local, ZeroPPConfig(**kwargs, tensor_parallel_size=2), 8, 4, 5)
        # the defaults' "auto" scope: norm gains and biases exact with tensor parallelism, as "matrices" does in 1-D
        dp = step_bytes(local, ZeroPPConfig(**kwargs, gradient_quantization_scope="matrices"), 4, 2, 2)
        assert tp == dp
    assert "gradient_reduce_scatter_vectors" in tp
    hpz = step_bytes(local, ZeroPPConfig(tensor_parallel_size=2), 8, 4, 5)
    assert hpz["weight_all_gather_secondary"][1] == 0 < hpz["weight_all_gather_secondary"][0]
    assert "weight_all_gather_backward" not in hpz
    filled = step_bytes(tensor_parallel_units(SMALL, 4), ZeroPPConfig(tensor_parallel_size=4), 8, 4, 5)
    assert sorted(filled) == ["gradient_all_to_all_inter", "gradient_reduce_scatter_vectors", "weight_all_gather",
                             "weight_all_gather_backward"]  # fmt: skip
    assert all(intra == 0 and inter > 0 for intra, inter, _ in filled.values())


def test_activation_traffic_is_reported_apart_and_never_crosses_nodes():
    """The activations' all-reduces change neither data-parallel column; without a width they are left out, and each
    row says so; the table shows them in their own columns where tensor parallelism was asked for."""
    cluster, workload = Cluster(2, 4, 100.0, 3600.0), Workload(512)
    configs = {"zeropp": CONFIGS["zeropp"]}
    wide = predict(SMALL, cluster, workload, configs, n_embd=64, tensor_parallel_size=2)[0]
    blind = predict(SMALL, cluster, workload, configs, n_embd=0, tensor_parallel_size=2)[0]
    assert wide.bytes_by_kind == blind.bytes_by_kind and wide.comm_s == blind.comm_s
    assert (wide.inter_node_gb, wide.intra_node_gb) == (blind.inter_node_gb, blind.intra_node_gb)
    assert wide.inter_node_gb == sum(v[1] for v in wide.bytes_by_kind.values()) / 1e9
    assert wide.tensor_parallel_gb == 0.001572864 and blind.tensor_parallel_gb == blind.tensor_parallel_s == 0
    assert wide.step_s == pytest.approx(blind.step_s + wide.tensor_parallel_s, rel=1e-12)
    assert wide.notes == [] and blind.notes == ["no model width: the activations' all-reduces are left out"]
    head, _, cells = table([wide], tensor_parallel=True).splitlines()
    assert "| intra GB/GPU | TP GB/GPU | compute s | comm s | TP s | step s |" in head and "| 0.002 |" in cells
    assert "TP" not in table([wide])


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("t", [3, 0, -2, 16])
def test_a_size_that_does_not_divide_the_node_is_refused(t):
    with pytest.raises(ValueError, match=rf"`tensor_parallel_size={t}` must be an int >= 1 that divides"
                       r" gpus_per_node=8 .*use one of \[1, 2, 4, 8\]\.$"):  # fmt: skip
        predict(SMALL, Cluster(2, 8, 100.0, 3600.0), Workload(512), ZERO3, 64, tensor_parallel_size=t)


def test_what_the_strategy_refuses_with_tensor_parallelism_the_planner_refuses():
    """hpZ combines with tensor parallelism (its size counts data-parallel ranks: 3 does not divide 4 of them);
    HSDP and weight deltas do not yet, and the planner says so in the strategy's words."""
    cluster = Cluster(2, 4, 100.0, 3600.0)
    with pytest.raises(ValueError, match=r"`hpz_partition_size=3` is not allowed; the secondary partition must divide"
                       r" the 4 data-parallel ranks"):  # fmt: skip
        predict(SMALL, cluster, Workload(512), {"zeropp": dict(hpz_partition_size=3)}, 64, tensor_parallel_size=2)
    two = predict(SMALL, cluster, Workload(512), {"zeropp": dict(hpz_partition_size=2)}, 64, tensor_parallel_size=2)
    assert two[0].memory_gib["hpz_copy"] > 0
    configs, refused = plannable(cluster, 2)
    assert list(configs) == ["zero3", "zeropp", "zeropp+ef", "zeropp+qgz8"]
    assert [line.split(":")[0] for line in refused] == ["hsdp", "qhsdp", "zeropp+deltas"]
    assert all("tensor_parallel_size=2" in line for line in refused)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--tensor-parallel-size", "3"], "--tensor-parallel-size=3: must be a size >= 1 that divides"
         " --gpus-per-node=8 (tensor parallelism stays inside a node): use one of 1, 2, 4, 8, or auto"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size=0: must be a size >= 1"),
        (["--tensor-parallel-size", "4", "--gpus-per-node", "6"], "use one of 1, 2, 3, 6, or auto"),
        (["--tensor-parallel-size", "two"], "'two' is not a size; use a whole number"),
    ],
)  # fmt: skip
def test_the_cli_refuses_a_bad_size_in_one_line(capsys, argv, named):
    assert named in refused(capsys, argv)


# ------------------------------------------------------------------------------------------------ t = 1
def test_without_tensor_parallelism_the_plan_is_as_before(tmp_path, capsys):
    """t = 1 (the default, or given): the same rows, the same printed plan, no tensor-parallel column, line or JSON
    key."""
    cluster, workload = Cluster(2, 4, 100.0, 3600.0), Workload(512)
    assert predict(SMALL, cluster, workload, n_embd=64) == predict(SMALL, cluster, workload, n_embd=64,
                                                                   tensor_parallel_size=1)  # fmt: skip
    printed = []
    for extra in ([], ["--tensor-parallel-size", "1"]):
        main(["--json", str(tmp_path / "plan.json"), *extra])
        printed.append(capsys.readouterr().out)
        saved = json.loads((tmp_path / "plan.json").read_text())
        assert "tensor_parallel_size" not in saved and not any("tensor" in k for k in saved["recommendation"])
        assert not any(k.startswith("tensor") for row in saved["rows"] for k in row)
    assert printed[0] == printed[1]
    plan = printed[0].split("\nwrote ")[0]  # the JSON's path holds the test's name
    assert "TP GB/GPU" not in plan and "tensor" not in plan.lower()


# ------------------------------------------------------------------------------------------------ recommendation
def _rows(t: int, steps: dict[str, float], unfit: tuple[str, ...] = ()) -> list[Row]:
    rows = [Row(name, {"total": 90.0 if name in unfit else 10.0}, name not in unfit, 1.0, 1.0, {}, 0.3, step - 0.3,
                step, tensor_parallel_size=t) for name, step in steps.items()]  # fmt: skip
    for r in rows:
        r.speedup = rows[0].step_s / r.step_s
    return rows


def _choose(by_size: dict[int, list[Row]], cluster: Cluster):
    verdicts = {t: verdict(rows, cluster) for t, rows in by_size.items()}
    return choose_tensor_parallel(verdicts, by_size, cluster)


def test_a_larger_size_must_fit_and_beat_the_choice_by_the_margin():
    cluster = Cluster(2, 4, 100.0, 3600.0)
    v = _choose({1: _rows(1, {"zero3": 1.0}), 2: _rows(2, {"zero3": 0.95}), 4: _rows(4, {"zero3": 0.8}, ("zero3",))},
                cluster)  # fmt: skip
    assert (v.config, v.tensor_parallel_size) == ("zero3", 1)
    assert v.tensor_parallel.startswith("don't use it (t = 1): no tensor-parallel size that fits is more than 10%")
    assert "a static model" in v.tensor_parallel
    assert v.tensor_parallel_passed_over == [
        "t = 2 (zero3) is 5% faster, within the 10% margin",
        "t = 4 (zero3) would be 25% faster, but nothing fits: the smallest needs 90.0 GiB per GPU of 80",
    ]
    text = verdict_text(v)
    assert text.startswith("verdict: stay on ZeRO-3") and "  tensor parallel: don't use it (t = 1)" in text
    v = _choose({1: _rows(1, {"zero3": 1.0}), 2: _rows(2, {"zero3": 0.9}), 4: _rows(4, {"zero3": 0.8})}, cluster)
    assert v.tensor_parallel_size == 4  # 0.9 is within the margin of 1.0, 0.8 is not
    assert v.tensor_parallel.startswith("t = 4: predicted step 0.8 s, 1.25x t = 1's (zero3, 1 s); cross-node GB")
    assert "ZeroPPStrategy(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False," in v.python
    assert v.python.endswith(" tensor_parallel_size=4))") and v.alias is None
    text = verdict_text(v)
    assert text.startswith("verdict: use ZeRO-3 (FSDP2 full sharding; exact), with tensor parallelism 4 inside each")
    assert "          # configure_model: parallelize_module(..., self.device_mesh['tensor_parallel'], plan)" in text
    v = _choose({1: _rows(1, {"zero3": 1.0}, ("zero3",)), 2: _rows(2, {"zero3": 2.0})}, cluster)
    assert v.tensor_parallel_size == 2 and v.tensor_parallel.startswith(
        "t = 2: nothing fits without tensor parallelism (t = 1 needs 90.0 GiB per GPU of 80); predicted step 2 s"
    )
    v = _choose({1: _rows(1, {"zero3": 1.0}, ("zero3",)), 2: _rows(2, {"zero3": 2.0}, ("zero3",))}, cluster)
    assert v.config is None and v.tensor_parallel.startswith("nothing fits at any size")
    assert "  tensor parallel: nothing fits at any size" in verdict_text(v)


MEDIUM = gpt_units(50304, 128, 2, 2048)  # 0.2B parameters, two thirds of them in the root (the vocabulary)


def test_the_planner_recommends_tensor_parallelism_where_the_model_does_not_fit_without_it():
    """0.9 GiB per GPU, 8 GPUs: the two largest units gathered in bf16 (each twice: the one computing, the one
    prefetched) take most of it at t = 1; at t = 4 a quarter of their matrices. Nothing fits at t = 1; at t = 2 the
    ZeRO++ defaults' bound is just over (with tensor parallelism they carry norm gains and biases exactly, whose copies
    of qgZ's last rows the bound counts), so the planner takes t = 4, where they fit. With 0.96 GiB they fit at t = 2,
    which keeps two data-parallel ranks per node, so hpZ's backward gather stays in the node (at t = 4 it crosses
    nodes), and its step is the shorter: t = 2 wins, also over ZeRO-3 at t = 1 (which fits there)."""
    cluster = Cluster(2, 4, 100.0, 3600.0, gpu_memory_gib=0.9)
    by_size, refused, verdicts = compare_tensor_parallel(MEDIUM, cluster, Workload(16), [1, 2, 4], n_embd=2048)
    root1 = 50304 * 2048 + 128 * 2048 + 2 * 2048
    block1 = 12 * 2048 * 2048 + 13 * 2048
    root4 = 12576 * 2048 + 128 * 2048 + 2 * 2048
    # a quarter of the matrices and of the widening layers' biases; the 4 norm vectors and 2 projection biases whole
    block4 = 3 * 2048 * 2048 + 6144 // 4 + 8192 // 4 + (4 + 2) * 2048
    assert (root4, block4) == (26_021_888, 12_598_784)
    assert by_size[1][0].memory_gib["unsharded_units"] * 2**30 == 2 * 2 * (root1 + block1)
    assert by_size[4][0].memory_gib["unsharded_units"] * 2**30 == 2 * 2 * (root4 + block4)
    assert not any(r.fits for r in by_size[1]) and verdicts[1].config is None
    t2, t4 = (next(r for r in by_size[t] if r.config == "zeropp") for t in (2, 4))
    assert not t2.fits and t4.fits and 0.9 < t2.memory_gib["total"] < 0.96
    v = choose_tensor_parallel(verdicts, by_size, cluster)
    assert (v.config, v.tensor_parallel_size) == ("zeropp", 4)
    assert v.tensor_parallel.startswith("t = 4: nothing fits without tensor parallelism (t = 1 needs 1.0 GiB per GPU"
                                        " of 0.9)")  # fmt: skip
    assert t2.step_s < t4.step_s and t2.memory_gib["hpz_copy"] > 0 == t4.memory_gib["hpz_copy"]
    assert "weight_all_gather_backward" in t4.bytes_by_kind and "weight_all_gather_backward" not in t2.bytes_by_kind
    assert label("zeropp", 4, 4) == (
        "ZeRO++ (INT8 weights, INT4 gradients across nodes; lossy), with tensor parallelism 4 inside each node"
    )
    roomier = Cluster(2, 4, 100.0, 3600.0, gpu_memory_gib=0.96)
    by_size, _, verdicts = compare_tensor_parallel(MEDIUM, roomier, Workload(16), [1, 2, 4], n_embd=2048)
    v = choose_tensor_parallel(verdicts, by_size, roomier)
    assert (v.config, v.tensor_parallel_size) == ("zeropp", 2) and verdicts[4].config == "zeropp"
    assert verdicts[1].config == "zero3"
    assert v.label == (
        "ZeRO++ (INT8 weights, hpZ, INT4 gradients across nodes; lossy), with tensor parallelism 2 inside each node"
    )
    assert v.python.endswith("strategy=ZeroPPStrategy(tensor_parallel_size=2))")
    assert "tensor parallel 2: " in v.reason and " GB of activation all-reduces per GPU per step inside" in v.reason
    # the same model with room for it: nothing larger is enough faster, and t = 1 keeps weight deltas and hpZ
    roomy = Cluster(2, 4, 100.0, 3600.0)
    by_size, _, verdicts = compare_tensor_parallel(MEDIUM, roomy, Workload(16), [1, 2, 4], n_embd=2048)
    v = choose_tensor_parallel(verdicts, by_size, roomy)
    assert (v.config, v.tensor_parallel_size) == ("zeropp+deltas", 1)
    assert v.tensor_parallel.startswith("don't use it (t = 1)") and v.tensor_parallel_passed_over == []


def test_the_cli_plans_a_size_or_compares_them(tmp_path, capsys):
    """``--tensor-parallel-size 2``: one table with the tensor-parallel columns, the strategy's refusals, a verdict
    whose code selects t = 2, a JSON with the activation bytes apart; ``auto``: a table per size, and the
    recommendation."""
    path = tmp_path / "plan.json"
    main(["--tensor-parallel-size", "2", "--json", str(path)])
    out = capsys.readouterr().out
    saved = json.loads(path.read_text())
    assert "tensor:   2 inside each node, ZeRO++ over 8 data-parallel ranks, 4 per node" in out
    assert "| TP GB/GPU |" in out and "not planned: hsdp: ZeroPPStrategy: `tensor_parallel_size=2`" in out
    assert saved["tensor_parallel_size"] == 2 and {r["tensor_parallel_size"] for r in saved["rows"]} == {2}
    # the demo: 4 layers x 6 all-reduces of 2 x 4096 tokens x 256, bf16, half of each to the one peer, twice
    assert all(r["tensor_parallel_gb"] == 4 * 6 * 2 * 4096 * 256 * 2 / 1e9 for r in saved["rows"])
    for r in saved["rows"]:
        assert r["inter_node_gb"] == sum(v[1] for v in r["bytes_by_kind"].values()) / 1e9
    rec = saved["recommendation"]
    assert rec["tensor_parallel_size"] == 2 and rec["python"] in out
    trainer = eval(rec["python"], {"Trainer": dict, "ZeroPPStrategy": ZeroPPConfig})
    assert trainer["strategy"] == ZeroPPConfig(**CONFIGS[rec["config"]], tensor_parallel_size=2)
    main(["--tensor-parallel-size", "auto", "--json", str(path)])
    out = capsys.readouterr().out
    saved = json.loads(path.read_text())
    assert "tensor:   auto: each size that divides the node (1, 2, 4, 8) planned and one recommended" in out
    assert all(f"tensor_parallel_size={t}:\n| config |" in out for t in (1, 2, 4, 8))
    assert saved["tensor_parallel_size"] == "auto"
    assert {r["tensor_parallel_size"] for r in saved["rows"]} == {1, 2, 4, 8}
    assert "tensor_parallel_size=2: hsdp: " in "\n".join(saved["not_planned"])
    assert f"  tensor parallel: {saved['recommendation']['tensor_parallel']}" in out
