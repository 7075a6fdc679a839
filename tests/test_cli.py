"""The example through LightningCLI: the demo config trains for real (4 processes as 2 nodes), and configs parse."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt"
CONFIG = EXAMPLE / "configs" / "cpu_demo.yaml"


@pytest.mark.multiprocess
def test_demo_config_trains_two_steps(tmp_path):
    cmd = [
        sys.executable,
        str(EXAMPLE / "train.py"),
        "fit",
        "--config",
        str(CONFIG),
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--data.max_bytes",
        "300000",
        "--data.batch_size",  # the demo's model, strategy and precision; 2 sequences a rank keep bf16 on CPU short
        "2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics_file,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    train = [r for r in rows if r.get("train/loss")]
    assert len(train) == 2
    for r in train:
        assert math.isfinite(float(r["train/loss"]))
        assert float(r["comm/inter_node_MB"]) > 0 and float(r["comm/intra_node_MB"]) > 0
    assert any(r.get("val/loss") for r in rows)


@pytest.fixture(scope="module")
def train():
    """The example's ``train.py``, loaded from its file as a module (it imports ``model.py`` and ``data.py``)."""
    return load_script(EXAMPLE / "train.py", "gpt_example_train")


def _parse(train, *args):
    return train.GPTCLI(train.GPTModule, train.ByteCorpusDataModule, run=False, args=["--config", str(CONFIG), *args])


def test_class_path_form_parses(train):
    cli = _parse(
        train,
        "--trainer.strategy.init_args.weight_bits", "4",
        "--trainer.strategy.init_args.auto_wrap_policy", "[Block]",
        "--trainer.strategy.init_args.activation_checkpointing_policy", "[CausalSelfAttention]",
    )  # fmt: skip
    s = cli.trainer.strategy
    assert isinstance(s, ZeroPPStrategy)
    assert s.zeropp_config.ranks_per_node == 2 and s.zeropp_config.weight_bits == 4
    # the parser's restricted types become plain numbers (they are pickled into checkpoint metadata)
    numbers = [s.zeropp_config.gradient_block_size, s.zeropp_config.gradient_pieces, s.zeropp_config.ranks_per_node]
    assert [type(v) for v in numbers] == [int, int, int] and type(s.zeropp_config.error_feedback_decay) is float
    assert s.auto_wrap_policy == ["Block"]
    assert s.activation_checkpointing_policy == ["CausalSelfAttention"]


@pytest.mark.parametrize(
    ("alias", "weights", "gradients", "hpz"), [("zeropp", "auto", True, "auto"), ("zero3", False, False, 1)]
)
def test_string_alias_parses(train, alias, weights, gradients, hpz):
    cli = _parse(train, "--trainer.strategy", alias)
    s = cli.trainer.strategy
    assert isinstance(s, ZeroPPStrategy)
    assert s.zeropp_config.hpz_partition_size == hpz
    assert s.zeropp_config.quantize_weights == weights and s.zeropp_config.quantize_gradients is gradients


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("weight_bits", "5"),
        ("gradient_block_size", "0"),
        ("weight_block_size", "7"),
        ("gradient_pieces", "0"),
        ("error_feedback_decay", "0"),
        ("error_feedback_decay", "1.5"),
        ("error_feedback_reset", "-1"),
        ("hpz_partition_size", "0"),
        ("ranks_per_node", "-2"),
        ("gradient_rounding", "up"),
    ],
)
def test_bad_value_in_yaml_is_refused_at_parse_time(train, tmp_path, capsys, key, value):
    """Refused by the parser, before anything is built: the first lines name the key and the value, no traceback."""
    bad = tmp_path / "bad.yaml"
    strategy = "class_path: lightning_zeropp.ZeroPPStrategy\n    init_args:\n"
    bad.write_text(f"trainer:\n  strategy:\n    {strategy}      {key}: {value}\n")
    with pytest.raises(SystemExit):
        _parse(train, "--config", str(bad))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = err[err.index("error:") :].splitlines()
    reason = "\n".join(lines[:16])  # as for a Literal: the strategy key, then ours with the value
    assert f'Parser key "{key}"' in reason and value in reason, err[-3000:]


def test_deprecated_spelling_in_yaml_is_refused_naming_it(train, tmp_path, capsys):
    """The deprecated spellings are out of the signature (Python still takes them, with a warning): in a YAML file
    the parser refuses one, naming it."""
    old = tmp_path / "old.yaml"
    strategy = "class_path: lightning_zeropp.ZeroPPStrategy\n    init_args:\n"
    old.write_text(f"trainer:\n  strategy:\n    {strategy}      pipeline_stages: 4\n")
    with pytest.raises(SystemExit):
        _parse(train, "--config", str(old))
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Option 'pipeline_stages' is not accepted" in err, err[-3000:]


def test_the_zero3_overlay_keeps_the_runs_emulated_nodes(train):
    """``configs/zero3.yaml`` after the demo's config: ZeRO-3 (qwZ, hpZ, qgZ off) on the same 2 x 2 emulated nodes,
    so its bytes split across and inside nodes as the ZeRO++ run's do; the short form drops ``ranks_per_node``."""
    cli = _parse(train, "--config", str(EXAMPLE / "configs" / "zero3.yaml"))
    c = cli.trainer.strategy.zeropp_config
    assert c.ranks_per_node == 2
    assert (c.quantize_weights, c.hpz_partition_size, c.quantize_gradients) == (False, 1, False)
    short = _parse(train, "--trainer.strategy", "zero3").trainer.strategy.zeropp_config
    assert short.ranks_per_node == "auto"  # the emulated nodes lost: why the overlay exists
