"""The package's layers: calls and imports go down, never up.

From the front doors (the Trainer's and Fabric's strategies) down to the kernels, every module has a layer, and a
module calls or imports only modules of lower layers (the modules of compat/ and of the kernels are one layer each; an
import in any form counts, wherever it stands; the known exceptions are listed with their reason): the core shards a
model in one pass, handing it down to sharding, the collectives' hooks and materialization, and nothing below calls
back up into the core or a strategy.
"""

from __future__ import annotations

import ast
import functools
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
    "plan": 9,  # the planner's old name: a shim that warns and forwards to it
    "planner": 8,  # the CLI: the model from the arguments, the table, the header, the JSON
    "recommendation": 7,  # the planner's verdict; it prints the strategy's code (imports strategy)
    "prediction": 6,  # the planner's model: memory, bytes and step time per configuration
    "argument_table": 8,
    "fabric": 6,
    "strategy": 6,
    "consolidate": 6,
    "core": 5,
    "costs": 5,
    "sharding": 4,
    "optimizers": 4,
    "fsdp_hooks": 4,
    "materialize": 4,
    "checkpoint": 4,
    "preemption": 4,
    "comm": 3,
    "checkpoint_files": 3,
    "deltas": 2,
    "tensor_parallel_comms": 2,  # counts the model's tensor-parallel collectives into the ledger
    "feedback": 2,
    "moments": 2,
    "qgz": 2,
    "vectors": 1,  # norm gains and biases carried exactly in qgZ's and the rail's all-to-alls
    "rail": 2,
    "qwz": 2,
    "hpz": 2,
    "blocks": 1,
    "step_owner": 1,
    "commplan": 1,
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


KERNELS = PACKAGE.parent / "triton_kernels"  # installed as lightning_zeropp.kernels
ABOVE_ALL = 10  # lightning_zeropp.testing: test support, which no module of the package may import

# Imports that break the layering and are known, each with its reason: (importing module, imported module). The test
# fails if one of them is gone (take it out of here) and for any other upward import.
KNOWN_UPWARD = {
    ("lightning_zeropp.kernels.aot", "lightning_zeropp.compat.triton"): (
        "the ahead-of-time compile gate is a tool, not a kernel: it needs Triton's private launch internals, which live"
        " in compat/ with every version-dependent symbol; the kernels' layer should hold kernels alone (aot.py belongs"
        " above compat)"
    ),
}


@functools.cache
def _sources() -> dict[str, Path]:
    """Every module of the package's source (test helpers aside) by its installed dotted name."""
    found = {}
    for root, name in ((PACKAGE, "lightning_zeropp"), (KERNELS, "lightning_zeropp.kernels")):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[0] == "testing" or "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def _installed(module: str) -> str:
    """``triton_kernels.x`` (the folder's own name) -> ``lightning_zeropp.kernels.x``."""
    if module == "triton_kernels" or module.startswith("triton_kernels."):
        return "lightning_zeropp.kernels" + module[len("triton_kernels") :]
    return module


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or a package of the package's source, or of its test helpers."""
    return name in _sources() or name == "lightning_zeropp.testing" or name.startswith("lightning_zeropp.testing.")


def _imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """The dotted names of the package's modules that ``source`` (the text of ``module``) imports, in every form:
    ``import a.b``, ``import a.b as c``, ``from a.b import c`` (``a.b.c`` where that is a module, else ``a.b``),
    relative ``from . import x`` and ``from ..y import z``, at the top, inside functions or under ``TYPE_CHECKING``,
    and ``importlib.import_module``/``__import__`` of a literal name."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(_installed(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 >= len(base_parts):
                    raise AssertionError(f"{module}: `from {'.' * node.level}` goes above the package")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = _installed(node.module or "")
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if _is_module(child) else base)
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(_installed(node.args[0].value))
    return {name for name in found if _layer(name) is not None or name.startswith("lightning_zeropp.testing")}


def _imports(module: str) -> set[str]:
    path = _sources()[module]
    return _imports_of(path.read_text(), module, path.name == "__init__.py")


def _layer(module: str) -> str | None:
    """The layer of a module of the package's source: ``_layer_of``, with the package's own ``__init__``."""
    return "__init__" if module == "lightning_zeropp" else _layer_of(module)


def _rank(module: str) -> int:
    if module == "lightning_zeropp.testing" or module.startswith("lightning_zeropp.testing."):
        return ABOVE_ALL
    return LAYERS[_layer(module)]


def _upward(module: str, dep: str) -> bool:
    """Whether importing ``dep`` from ``module`` breaks the layering: only a strictly lower layer may be imported,
    except between the modules of one subpackage (compat, kernels), which are one layer together."""
    if _layer(module) == _layer(dep) in ("compat", "kernels"):
        return False
    return _rank(dep) >= _rank(module)


def test_every_module_has_a_layer_and_imports_only_lower_ones():
    modules = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
    }
    assert sorted(modules - set(LAYERS) - {"testing"}) == [], "give each new module a layer in LAYERS"
    edges = {(name, dep) for name in _sources() for dep in _imports(name) if _upward(name, dep)}
    upward = sorted(
        f"{name} (layer {_rank(name)}) imports {dep} (layer {_rank(dep)})" for name, dep in edges - set(KNOWN_UPWARD)
    )
    assert upward == []
    gone = sorted(set(KNOWN_UPWARD) - edges)
    assert gone == [], f"no longer imported upward: take these out of KNOWN_UPWARD: {gone}"


@pytest.mark.parametrize(
    "statement, module, expected, up",
    [
        ("import lightning_zeropp.strategy", "lightning_zeropp.ledger", "lightning_zeropp.strategy", True),
        ("import lightning_zeropp.strategy as s", "lightning_zeropp.ledger", "lightning_zeropp.strategy", True),
        ("import lightning_zeropp", "lightning_zeropp.ledger", "lightning_zeropp", True),
        ("from lightning_zeropp import core", "lightning_zeropp.ledger", "lightning_zeropp.core", True),
        ("from lightning_zeropp import ZeroPPStrategy", "lightning_zeropp.ledger", "lightning_zeropp", True),
        ("from lightning_zeropp.core import Core", "lightning_zeropp.ledger", "lightning_zeropp.core", True),
        ("from . import core", "lightning_zeropp.ledger", "lightning_zeropp.core", True),
        ("from .core import Core", "lightning_zeropp.ledger", "lightning_zeropp.core", True),
        ("from . import ledger", "lightning_zeropp.core", "lightning_zeropp.ledger", False),
        ("from .. import core", "lightning_zeropp.compat.torch", "lightning_zeropp.core", True),
        ("from ..planner import main", "lightning_zeropp.compat.torch", "lightning_zeropp.planner", True),
        ("from .versions import require", "lightning_zeropp.compat.torch", "lightning_zeropp.compat.versions", False),
        (
            "from lightning_zeropp.compat import triton",
            "lightning_zeropp.kernels.aot",
            "lightning_zeropp.compat.triton",
            True,
        ),
        ("from .layout import Blocks", "lightning_zeropp.kernels.aot", "lightning_zeropp.kernels.layout", False),
        ("import triton_kernels.layout", "lightning_zeropp.ledger", "lightning_zeropp.kernels.layout", False),
        (
            "from lightning_zeropp.testing import models",
            "lightning_zeropp.core",
            "lightning_zeropp.testing.models",
            True,
        ),
        (
            "def f():\n    from .strategy import ZeroPPStrategy",
            "lightning_zeropp.ledger",
            "lightning_zeropp.strategy",
            True,
        ),
        ("if TYPE_CHECKING:\n    from .fabric import X", "lightning_zeropp.ledger", "lightning_zeropp.fabric", True),
        ("importlib.import_module('lightning_zeropp.core')", "lightning_zeropp.ledger", "lightning_zeropp.core", True),
    ],
)
def test_every_form_of_import_is_seen_and_judged(statement, module, expected, up):
    assert _imports_of(statement, module) == {expected}
    assert _upward(module, expected) == up


def test_imports_inside_a_layer_and_down_pass():
    assert _imports_of("import torch\nfrom torch import nn\nimport lightning.pytorch", "lightning_zeropp.core") == set()
    assert not _upward("lightning_zeropp.core", "lightning_zeropp.sharding")
    assert not _upward("lightning_zeropp.kernels.aot", "lightning_zeropp.kernels.layout")
    assert not _upward("lightning_zeropp", "lightning_zeropp.strategy")
    assert not _upward("lightning_zeropp.compat", "lightning_zeropp.compat.versions")
    assert not _upward("lightning_zeropp.kernels", "lightning_zeropp.kernels.layout")
    assert _upward("lightning_zeropp.qgz", "lightning_zeropp.hpz"), "equal layers must not import each other"


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
