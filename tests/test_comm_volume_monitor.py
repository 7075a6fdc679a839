"""CommVolumeMonitor logs this rank's bytes per step to the loggers, and keeps them off the progress bar unless asked
(the metric names are long: the bar wrapped over four lines)."""

from types import SimpleNamespace

import pytest

from lightning_zeropp import CommVolumeMonitor


class _Ledger:
    def start_step(self):
        pass

    def step_metrics(self, unit, per_kind, restart):
        metrics = {f"comm/inter_node_{unit}": 1.5, f"comm/intra_node_{unit}": 3.0}
        if per_kind:
            metrics[f"comm/weight_all_gather/inter_node_{unit}"] = 1.0
        return metrics


class _Module:
    automatic_optimization = True

    def __init__(self):
        self.logged = []

    def log_dict(self, metrics, **kwargs):
        self.logged.append((dict(metrics), kwargs))


def _one_step(monitor: CommVolumeMonitor) -> list:
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(comm_ledger=_Ledger()))
    module = _Module()
    monitor.on_train_start(trainer, module)
    monitor.on_train_batch_start(trainer, module, None, 0)
    trainer.global_step = 1  # the optimizer stepped
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    return module.logged


def test_totals_logged_off_the_progress_bar_by_default():
    ((metrics, kwargs),) = _one_step(CommVolumeMonitor())
    assert metrics == {"comm/inter_node_MB": 1.5, "comm/intra_node_MB": 3.0}
    assert kwargs["prog_bar"] is False and kwargs["on_step"] is True


def test_progress_bar_when_asked_and_per_kind():
    logged = _one_step(CommVolumeMonitor(prog_bar=True, per_kind=True, unit="KB"))
    assert logged[0][1]["prog_bar"] is True and set(logged[0][0]) == {"comm/inter_node_KB", "comm/intra_node_KB"}
    assert logged[1][0] == {"comm/weight_all_gather/inter_node_KB": 1.0} and not logged[1][1].get("prog_bar")


@pytest.mark.parametrize(("kwargs", "match"), [(dict(prog_bar="yes"), "`prog_bar` must be True or False"),
                                               (dict(unit="MiB"), "`unit='MiB'` is not allowed")])  # fmt: skip
def test_bad_arguments(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        CommVolumeMonitor(**kwargs)
