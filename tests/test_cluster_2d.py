"""``benchmarks/cluster.py`` with tensor parallelism, without a cluster: the run configs each topology writes (strategy
class and arguments, devices and nodes, the baseline's mesh), the entry script parsing them, the ratios paired within a
topology, and the slow-link page's section on made-up rows (goal met, not met, undecided)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
cluster = load_script(BENCH / "cluster.py", "cluster_benchmark_2d")
llama_tp = load_script(BENCH / "llama_tp.py", "llama_tp_benchmark")
sys.path.insert(0, str(BENCH))

from pages import Source, slow_link  # noqa: E402

T2, T4 = cluster.Topology.parse("2x4t2"), cluster.Topology.parse("2x4t4")


def _config(name: str, topology, tmp_path: Path) -> dict:
    model = cluster.LLAMA if topology.tensor_parallel_size > 1 else cluster.MODEL
    return cluster.run_config(name, tmp_path / "probe", "veth0", 14, model, 1, topology)


def test_topologies_parse_into_meshes_and_baselines():
    flat = cluster.Topology.parse("2x2")
    assert (flat.name, flat.world_size, flat.data_parallel_size, flat.baseline) == ("2x2", 4, 4, "zero3")
    assert flat == cluster.DEFAULT_TOPOLOGY
    assert (T2.name, T2.world_size, T2.data_parallel_size, T2.baseline) == ("2x4t2", 8, 4, "model_parallel")
    assert (T4.name, T4.data_parallel_size) == ("2x4t4", 2)
    assert T2.tokens_per_step(batch_size=1, seq=64) == 4 * 64 and T4.tokens_per_step(1, 64) == 2 * 64
    for bad, why in (("3x2", "has 2 nodes"), ("2x4t3", "must divide the 4 ranks"), ("2by4", "NODESxRANKS")):
        with pytest.raises(ValueError, match=why):
            cluster.Topology.parse(bad)


@pytest.mark.parametrize("topology", [T2, T4], ids=lambda t: t.name)
def test_zeropp_runs_its_defaults_with_the_tensor_parallel_size_and_ranks_per_node_from_the_launch(topology, tmp_path):
    config = _config("zeropp", topology, tmp_path)
    trainer = config["trainer"]
    assert (trainer["num_nodes"], trainer["devices"], trainer["precision"]) == (2, 4, "bf16-mixed")
    assert trainer["strategy"] == {
        "class_path": "lightning_zeropp.ZeroPPStrategy",
        "init_args": {"tensor_parallel_size": topology.tensor_parallel_size},
    }
    assert config["model"] == cluster.LLAMA and config["data"]["batch_size"] == 1
    assert cluster.entry("zeropp", topology) == BENCH / "llama_tp.py"


@pytest.mark.parametrize("topology", [T2, T4], ids=lambda t: t.name)
def test_the_baseline_is_model_parallel_strategy_on_the_same_mesh(topology, tmp_path):
    base, zeropp = _config("model_parallel", topology, tmp_path), _config("zeropp", topology, tmp_path)
    t = topology.tensor_parallel_size
    assert base["trainer"]["strategy"] == {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 8 // t, "tensor_parallel_size": t},
    }
    # everything but the strategy is the same run: model, data, precision, steps, nodes and devices
    strip = [copy.deepcopy(c) for c in (base, zeropp)]
    for c in strip:
        del c["trainer"]["strategy"]
    assert strip[0] == strip[1]
    assert cluster.entry("model_parallel", topology) == cluster.entry("zeropp", topology)
    # ModelParallelStrategy's mesh is (data_parallel, tensor_parallel), row-major over the node-major ranks: each
    # tensor-parallel group is t consecutive ranks, inside one node, as ZeroPPStrategy's is
    groups = [list(range(g * t, (g + 1) * t)) for g in range(topology.world_size // t)]
    assert all(len({r // topology.ranks_per_node for r in group}) == 1 for group in groups)


def test_the_one_dimensional_runs_are_unchanged(tmp_path):
    flat = cluster.DEFAULT_TOPOLOGY
    zeropp, fsdp = _config("zeropp", flat, tmp_path), _config("fsdp", flat, tmp_path)
    assert (zeropp["trainer"]["num_nodes"], zeropp["trainer"]["devices"]) == (2, 2)
    assert zeropp["trainer"]["strategy"] == {"class_path": "lightning_zeropp.ZeroPPStrategy", "init_args": {}}
    assert fsdp["trainer"]["strategy"]["init_args"] == {"data_parallel_size": 4, "tensor_parallel_size": 1}
    assert zeropp["model"] == cluster.MODEL
    assert cluster.entry("zeropp", flat) == ROOT / "examples" / "gpt" / "train.py"
    assert cluster.entry("fsdp", flat) == BENCH / "fsdp_baseline.py"


def test_a_configuration_of_the_other_kind_of_topology_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'fsdp' does not run on topology 2x4t2"):
        _config("fsdp", T2, tmp_path)
    with pytest.raises(ValueError, match="'model_parallel' does not run on topology 2x2"):
        _config("model_parallel", cluster.DEFAULT_TOPOLOGY, tmp_path)


@pytest.mark.parametrize("name", ["zeropp", "model_parallel"])
def test_the_entry_script_parses_the_config_into_the_strategy_and_a_linked_sequence_length(name, tmp_path, monkeypatch):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_zeropp import ZeroPPStrategy

    monkeypatch.syspath_prepend(str(BENCH))  # the probe callback's class_path: step_probe.StepProbe
    monkeypatch.setattr(sys, "argv", ["llama_tp.py"])  # pytest's own arguments are not the CLI's
    path = tmp_path / "node0.yaml"
    path.write_text(yaml.safe_dump(_config(name, T4, tmp_path)))
    cli = llama_tp.LlamaCLI(llama_tp.LlamaTP, llama_tp.ByteCorpusDataModule, args=["--config", str(path)], run=False)
    strategy = cli.trainer.strategy
    if name == "zeropp":
        assert type(strategy) is ZeroPPStrategy and strategy.zeropp_config.tensor_parallel_size == 4
    else:
        assert type(strategy) is ModelParallelStrategy
        parsed = cli.config.trainer.strategy.init_args
        assert (parsed.data_parallel_size, parsed.tensor_parallel_size) == (2, 4)
    assert (cli.trainer.num_nodes, cli.trainer.num_devices) == (2, 4)
    assert cli.datamodule.hparams.block_size == cluster.LLAMA["max_seq_len"]
    assert (cli.model.param_dtype, cli.model.reduce_dtype) == ("bfloat16", "float32")
    assert sum(p.numel() for p in cli.model.parameters()) == cluster.llama_parameters(cluster.LLAMA)


def _summary(name: str, repeats: list[float], topology, ledger: bool, link_mb: float) -> dict:
    """A row as ``cluster.summarize`` leaves it, with the keys the main loop adds."""
    return {
        "config": name, "step_s": sorted(repeats)[len(repeats) // 2], "step_s_repeats": repeats,
        "step_s_interval": [min(repeats), max(repeats)], "step_s_all": repeats, "tokens_per_s": 100.0,
        "ledger_inter_bytes_per_step": 1e6 if ledger else None, "ledger_intra_bytes_per_step": 1e6 if ledger else None,
        "ledger_inter_bytes_per_step_by_kind": {}, "link_tx_bytes_per_step": link_mb * 1e6,
        "link_rx_bytes_per_step": link_mb * 1e6, "losses_finite": True, "last_loss": 5.0, "rate": 200.0,
        "delay_ms": 0.0, "topology": topology.name, "nodes": topology.nodes, "ranks_per_node": topology.ranks_per_node,
        "tensor_parallel_size": topology.tensor_parallel_size, "baseline": topology.baseline,
    }  # fmt: skip


def test_ratios_pair_each_row_with_its_own_topologys_baseline():
    flat = cluster.DEFAULT_TOPOLOGY
    rows = [
        _summary("zero3", [2.0, 4.0, 3.0], flat, True, 20.0),
        _summary("zeropp", [1.0, 2.0, 1.5], flat, True, 4.0),
        _summary("model_parallel", [3.0, 6.0, 4.5], T2, False, 30.0),
        _summary("zeropp", [1.0, 2.0, 1.5], T2, True, 5.0),
    ]
    cluster.add_ratios(rows)
    assert rows[1]["speedup_vs_zero3"] == 2.0 and rows[1]["link_ratio_vs_zero3"] == pytest.approx(0.2)
    assert rows[3]["speedup_vs_model_parallel"] == 3.0 and rows[3]["speedup_vs_model_parallel_interval"] == [3.0, 3.0]
    assert rows[3]["link_ratio_vs_model_parallel"] == pytest.approx(5 / 30)
    assert rows[3]["ledger_ratio_vs_model_parallel"] is None  # ModelParallelStrategy keeps no ledger
    assert "speedup_vs_zero3" not in rows[3]
    text = cluster.table(rows)
    assert "| 2x4t2 | 200 Mbit/s | zeropp | 1.500 [1.000, 2.000] | 100 | model_parallel | 3.00x [3.00, 3.00] |" in text


def _page_sources(zeropp_t2: list[float], zeropp_t4: list[float], base: list[float]) -> dict[str, Source]:
    rows = []
    for topology, zeropp in ((T2, zeropp_t2), (T4, zeropp_t4)):
        rows += [
            _summary("model_parallel", base, topology, False, 25.0),
            _summary("zeropp", zeropp, topology, True, 5.0),
        ]
    cluster.add_ratios(rows)
    meta = {"steps": 14, "warmup": 4, "batch_size": 1, "llama": cluster.LLAMA, "llama_parameters": 6_589_824}
    runs = [{"command": "python benchmarks/cluster.py --topologies 2x4t2 2x4t4", "date": "2026-12-08T00:00:00Z"}]
    return {slow_link.PATH_2D: Source(slow_link.PATH_2D, {"meta": meta, "rows": rows}, runs)}


def test_the_page_says_the_goal_is_met_only_where_the_paired_speedup_reaches_2x_with_the_intervals_apart():
    # t = 2: every round 2.5x, intervals apart; t = 4: 1.5x, apart but short of the goal
    sources = _page_sources([0.4, 0.8, 0.6], [2.0, 4.0, 3.0], [1.0, 2.0, 1.5])
    goals = slow_link._goals_2d(sources)
    assert goals[0].startswith("- t = 2:") and "**met**" in goals[0] and "paired 2.50x [2.50, 2.50]" in goals[0]
    assert goals[1].startswith("- t = 4:") and "**NOT met**" in goals[1] and "0.50x" in goals[1]
    text = slow_link._tensor_parallel(sources)
    assert "6,589,824 parameters" in text and "### Goal" in text
    assert "| `2x4t2` | 2 | 200 Mbit/s | `zeropp` | 0.600 [0.400, 0.800] |" in text
    # 25 MB a step at 200 Mbit/s is 1 s of a 1.5 s step; 5 MB is 0.2 s
    assert "25.000 MB/step on the link need 1.000 s of its 1.500 s step (67%, mostly the link); 0.500 s left" in text
    assert "need 0.200 s of its 3.000 s step (7%, mostly not the link); 2.800 s left" in text


def test_overlapping_intervals_fail_the_goal_even_at_a_2x_median():
    # the paired median is 2.2x, but one round's zeropp step (1.2 s) reaches model_parallel's fastest (1.0 s)
    sources = _page_sources([0.5, 0.9, 1.2], [0.5, 0.9, 1.2], [1.0, 2.0, 3.0])
    (goal, _) = slow_link._goals_2d(sources)
    assert "**NOT met**" in goal and "overlapping" in goal and "paired 2.22x" in goal


def test_fewer_than_three_repeats_leave_the_goal_undecided():
    sources = _page_sources([0.4, 0.5], [0.4, 0.5], [1.0, 2.0])
    assert all("**undecided: 2 repeat(s)" in g for g in slow_link._goals_2d(sources))


def test_the_page_sets_a_loaded_machines_run_beside_the_quiet_one_with_its_own_verdict():
    quiet = _page_sources([0.4, 0.8, 0.6], [0.4, 0.8, 0.6], [1.0, 2.0, 1.5])
    loaded = _page_sources([1.0, 1.4, 1.2], [1.0, 1.4, 1.2], [1.0, 2.0, 1.5])
    sources = {**quiet, slow_link.PATH_2D_LOADED: loaded[slow_link.PATH_2D]}
    text = slow_link._tp_loaded(sources)
    # zeropp's 5 MB at 200 Mbit/s are 0.2 s: a 1.2 s step leaves 1.0 s, the quiet run's 0.6 s leaves 0.4 s
    assert "`2x4t2` `zeropp`: 1.000 s of each step besides the link, against 0.400 s in the run above" in text
    assert text.count("**NOT met**") == 2 and "**met**" not in text
    assert slow_link._tp_loaded(quiet) == ""


def test_the_carried_vectors_run_is_judged_against_the_defaults_of_its_own_rounds():
    """``zeropp_matrices`` beside the defaults in one run: its step over theirs, paired by round, within 5% or not
    at each t, and issue 60's goal judged for both; no such section without the file."""
    base = _page_sources([0.4, 0.8, 0.6], [0.4, 0.8, 0.6], [1.0, 2.0, 1.5])[slow_link.PATH_2D]
    rows = [dict(r) for r in base.data["rows"]]
    for t, topology, factors in ((2, T2, [1.02, 1.04, 1.0]), (4, T4, [1.1, 1.2, 1.06])):
        zeropp = next(r for r in rows if r["config"] == "zeropp" and r["tensor_parallel_size"] == t)
        rows.append(_summary("zeropp_matrices", [s * f for s, f in zip(zeropp["step_s_repeats"], factors)], topology,
                             True, 5.0))  # fmt: skip
    cluster.add_ratios(rows)
    path = slow_link.PATH_2D_MATRICES
    sources = {path: Source(path, {"meta": base.data["meta"], "rows": rows}, base.runs)}
    text = slow_link._tp_matrices(sources)
    assert "- t = 2: `zeropp_matrices`' step over `zeropp`'s, paired by round: 1.020 [1.000, 1.040]" in text
    assert "t = 2" in text and text.split("- t = 4: `zeropp_matrices`")[0].endswith("**met**\n")
    assert (
        "paired by round: 1.100 [1.060, 1.200]; within 5% (the rule for a default, by the median): **NOT met**" in text
    )
    assert "- t = 2: `zeropp_matrices` at least 2x faster" in text and "- t = 4: `zeropp` at least 2x faster" in text
    assert slow_link._tp_matrices({}) == ""
