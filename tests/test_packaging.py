"""The kernels install as ``lightning_zeropp.kernels``, never as ``triton_kernels``: that import name belongs to other
distributions (Triton's own kernel library, installed by inference engines, and a package of that name on PyPI), and
two distributions installing one import name shadow each other."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"  # a copy: setuptools leaves build/ and *.egg-info next to the sources it builds
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*cache")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        cwd=out,
    )
    (built,) = out.glob("lightning_zeropp-*.whl")
    return built


def test_the_wheel_holds_the_kernels_under_our_package_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"lightning_zeropp"}, top_level
    for module in ("__init__", "reference", "layout", "_tiles", "_launch", "aot", "triton_ops"):
        assert f"lightning_zeropp/kernels/{module}.py" in names, module
    for package in ("compat", "testing"):
        assert f"lightning_zeropp/{package}/__init__.py" in names, package
    for module in ("distributed", "models", "workers"):  # test support for projects built on lightning-zeropp
        assert f"lightning_zeropp/testing/{module}.py" in names, module


@pytest.mark.slow  # a pip install of the wheel: about 12 s
def test_ours_imports_beside_a_package_named_triton_kernels(wheel, tmp_path):
    """The installed wheel and a stand-in ``triton_kernels`` on one path: each import gets its own package."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    other = site / "triton_kernels"
    other.mkdir()
    (other / "__init__.py").write_text("WHO = 'another distribution'\n")
    probe = textwrap.dedent(
        """
        import sys
        import torch
        import lightning_zeropp
        from lightning_zeropp import ZeroPPStrategy, kernels
        assert "triton_kernels" not in sys.modules, "lightning_zeropp imported the other triton_kernels"
        x = torch.randn(1000)
        y = kernels.dequantize(kernels.quantize(x, 8, 128), 1000, 8, 128, torch.float32)
        assert (y - x).abs().max() <= x.abs().max() / 127
        import triton_kernels
        assert triton_kernels.WHO == "another distribution"
        print(kernels.__file__)
        print(lightning_zeropp.__file__)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(site), "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    kernels_file, package_file = result.stdout.split()
    assert Path(kernels_file) == site / "lightning_zeropp" / "kernels" / "__init__.py"
    assert Path(package_file) == site / "lightning_zeropp" / "__init__.py"
