"""The compile gate's partial targets (``kernels.aot``): which launches ``--rotated-only`` keeps, and the refusals of
a partial target that is not compiled or is named twice (before anything compiles)."""

import re

import pytest

pytest.importorskip("triton")

from lightning_zeropp.kernels import aot


def _kernel(name):
    def kernel():
        pass

    kernel.__name__ = name
    return kernel


def test_rotated_launches_are_those_that_rotate_and_the_sign_table():
    def launch(name, **kwargs):
        return aot.Launch(_kernel(name), (), kwargs, (1,))

    assert aot.rotated(launch("_requantize_kernel", ROTATE=True))
    assert aot.rotated(launch("_rotation_table_kernel"))
    assert not aot.rotated(launch("_requantize_kernel", ROTATE=False))
    assert not aot.rotated(launch("_quantize_kernel"))


@pytest.mark.parametrize(
    ("subsets", "message"),
    [
        ({"pairs": (100,)}, "pairs=[100] (--pairs): only targets being compiled"),
        ({"rotated_only": (80,)}, "rotated_only=[80] (--rotated-only): only targets being compiled"),
        ({"pairs": (80,), "rotated_only": (80,)}, "pairs and rotated_only (--pairs, --rotated-only) both name [80]"),
    ],
)
def test_a_partial_target_must_be_compiled_and_named_once(subsets, message):
    archs = [90] if "rotated_only" in subsets and "pairs" not in subsets else [80, 90]
    with pytest.raises(ValueError, match=re.escape(message)):
        aot.report(archs, 1, **subsets)


def test_the_command_line_refuses_no_compiler(tmp_path, capsys):
    with pytest.raises(SystemExit):
        aot.main(["--workers", "0", "--json", str(tmp_path / "r.json")])
    assert "--workers 0: give at least 1 compiler process" in capsys.readouterr().err
