"""The example through LightningCLI: the demo config trains for real (4 processes as 2 nodes), and configs parse."""

import csv
import math
import subprocess
import sys

import pytest
from helpers import EXAMPLE, ROOT

from lightning_zeropp import ZeroPPStrategy

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


def _parse(*args):
    sys.path.insert(0, str(EXAMPLE))
    from data import ByteCorpusDataModule
    from model import GPTModule
    from train import GPTCLI

    return GPTCLI(GPTModule, ByteCorpusDataModule, run=False, args=["--config", str(CONFIG), *args])


def test_class_path_form_parses():
    cli = _parse(
        "--trainer.strategy.init_args.weight_bits", "4", "--trainer.strategy.init_args.wrap_modules", "[Block]"
    )
    s = cli.trainer.strategy
    assert isinstance(s, ZeroPPStrategy)
    assert s.zeropp_config.ranks_per_node == 2 and s.zeropp_config.weight_bits == 4
    assert s._wrap_modules == ["Block"]


@pytest.mark.parametrize(("alias", "quantized", "hpz"), [("zeropp", True, "auto"), ("zero3", False, 1)])
def test_string_alias_parses(alias, quantized, hpz):
    cli = _parse("--trainer.strategy", alias)
    s = cli.trainer.strategy
    assert isinstance(s, ZeroPPStrategy)
    assert s.zeropp_config.hpz_partition_size == hpz
    assert s.zeropp_config.quantize_weights is quantized and s.zeropp_config.quantize_gradients is quantized


def test_bad_value_in_yaml_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_zeropp.ZeroPPStrategy\n    init_args:\n      weight_bits: 5\n"
    )
    with pytest.raises((SystemExit, ValueError)):
        _parse("--config", str(bad))
