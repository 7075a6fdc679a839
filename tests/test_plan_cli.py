"""``python -m lightning_zeropp.planner`` as a new user meets it: bad input refused in one line, every assumption shown
and presets for the usual GPUs, and a verdict that can say "stay on ZeRO-3", says why a faster configuration lost,
and prints the code that selects its choice."""

import json
import sys
import types
from pathlib import Path

import pytest
import yaml

from lightning_zeropp import planner, recommendation
from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.planner import GPUS, main
from lightning_zeropp.prediction import CONFIGS, Cluster, Row
from lightning_zeropp.recommendation import verdict

# the first H200 run's kernel table: timed with the launcher inside (no device time)
ROOT_H200_TABLE = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "kernels" / "gpu_check_h200" / "kernels_256mb.json"
)


def refused(capsys, argv: list[str]) -> str:
    """The one line ``argv`` is refused with (exit code 2, nothing else on stderr, nothing on stdout)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, (exit_info.value.code, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _plan_json(tmp_path, capsys, argv: list[str]) -> tuple[dict, str]:
    path = tmp_path / "plan.json"
    main([*argv, "--json", str(path)])
    return json.loads(path.read_text()), capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--params=-7e9"], "--params=-7e9"),  # was: TypeError, type complex doesn't define __round__
        (["--params", "0"], "--params=0"),
        (["--params", "inf"], "--params=inf"),
        (["--n-layer", "0"], "--n-layer=0"),  # was: 0 silently meant "derive"
        (["--n-embd", "0", "--n-layer", "4"], "--n-embd=0"),
        (["--vocab", "0"], "--vocab=0"),
        (["--block-size", "0"], "--block-size=0"),
        (["--tokens", "0"], "--tokens=0"),
        (["--efficiency", "2"], "--efficiency=2"),
        (["--efficiency", "0"], "--efficiency=0"),
        (["--overlap", "1.5"], "--overlap=1.5"),
        (["--optimizer-states", "-1"], "--optimizer-states=-1"),
        (["--nodes", "0"], "--nodes=0"),  # was: ValueError from Cluster, under a traceback
        (["--gpus-per-node", "0"], "--gpus-per-node=0"),
        (["--inter-gbps", "0"], "--inter-gbps=0"),
        (["--intra-gbps=-100"], "--intra-gbps=-100"),
        (["--inter-latency-us=-1"], "--inter-latency-us=-1"),
        (["--gpu-memory-gib", "0"], "--gpu-memory-gib=0"),
        (["--peak-tflops", "0"], "--peak-tflops=0"),
        (["--hbm-gbps", "nan"], "--hbm-gbps=nan"),
        (["--margin=-0.1"], "--margin=-0.1"),
        (["--gpu", "H300"], "--gpu"),
        (["--params", "7e9", "--n-layer", "32", "--n-embd", "8192"], "26.22B parameters"),  # was: --params ignored
        (["--n-layer", "32"], "add --n-embd"),  # was: silently 32 layers of the demo's width
        (["--params", "1000"], "7.16M parameters"),  # was: a 3.3M model planned for "1000"
        (["--litgpt", "pythia-1b", "--params", "1e9"], "drop --params"),
        (["--json", "/nonexistent-folder/plan.json"], "/nonexistent-folder does not exist"),
    ],
)
def test_bad_input_is_refused_in_one_line(capsys, argv, named):
    assert named in refused(capsys, argv)


def test_params_beside_a_shape_that_makes_it_is_a_check(tmp_path, capsys):
    """``--params`` with ``--n-layer`` and ``--n-embd`` (the README's commands): the shape decides, within 10%."""
    saved, _ = _plan_json(tmp_path, capsys, ["--params", "7e9", "--n-layer", "32", "--n-embd", "4096"])
    assert saved["model"].startswith("GPT, 32 layers x 4096 wide, vocabulary 50304, 4096 positions (6.67B")


def test_litgpt_missing_or_unknown_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "litgpt", None)  # not installed
    assert "pip install litgpt" in refused(capsys, ["--litgpt", "pythia-1b"])

    def from_name(name):
        raise ValueError(f"{name!r} is not a supported config name")

    fake = types.ModuleType("litgpt")
    fake.Config, fake.GPT = types.SimpleNamespace(from_name=from_name), None
    monkeypatch.setitem(sys.modules, "litgpt", fake)  # installed, the name unknown: was a traceback
    assert "--litgpt pythya-1b: litgpt has no config of that name" in refused(capsys, ["--litgpt", "pythya-1b"])


def test_plot_without_matplotlib_is_one_line_before_planning(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "needs matplotlib" in refused(capsys, ["--plot", str(tmp_path / "plan.png")])


def test_an_error_from_deeper_down_is_one_line(capsys, monkeypatch):
    """A check in ZeroPPConfig or the cost model that the CLI's own checks did not foresee: its message, one line."""

    def predict(*args, **kwargs):
        raise ValueError("costs: `something=3` must divide 8;\nuse 1, 2, 4 or 8.")

    monkeypatch.setattr(recommendation, "predict", predict)
    assert "`something=3` must divide 8; use 1, 2, 4 or 8." in refused(capsys, ["--params", "1e9"])


def test_one_gpu_per_node_plans_what_can_run(tmp_path, capsys):
    """Weight deltas need hpZ, which needs 2 or more GPUs per node: that row is left out and said so (it used to
    end the plan with ZeroPPConfig's ValueError)."""
    saved, out = _plan_json(tmp_path, capsys, ["--params", "1e9", "--nodes", "4", "--gpus-per-node", "1"])
    assert [r["config"] for r in saved["rows"]] == [c for c in CONFIGS if c != "zeropp+deltas"]
    assert "not planned: zeropp+deltas: ZeroPPStrategy: `weight_deltas=True` needs hpZ" in out
    assert saved["not_planned"][0].startswith("zeropp+deltas:")


# ------------------------------------------------------------------------------------------------ assumptions
def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    for shown in ("--nodes NODES nodes (machines) in the job (default: 2)", "(default: H100)", "(default: 100.0)",
                  "(default: 4096)", "(default: bf16-mixed)", "(default: 0.645)", "(default: 0.1)",
                  "memory per GPU, GiB (default: --gpu's)", "default: 50304 for --params or a shape"):  # fmt: skip
        assert shown in text, shown


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_gpu_presets_and_flags_over_them(tmp_path, capsys, gpu):
    saved, _ = _plan_json(tmp_path, capsys, ["--params", "1e9", "--gpu", gpu])
    for name, value in GPUS[gpu].items():
        assert saved["cluster"][name] == value
    saved, out = _plan_json(tmp_path, capsys, ["--params", "1e9", "--gpu", gpu, "--gpu-memory-gib", "24"])
    assert saved["cluster"]["gpu_memory_gib"] == 24.0 and saved["cluster"]["peak_tflops"] == GPUS[gpu]["peak_tflops"]
    assert f"{gpu}: 24 GiB, {GPUS[gpu]['peak_tflops']:g} TFLOP/s dense" in out  # chosen, so no * on either


def test_header_states_every_assumption_and_marks_defaults(capsys):
    main(["--params", "7e9", "--nodes", "4", "--inter-gbps", "3200"])
    head = capsys.readouterr().out.split("\n\n")[0]
    for shown in ("GPT, 32 layers x 4224 wide, vocabulary 50304*, 4096 positions* (7.08B parameters, --params 7e9)",
                  "4 nodes x 8 GPUs* = 32 GPUs, H100*: 80 GiB*, 989 TFLOP/s* dense, 3350 GB/s* HBM per GPU",
                  "3200 Gbit/s into each node (5 us*), 3600 Gbit/s* per GPU inside a node (2 us*)",
                  "4096 tokens* per GPU per step, bf16-mixed*, 2 fp32 optimizer values* per parameter,"
                  " activation checkpointing*", "efficiency 0.645* of peak, overlap 0*", "verdict margin 10%*",
                  "* = a default"):  # fmt: skip
        assert shown in head, shown
    assert "NOTE" not in head


def test_without_a_model_the_demo_is_announced(capsys):
    main([])
    head = capsys.readouterr().out.split("\n\n")[0]
    assert head.startswith("NOTE: no model given, so this plans the example's demo model, 3.26M parameters: pass")
    assert "vocabulary 256, 128 positions" in head


# ------------------------------------------------------------------------------------------------ verdict
def _row(config: str, step_s: float, fits: bool = True) -> Row:
    return Row(config, {"total": 10.0}, fits, 0.0, 0.0, {}, 0.3, step_s - 0.3, step_s)


def _rows(steps: dict[str, float], unfit: tuple[str, ...] = ()) -> list[Row]:
    slowest = 2 * max(steps.values())  # a configuration the test leaves out never wins
    rows = [_row(name, steps.get(name, slowest), name not in unfit) for name in CONFIGS]
    for r in rows:
        r.speedup = rows[0].step_s / r.step_s
    return rows


def test_one_node_stays_on_zero3_whatever_the_rows_say():
    """On one node nothing crosses nodes: a lossy configuration is not chosen even if the rows have it faster (as
    they did before the strategy turned qwZ off on one node); HSDP, exact, would be."""
    steps = {"zero3": 1.0, "hsdp": 1.0, "qhsdp": 0.7, "zeropp": 0.6, "zeropp+ef": 0.6, "zeropp+deltas": 0.5}
    v = verdict(_rows(steps), Cluster(1, 8, 100.0, 3600.0))
    assert v.config == "zero3" and "one node" in v.reason
    assert any(p.startswith("zeropp+deltas is 100% faster, but lossy, and on one node") for p in v.passed_over)
    assert any(p.startswith("qhsdp is 43% faster, but lossy, and on one node") for p in v.passed_over)
    assert verdict(_rows(steps), Cluster(2, 8, 100.0, 3600.0)).config == "zeropp+deltas"


def test_each_step_up_must_beat_the_choice_by_the_margin():
    steps = {"zero3": 1.0, "hsdp": 0.95, "qhsdp": 0.94, "zeropp": 0.92, "zeropp+ef": 0.92, "zeropp+deltas": 0.85}
    cluster = Cluster(4, 8, 3200.0, 3600.0)
    v = verdict(_rows(steps), cluster, margin=0.10)
    assert v.config == "zeropp+deltas"  # 18% faster than zero3: the ones in between do not block it
    v = verdict(_rows({**steps, "zeropp+deltas": 0.93}), cluster, margin=0.10)
    assert v.config == "zero3" and "nothing else that fits is more than 10% faster" in v.reason
    assert "zeropp is 9% faster, within the 10% margin, and lossy" in v.passed_over
    assert "hsdp is 5% faster, within the 10% margin" in v.passed_over
    assert "qhsdp is 6% faster, within the 10% margin, and lossy" in v.passed_over
    assert verdict(_rows({**steps, "zeropp+deltas": 0.93}), cluster, margin=0.05).config == "hsdp"  # 5.3% > 5%
    v = verdict(_rows({**steps, "zeropp": 0.8, "zeropp+ef": 0.8, "zeropp+deltas": 0.75}), cluster, margin=0.10)
    assert v.config == "zeropp" and "zeropp+deltas is 7% faster, within the 10% margin" in v.passed_over  # no "lossy"
    v = verdict(_rows(steps, unfit=("zeropp+deltas",)), cluster, margin=0.0)
    assert v.config == "zeropp" and "zeropp+deltas is 8% faster, but needs 10.0 GiB per GPU of 80" in v.passed_over
    v = verdict(_rows(steps, unfit=tuple(CONFIGS)), cluster)
    assert v.config is None and "nothing fits" in v.label and v.python == ""


def test_quantized_hsdp_is_lossy_where_its_gradients_cross_nodes():
    """qhsdp quantizes what crosses nodes: chosen over HSDP only by the margin, named lossy, compared with the
    fastest exact configuration; a ZeRO++ row must beat it by the margin too."""
    steps = {"zero3": 1.0, "hsdp": 0.8, "qhsdp": 0.6, "zeropp": 0.56, "zeropp+ef": 0.56, "zeropp+deltas": 0.56}
    v = verdict(_rows(steps), Cluster(4, 8, 100.0, 3600.0))
    assert v.config == "qhsdp" and "quantized HSDP" in v.label and "lossy" in v.label
    assert "(1.33x hsdp's, the fastest exact one)" in v.reason and "lossy: compare its loss curve" in v.reason
    assert "zeropp is 7% faster, within the 10% margin" in v.passed_over  # both lossy: no "and lossy"
    assert verdict(_rows({**steps, "qhsdp": 0.75}), Cluster(4, 8, 100.0, 3600.0)).config == "zeropp"


@pytest.mark.parametrize(
    ("argv", "config", "speedup"),
    [
        (["--params", "7e9", "--nodes", "1", "--gpus-per-node", "8"], "zero3", 1.0),  # was: zeropp (1.06x)
        (["--params", "7e9", "--nodes", "4", "--inter-gbps", "3200"], "zero3", 1.0),  # was: zeropp (1.01x)
        (["--params", "7e9", "--nodes", "4", "--inter-gbps", "100"], "zeropp+deltas", 4.11),
        (["--params", "70e9", "--nodes", "32", "--gpu-memory-gib", "50"], "zeropp", 2.92),
        (["--params", "7e9", "--nodes", "4", "--inter-gbps", "3200", "--margin", "0.05"], "zeropp", 1.06),
    ],
)
def test_cli_verdict_and_its_json(tmp_path, capsys, argv, config, speedup):
    saved, out = _plan_json(tmp_path, capsys, argv)
    rec = saved["recommendation"]
    assert rec["config"] == config and rec["speedup"] == pytest.approx(speedup, abs=0.005)
    verb = "stay on" if config == "zero3" else "use"
    assert f"verdict: {verb} {rec['label']} [{config}]" in out and rec["python"] in out
    assert rec["margin"] == saved["margin"] == float(argv[argv.index("--margin") + 1] if "--margin" in argv else 0.1)
    if "--gpu-memory-gib" in argv:  # weight deltas is faster still but holds more than 50 GiB per GPU
        assert any(p.startswith("zeropp+deltas is 27% faster, but needs 52.8 GiB") for p in rec["passed_over"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_printed_code_selects_the_planned_configuration(name):
    """The Python line, the registered name and the YAML each give the configuration the row was planned with."""
    from lightning.pytorch.strategies import StrategyRegistry

    v = verdict(_rows({c: 1.0 if c != name else 0.5 for c in CONFIGS}), Cluster(4, 8, 100.0, 3600.0))
    assert v.config == name
    trainer = eval(v.python, {"Trainer": dict, "ZeroPPStrategy": ZeroPPConfig})  # the configuration it builds
    assert trainer["strategy"] == ZeroPPConfig(**CONFIGS[name]) and (trainer["num_nodes"], trainer["devices"]) == (4, 8)
    if v.alias is not None:
        assert StrategyRegistry[v.alias]["init_params"] == CONFIGS[name]
    assert (v.alias is not None) == (name in ("zero3", "hsdp", "qhsdp", "zeropp"))
    parsed = yaml.safe_load(v.yaml)["trainer"]
    assert parsed["strategy"]["class_path"] == "lightning_zeropp.ZeroPPStrategy"
    assert parsed["strategy"].get("init_args", {}) == CONFIGS[name] and parsed["num_nodes"] == 4


@pytest.mark.slow
def test_the_printed_yaml_parses_in_lightning_cli(tmp_path):
    """The YAML block through the example's LightningCLI: a ZeroPPStrategy with the planned arguments."""
    from lightning_zeropp import ZeroPPStrategy
    from lightning_zeropp.testing.scripts import load_script

    root = planner.Path(__file__).resolve().parents[1] / "examples" / "gpt"
    train = load_script(root / "train.py", "gpt_example_train_plan")
    v = verdict(_rows({c: 1.0 if c != "hsdp" else 0.5 for c in CONFIGS}), Cluster(2, 2, 100.0, 3600.0))
    config = tmp_path / "strategy.yaml"
    config.write_text(v.yaml)
    base = root / "configs" / "cpu_demo.yaml"
    cli = train.GPTCLI(train.GPTModule, train.ByteCorpusDataModule, run=False,
                       args=["--config", str(base), "--config", str(config)])  # fmt: skip
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeroPPStrategy)
    assert strategy.zeropp_config.sharding_strategy == "HYBRID_SHARD"
    assert strategy.zeropp_config.quantize_weights is False and strategy.zeropp_config.quantize_gradients is False


def _planned(config: str, step_s: float, inter_gb: float, memory: float = 10.0, fits: bool = True) -> Row:
    return Row(config, {"total": memory}, fits, inter_gb, 1.0, {}, 0.1, step_s - 0.1, step_s)


def test_a_zeropp_verdict_says_what_the_long_run_setting_costs(capsys):
    """gradient_bits=8 only changes the inter-node gradient hop: its cost is the zeropp+qgz8 row less the zeropp
    row, added to whichever ZeRO++ configuration was chosen; an exact choice, or a plan without either row, gets no
    advice."""
    from lightning_zeropp.recommendation import LONG_RUN, long_run_advice, verdict_text

    assert LONG_RUN in CONFIGS and CONFIGS[LONG_RUN] == {"gradient_bits": 8}
    zero3, zeropp = _planned("zero3", 4.0, 30.0), _planned("zeropp", 1.0, 6.0)
    deltas, qgz8 = _planned("zeropp+deltas", 0.8, 1.0), _planned(LONG_RUN, 1.2, 6.5, memory=10.5)
    rows = [zero3, zeropp, deltas, qgz8]
    advice = long_run_advice(rows, zeropp, 80.0, adam=False)
    assert "add gradient_bits=8" in advice and "predicted step +20% (1.2 s)" in advice
    assert "cross-node bytes 1.08x" in advice and "docs/accuracy.md" in advice and "GiB" not in advice
    advice = long_run_advice(rows, deltas, 80.0, adam=False)  # +0.2 s on 0.8 s, +0.5 GB on 1.0 GB
    assert "predicted step +25% (1 s)" in advice and "cross-node bytes 1.50x" in advice
    assert long_run_advice(rows, zeropp, 10.2, adam=False).endswith("; but it needs 10.5 GiB per GPU of 10.2")
    # Adam: the defaults' correction already does it, no bytes more: nothing to add, nothing predicted
    advice = long_run_advice(rows, zeropp, 10.2)
    assert "second_moment_correction='auto'" in advice and "nothing to add" in advice and "predicted" not in advice
    for adam in (True, False):
        assert long_run_advice(rows, zero3, 80.0, adam) == "" and long_run_advice(rows, qgz8, 80.0, adam) == ""
        assert long_run_advice([zero3, zeropp, deltas], deltas, 80.0, adam) == ""
    for row in rows:
        row.speedup = zero3.step_s / row.step_s
    v = verdict(rows, Cluster(4, 8, 100.0, 3600.0), adam=False)
    assert (
        v.config == "zeropp+deltas"
        and "  long runs: if the last fraction of a percent of loss matters" in verdict_text(v)
    )
    v = verdict(rows, Cluster(4, 8, 100.0, 3600.0))
    assert "  long runs: the defaults take qgZ's rounding noise out of Adam's second moment" in verdict_text(v)
    v = verdict(rows, Cluster(1, 8, 100.0, 3600.0))  # one node: ZeRO-3, nothing to add
    assert v.config == "zero3" and v.long_run == "" and "long runs" not in verdict_text(v)


@pytest.mark.parametrize(
    "given, count", [("7B", 7e9), ("1.3B", 1.3e9), ("350M", 350e6), ("70b", 70e9), ("7e9", 7e9), ("1_300_000", 1.3e6)]
)
def test_params_takes_a_model_size_as_models_are_named(given, count):
    assert planner.parameter_count(given) == pytest.approx(count)


@pytest.mark.parametrize("given", ["7X", "B", "", "seven"])
def test_params_refuses_what_is_not_a_count_and_says_how_to_write_one(capsys, given):
    err = refused(capsys, [f"--params={given}"])
    assert "--params" in err and "7B, 1.3B, 350M" in err


def test_the_verdict_says_how_to_launch_the_job(capsys):
    main(["--params", "1.3B", "--nodes", "2", "--gpus-per-node", "4"])
    out = capsys.readouterr().out
    assert "srun --nodes 2 --ntasks-per-node 4 --gpus-per-node 4 python train.py" in out
    assert "torchrun --nnodes 2 --nproc-per-node 4 --node-rank <0..1>" in out


def _kernel_table(path, gbps: float, starved: bool = False, sizes=(12.65, 256.0)):
    """A table as benchmarks/kernels.py --json writes it on a GPU, every default kernel at ``gbps`` by device time."""
    rows = [
        {"kernel": name, "size_mb": mb, "bytes_moved": int(mb * 3e6), "device_s": mb * 3e6 / (gbps * 1e9),
         "host_s": 20e-6, "starved": starved}
        for mb in sizes for name in planner.DEFAULT_KERNELS
    ]  # fmt: skip
    path.write_text(json.dumps({"device": "NVIDIA H200", "rows": rows}))
    return path


def test_the_planner_times_the_kernels_at_what_the_device_measured(tmp_path, capsys):
    """Without --kernels the kernels run at HBM speed and the header says that is assumed; with a measured table,
    at its bytes over its device time: a quantized configuration's compute grows, an exact one's does not."""
    argv = ["--params", "7B", "--nodes", "4", "--gpu", "H200"]
    assumed = {r.config: r for r in main(argv)}
    out = capsys.readouterr().out
    assert "kernels:  at the HBM bandwidth: assumed" in out
    table = _kernel_table(tmp_path / "kernels.json", 1200.0)
    measured = {r.config: r for r in main([*argv, "--kernels", str(table)])}
    out = capsys.readouterr().out
    assert "kernels:  1200 GB/s by device time, measured (NVIDIA H200" in out
    assert measured["zero3"].compute_s == assumed["zero3"].compute_s
    assert measured["zeropp"].compute_s > assumed["zeropp"].compute_s
    # the kernels' time goes as 1 / speed: from 4800 (H200 HBM) to 1200 adds 3x what going to 2400 adds
    half = {r.config: r for r in main([*argv, "--kernels", str(_kernel_table(tmp_path / "k2.json", 2400.0))])}
    added = measured["zeropp"].compute_s - assumed["zeropp"].compute_s
    assert added / (half["zeropp"].compute_s - assumed["zeropp"].compute_s) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda d: ROOT_H200_TABLE, "its times include the launcher"),
        (lambda d: _kernel_table(d / "k.json", 1000.0, starved=True), "the device waited for the host"),
        (lambda d: _kernel_table(d / "k.json", 1000.0, sizes=(1.0,)), "no rows of"),
        (lambda d: (d / "k.json").write_text("{}") and d / "k.json", "not a table of benchmarks/kernels.py"),
    ],
)
def test_a_kernel_table_the_planner_cannot_trust_is_refused_in_one_line(tmp_path, capsys, make, says):
    err = refused(capsys, ["--params", "7B", "--kernels", str(make(tmp_path))])
    assert says in err and "--kernels" in err
