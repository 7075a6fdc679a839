"""One plan of techniques: :func:`lightning_zeropp.commplan.resolve` decides what each collective runs, and the
runtime, the cost model and the startup line read that plan, never the switches.

- an AST walk of the package fails on a read of a technique switch outside ``config.py`` and ``commplan.py``;
- the plan's decisions, per topology (one node, several, HSDP, weight deltas with and without a second hpZ group);
- the runtime's collectives follow the plan that the cost model reads (the byte-for-byte agreement of the ledger and
  ``costs.py`` is ``tests/test_costs.py``'s)."""

import ast
from pathlib import Path

import pytest

from lightning_zeropp.commplan import resolve
from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "lightning_zeropp", ROOT / "triton_kernels"]
ALLOWED = {"lightning_zeropp/config.py", "lightning_zeropp/commplan.py"}
SWITCHES = {
    "quantize_weights", "quantize_gradients", "quantize_gradients_steps", "gradient_error_feedback", "weight_deltas",
    "sharding_strategy", "hybrid", "gradient_rotation", "hpz_partition_size", "quantizes_weights",
}  # fmt: skip
"""The arguments that choose a technique (which collective runs how), and the config's predicates on them. The
formats (bits, block sizes, rounding) are read where they are applied."""


def _is_topology(node: ast.AST) -> bool:
    """``topology.hpz_partition_size`` is the job's resolved R (a structural fact the topology owns), not the
    switch: its base names a topology."""
    text = ast.unparse(node)
    return text in ("topology", "topo", "t", "self") or text.endswith(("topology", "topo"))


def _is_plan(node: ast.AST) -> bool:
    """A read of the plan itself (``plan.hybrid``, ``self.plan.hpz_partition_size``): what the plan decided."""
    return ast.unparse(node).split(".")[-1] in ("plan", "_plan")


def switch_reads(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of every read of a technique switch in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SWITCHES and isinstance(node.ctx, ast.Load):
            if _is_plan(node.value) or (node.attr == "hpz_partition_size" and _is_topology(node.value)):
                continue
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            args = node.args
            if len(args) >= 2 and isinstance(args[1], ast.Constant) and args[1].value in SWITCHES:
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_technique_switch_is_read_outside_the_config_and_the_plan():
    offences = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in ALLOWED:
                continue
            offences += [f"{name}:{line}: {expr}" for line, expr in switch_reads(path.read_text())]
    assert not offences, "technique switches read outside config.py and commplan.py (read the plan):\n" + "\n".join(
        offences
    )


@pytest.mark.parametrize(
    "source",
    [
        "if config.quantize_gradients and K > 1: pass",
        "deltas = self.config.weight_deltas and 1 < R < W",
        "x = c.hybrid",
        "R = config.hpz_partition_size",
        "v = getattr(config, 'gradient_rotation')",
    ],
)
def test_the_walk_finds_the_reads_it_forbids(source):
    """The check cannot pass by not looking: each form of a switch read is found."""
    assert switch_reads(source), source


def test_the_walk_leaves_the_topology_and_the_formats_alone():
    reads = "R = topology.hpz_partition_size\nb = config.gradient_bits\ns = self.hpz_partition_size\nh = plan.hybrid"
    assert not switch_reads(reads)


def _plan(world: int, per_node: int, **kwargs):
    config = ZeroPPConfig(**kwargs)
    ranks_per_node, hpz = config.resolve(world, per_node)
    return resolve(config, Topology(world, ranks_per_node, 0, hpz))


def test_one_node_runs_exact_collectives():
    plan = _plan(8, 8)
    assert (plan.forward.kind, plan.gradients.kind, plan.backward.kind) == ("exact", "exact", "same")
    assert plan.note("forward").startswith("qwZ off: one node") and plan.note("gradients").startswith("qgZ off")
    assert plan.reshard_after_forward is True and plan.mesh_shape == (8,)


def test_zeropp_across_nodes():
    plan = _plan(8, 2, gradient_error_feedback=True, quantize_gradients_steps=40, gradient_rotation="hadamard")
    f, b, g = plan.forward, plan.backward, plan.gradients
    assert (f.kind, f.bits, f.block_size) == ("quantized", 8, 256)
    assert (b.kind, b.group_size) == ("secondary", 2) and plan.reshard_after_forward == 2
    assert (g.kind, g.intra_bits, g.inter_bits, g.pieces, g.rounding, g.rotation) == ("two_hop", 8, 4, 2, "nearest",
                                                                                       "hadamard")  # fmt: skip
    assert g.feedback is not None and g.feedback.decay == 1.0 and g.until_step == 40
    assert plan.quantizes_gradients_at(39) and not plan.quantizes_gradients_at(40)


def test_weight_deltas_need_a_second_hpz_group():
    assert _plan(8, 4, weight_deltas=True).forward.kind == "node_copy"
    one_group = _plan(4, 4, weight_deltas=True)
    assert one_group.forward.kind == "exact" and "one hpZ group" in one_group.note("deltas")


@pytest.mark.parametrize(("world", "per_node", "gradients", "group"), [(8, 4, "hsdp_rail", "node"),
                                                                         (4, 4, "exact", "world")])  # fmt: skip
def test_hsdp(world, per_node, gradients, group):
    plan = _plan(world, per_node, sharding_strategy="HYBRID_SHARD", quantize_gradients=False)
    assert plan.hybrid and plan.gradients.kind == gradients and plan.shard_group == group
    assert plan.mesh_shape == (world // per_node, per_node) and plan.forward.kind == "exact"
    assert plan.describe().startswith(f"ZeroPPStrategy: {world // per_node} node")


def test_the_plan_is_frozen():
    plan = _plan(8, 2)
    with pytest.raises(AttributeError):
        plan.forward = None  # type: ignore[misc]


def test_the_startup_line_on_one_node_says_it_is_zero3s_traffic_and_how_to_emulate_nodes():
    """One node with the defaults (what ``strategy="zeropp"`` gives on one machine): nothing is quantized, and the
    line says so and how to try ZeRO++ there; with emulated nodes, or with ZeRO-3 asked for, it says nothing of it."""
    hint = "to try ZeRO++ on one machine, emulate nodes with ranks_per_node"
    assert hint in _plan(4, 4).describe()
    assert hint not in _plan(4, 2).describe()
    assert hint not in _plan(4, 4, quantize_weights=False, quantize_gradients=False).describe()
