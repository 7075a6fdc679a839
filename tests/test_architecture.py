"""The package's layers: calls and imports go down, never up.

From the front doors (the Trainer's and Fabric's strategies) down to the kernels, every module has a layer, and a
module calls or imports only modules of lower layers: the core shards a model in one pass, handing it down to
sharding, the collectives' hooks and materialization, and nothing below calls back up into the core or a strategy.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import lightning_zeropp
from lightning_zeropp.testing.distributed import lightning_trainer, spawn

PACKAGE = Path(lightning_zeropp.__file__).parent
# higher calls lower; equal layers do not call each other
LAYERS = {
    "__init__": 9,
    "callback": 8,
    "plan": 7,
    "argument_table": 8,
    "fabric": 6,
    "strategy": 6,
    "consolidate": 6,
    "core": 5,
    "costs": 5,
    "sharding": 4,
    "fsdp_hooks": 4,
    "materialize": 4,
    "checkpoint": 4,
    "preemption": 4,
    "comm": 3,
    "checkpoint_files": 3,
    "deltas": 2,
    "feedback": 2,
    "qgz": 2,
    "qwz": 2,
    "hpz": 2,
    "blocks": 1,
    "collectives": 1,
    "ledger": 1,
    "spawn": 1,
    "arguments": 1,
    "topology": 0,
    "config": 0,
    "compat": -1,
    "kernels": -2,
}


def _layer_of(module_name: str) -> str | None:
    """``lightning_zeropp.core`` -> ``core``; the kernels install as ``lightning_zeropp.kernels``; None outside the
    package (and for its test helpers)."""
    parts = module_name.split(".")
    if parts[0] == "triton_kernels":
        return "kernels"
    if parts[0] != "lightning_zeropp" or len(parts) < 2 or parts[1] == "testing":
        return None
    return parts[1]


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports (at the top or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightning_zeropp.")
        ):
            found.add(node.module.split(".")[1])
    return found - {"testing"}


def test_every_module_has_a_layer_and_imports_only_lower_ones():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert sorted(modules - set(LAYERS)) == [], "give each new module a layer in LAYERS"
    upward = [
        f"{name} (layer {LAYERS[name]}) imports {dep} (layer {LAYERS[dep]})"
        for name in sorted(modules)
        for dep in sorted(_imports(PACKAGE / f"{name}.py"))
        if LAYERS[dep] >= LAYERS[name]
    ]
    assert upward == []


class _CallEdges:
    """Records, while active, each call from one package module into another: ``(caller, callee)`` layers."""

    def __init__(self) -> None:
        self.edges: list[tuple[str, str, str]] = []
        self.entered = False

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        if not self.entered:  # the traced call itself
            self.entered = True
            return
        callee = _layer_of(frame.f_globals.get("__name__", ""))
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and _layer_of(caller_frame.f_globals.get("__name__", "")) is None:
            caller_frame = caller_frame.f_back
        if caller_frame is None:
            return
        caller = _layer_of(caller_frame.f_globals["__name__"])
        if caller != callee:
            self.edges.append((caller, callee, frame.f_code.co_qualname))


def _trace_shard_model(rank: int, world: int) -> list[tuple[str, str, str]]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy
    from lightning_zeropp.testing.models import TinyLM, make_batches

    edges = _CallEdges()
    original = ZeroPPStrategy.shard_model

    def traced(self, model):
        sys.setprofile(edges)
        try:
            return original(self, model)
        finally:
            sys.setprofile(None)

    ZeroPPStrategy.shard_model = traced
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(*make_batches(4)), batch_size=2)
    strategy = ZeroPPStrategy(ranks_per_node=1, gradient_error_feedback=True)
    lightning_trainer(world, strategy, max_steps=1).fit(TinyLM(), data)
    return edges.edges


@pytest.mark.multiprocess
def test_sharding_a_model_calls_only_down_the_layers():
    """``shard_model`` at 2 nodes x 1 (qwZ, qgZ with error feedback): the strategy calls the core, which hands the
    model to sharding, the collectives' hooks and materialization, and no call goes back up a layer."""
    edges = spawn(_trace_shard_model, 2)[0]
    up = sorted({f"{a} -> {b} ({fn})" for a, b, fn in edges if LAYERS[b] >= LAYERS[a]})
    assert up == []
    from_core = {b for a, b, _ in edges if a == "core"}
    assert {"sharding", "fsdp_hooks", "materialize"} <= from_core, sorted(from_core)
    assert {a for a, b, _ in edges if b == "core"} == {"strategy"}
