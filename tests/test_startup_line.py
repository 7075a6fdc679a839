"""The one line rank 0 logs when the strategy connects: what each collective runs in this job, and why a switch the
user left on does nothing here. It is read from the same switches the collectives use (``ZeroPPComms``)."""

from types import SimpleNamespace

import pytest

from lightning_zeropp.comm import ZeroPPComms
from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.ledger import CommLedger
from lightning_zeropp.topology import Topology


def _line(world: int, per_node: int, **kwargs) -> tuple[str, ZeroPPComms]:
    config = ZeroPPConfig(**kwargs)
    ranks_per_node, hpz = config.resolve(world, per_node)
    topology = Topology(world, ranks_per_node, 0, hpz)
    groups = SimpleNamespace(topology=topology, timeout=None)  # describing needs no collective
    comms = ZeroPPComms(config, groups, CommLedger(topology))
    return comms.describe(), comms


@pytest.mark.parametrize(
    ("world", "per_node", "kwargs", "says", "qwz", "qgz"),
    [
        (8, 8, {}, ["1 node x 8 ranks", "weights gathered exactly (qwZ off: one node", "qgZ off: one node"], 0, 0),
        (8, 2, {}, ["4 nodes x 2 ranks", "qwZ INT8 weights across 4 nodes", "hpZ backward gather inside 2 ranks",
                    "qgZ INT8 -> INT4 gradients (2 pieces, nearest rounding, Adam second-moment correction on"
                    " matrices)"], 1, 1),
        (4, 4, dict(quantize_weights=True), ["qwZ INT8 weights (quantize_weights=True on one node: lossy"], 1, 0),
        (8, 4, dict(quantize_weights=False), ["weights gathered exactly (quantize_weights=False)"], 0, 1),
        (8, 4, dict(gradient_error_feedback=True, quantize_gradients_steps=50, gradient_bits=8),
         ["qgZ INT8 -> INT8 gradients for the first 50 steps", "error feedback"], 1, 1),
        (8, 4, dict(second_moment_correction=False), ["(2 pieces, nearest rounding)."], 1, 1),
        (8, 4, dict(weight_deltas=True), ["weight deltas INT4", "hpZ backward gather inside 4 ranks"], 0, 1),
        (4, 4, dict(weight_deltas=True), ["weight_deltas off (one hpZ group of 4 ranks"], 0, 0),
        (8, 4, dict(sharding_strategy="HYBRID_SHARD", quantize_gradients=False),
         ["2 nodes x 4 ranks", "HSDP", "all-reduced exactly across nodes"], 0, 0),
    ],
    ids=["one-node", "four-nodes", "forced-qwz", "exact-weights", "feedback", "no-correction", "deltas",
         "deltas-one-group", "hsdp"],
)  # fmt: skip
def test_startup_line_names_what_runs_and_why(world, per_node, kwargs, says, qwz, qgz):
    line, comms = _line(world, per_node, **kwargs)
    assert line.startswith("ZeroPPStrategy: ") and "\n" not in line
    for part in says:
        assert part in line, f"{part!r} not in {line!r}"
    # the line and what the collectives run agree (weight deltas build the forward gather instead of qwZ)
    assert (comms.use_qwz, comms.use_qgz) == (bool(qwz), bool(qgz))
    assert ("qwZ INT" in line) == comms.use_qwz and ("qgZ INT" in line) == comms.use_qgz


@pytest.mark.parametrize(
    ("quantize_weights", "nodes", "quantized"),
    [("auto", 2, True), ("auto", 1, False), (True, 1, True), (False, 4, False)],
)
def test_quantize_weights_resolves_by_node_count(quantize_weights, nodes, quantized):
    from lightning_zeropp.commplan import resolve

    config = ZeroPPConfig(quantize_weights=quantize_weights)
    kind = resolve(config, Topology(2 * nodes, 2, 0, 2)).forward.kind
    assert kind == ("quantized" if quantized else "exact")


def test_quantize_weights_accepts_auto_and_bools_only():
    assert ZeroPPConfig().quantize_weights == "auto"
    with pytest.raises(TypeError, match="`quantize_weights` must be True or False"):
        ZeroPPConfig(quantize_weights="on")
