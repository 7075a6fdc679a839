"""``lightning_zeropp.plan``, the planner's old name: importing it or running ``python -m lightning_zeropp.plan`` warns
(a FutureWarning naming ``lightning_zeropp.planner``) and forwards to the planner, so that users' scripts keep
working."""

import importlib
import runpy
import sys

import pytest

from lightning_zeropp import planner, prediction, recommendation


def test_importing_the_old_name_warns_and_forwards_to_the_planner(monkeypatch):
    monkeypatch.delitem(sys.modules, "lightning_zeropp.plan", raising=False)
    with pytest.warns(FutureWarning, match=r"python -m lightning_zeropp\.planner"):
        old = importlib.import_module("lightning_zeropp.plan")
    assert old.plan is planner.predict  # the function's old name
    assert (old.CONFIGS, old.Cluster, old.main, old.verdict) == (planner.CONFIGS, planner.Cluster, planner.main,
                                                                 recommendation.verdict)  # fmt: skip
    # the names of the modules the planner was split into, as the old module had them
    assert (old.collective_seconds, old.LONG_RUN) == (prediction.collective_seconds, recommendation.LONG_RUN)
    with pytest.raises(AttributeError, match="no_such_name"):
        old.no_such_name  # noqa: B018


def test_running_the_old_command_warns_and_prints_what_the_planner_prints(monkeypatch, capsys):
    argv = ["--nodes", "2", "--gpus-per-node", "2"]
    planner.main(argv)
    expected = capsys.readouterr().out
    monkeypatch.delitem(sys.modules, "lightning_zeropp.plan", raising=False)
    monkeypatch.setattr(sys, "argv", ["python -m lightning_zeropp.plan", *argv])
    with pytest.warns(FutureWarning, match=r"python -m lightning_zeropp\.planner"):
        runpy.run_module("lightning_zeropp.plan", run_name="__main__", alter_sys=True)
    assert capsys.readouterr().out == expected
    assert "verdict:" in expected
