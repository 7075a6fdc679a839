"""The example through LightningCLI: the demo config trains for real (4 processes as 2 nodes), and configs parse."""

import csv
import math
import re
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
    assert s.auto_wrap_policy == ["Block"]
    assert s.activation_checkpointing_policy == ["CausalSelfAttention"]


@pytest.mark.parametrize(("alias", "quantized", "hpz"), [("zeropp", True, "auto"), ("zero3", False, 1)])
def test_string_alias_parses(train, alias, quantized, hpz):
    cli = _parse(train, "--trainer.strategy", alias)
    s = cli.trainer.strategy
    assert isinstance(s, ZeroPPStrategy)
    assert s.zeropp_config.hpz_partition_size == hpz
    assert s.zeropp_config.quantize_weights is quantized and s.zeropp_config.quantize_gradients is quantized


def test_bad_value_in_yaml_is_refused(train, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_zeropp.ZeroPPStrategy\n    init_args:\n      weight_bits: 5\n"
    )
    with pytest.raises((SystemExit, ValueError)) as refused:
        _parse(train, "--config", str(bad))
    # jsonargparse checks the Literal and exits with the reason on stderr; a ValueError would be ZeroPPConfig's
    reason = str(refused.value) + capsys.readouterr().err
    assert re.search(r"weight_bits.*\b5\b", reason, re.S), reason[-2000:]
