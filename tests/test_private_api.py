"""Private symbols of other projects (torch, Lightning, Triton, the standard library) appear only in
``lightning_zeropp/compat/``, so an upgrade that moves one breaks one file, with a clear error, and nothing else.

What counts as private, outside the compat folder, in every Python file of the repository:

- importing a module whose dotted path has a component starting with ``_`` (``torch.distributed._composable``), or a
  name starting with ``_`` from another project's module (``from lightning.fabric.utilities.load import _X``);
- reading an attribute ``obj._name`` (one leading underscore, not a dunder) that our own code does not define:
  our own ``def``/``class`` names, module globals and the attributes our code assigns (``self._x = ...``);
- a class of ours assigning or defining a ``_name`` that its base class from another project already has
  (overriding a private hook, or writing the base's private state).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from pathlib import Path

import pytest

pytestmark = pytest.mark.version_sensitive

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "lightning_zeropp" / "compat"
OWN_PACKAGES = ("lightning_zeropp",)
# documented public API despite the underscore (namedtuple methods, os._exit)
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_exit"}


def _python_files() -> list[Path]:
    skip = {".git", "build", "dist", ".ruff_cache", ".pytest_cache"}
    return sorted(
        p
        for p in ROOT.rglob("*.py")
        if not skip & set(p.relative_to(ROOT).parts)
        and not any(part.endswith(".egg-info") for part in p.parts)
        and not _in_environment(p.relative_to(ROOT))
    )


def _in_environment(relative: Path) -> bool:
    """A virtual environment inside the clone (``python -m venv .venv`` there): other projects' files, not ours."""
    return any(
        (ROOT.joinpath(*relative.parts[: i + 1]) / "pyvenv.cfg").exists() for i in range(len(relative.parts) - 1)
    )


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_module(module: str | None, level: int) -> bool:
    return level > 0 or module is None or module == "__future__" or module.split(".")[0] in OWN_PACKAGES


def _defined_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name our code defines: functions, classes, globals, assigned attributes, our own module files."""
    names = {p.stem for p in trees}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _violations(path: Path, tree: ast.Module, ours: set[str]) -> list[str]:
    found = []
    where = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _own_module(alias.name, 0) and any(map(_is_private, alias.name.split("."))):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not _own_module(node.module, node.level):
            if any(map(_is_private, node.module.split("."))):
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            found += [
                f"{where}:{node.lineno}: from {node.module} import {a.name}" for a in node.names if _is_private(a.name)
            ]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if _is_private(node.attr) and node.attr not in ours and node.attr not in PUBLIC_UNDERSCORE:
                found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


@functools.cache
def _parse_all() -> dict[Path, ast.Module]:
    """Every Python file of the repository, parsed once per session (the trees are only read)."""
    return {p: ast.parse(p.read_text(), filename=str(p)) for p in _python_files()}


@functools.cache
def _ours() -> frozenset[str]:
    return frozenset(_defined_names(_parse_all()))


def test_no_private_symbol_outside_compat():
    trees = _parse_all()
    ours = _defined_names({p: t for p, t in trees.items() if COMPAT not in p.parents}) - _external_privates(trees)
    found = [v for p, t in trees.items() if COMPAT not in p.parents for v in _violations(p, t, ours)]
    assert not found, "private symbols outside lightning_zeropp/compat/:\n" + "\n".join(found)


def _external_privates(trees: dict[Path, ast.Module]) -> set[str]:
    """Private names our code assigns on objects of other projects: they are not ours even though we assign them."""
    names = set()
    for cls in _our_classes():
        for base in _external_bases(cls):
            names |= {n for n in _base_attributes(base) if _is_private(n)}
    return names


def _our_classes() -> list[type]:
    classes = []
    package = ROOT / "lightning_zeropp"
    for path in sorted(package.rglob("*.py")):
        if COMPAT in path.parents or path.name == "__main__.py":
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(name)
        classes += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    kernels = ROOT / "triton_kernels"
    for path in sorted(kernels.glob("*.py")):
        if path.stem in ("aot", "triton_ops") or path.stem.endswith("_kernel") or path.stem == "_tiles":
            continue  # these import triton
        module = importlib.import_module(
            "lightning_zeropp.kernels" + ("" if path.stem == "__init__" else f".{path.stem}")
        )
        classes += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    return classes


def _external_bases(cls: type) -> list[type]:
    return [b for b in cls.__mro__[1:] if b is not object and b.__module__.split(".")[0] not in OWN_PACKAGES]


def _base_attributes(base: type) -> set[str]:
    """The base's class attributes and, for Lightning's classes (strategies, callbacks: built without arguments),
    the attributes an instance sets in ``__init__``."""
    names = set(dir(base))
    if base.__module__.split(".")[0] == "lightning":
        try:
            names |= set(vars(base()))
        except TypeError:  # needs arguments
            pass
    return names


def test_our_classes_leave_their_external_bases_private_state_alone():
    trees = _parse_all()
    found = []
    for cls in _our_classes():
        bases = _external_bases(cls)
        if not bases:
            continue
        source = inspect.getsource(cls)
        own = set()
        for node in ast.walk(ast.parse(inspect.cleandoc("\n" + source) if source[:1].isspace() else source)):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
                own.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
                own.add(node.name)
        for base in bases:
            clash = own & _base_attributes(base)
            found += [f"{cls.__module__}.{cls.__qualname__}: {n} (private in {base.__qualname__})" for n in clash]
    assert trees and not found, "\n".join(found)


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("from torch.distributed._composable import checkpoint", "from torch.distributed._composable import"),
        ("import torch.distributed.fsdp._fully_shard._fsdp_api", "import torch.distributed.fsdp._fully_shard"),
        ("from lightning.fabric.utilities.load import _METADATA_FILENAME", "import _METADATA_FILENAME"),
        ("import torch\ntorch._C._current_graph_task_id()", "._current_graph_task_id"),
        ("def f(m):\n    return m._forward_pre_hooks", "._forward_pre_hooks"),
    ],
)
def test_the_check_sees_each_kind_of_private_use(snippet, expected):
    """The checker itself: each kind of private use in a file outside compat is reported."""
    ours = _ours()
    found = _violations(ROOT / "probe.py", ast.parse(snippet), ours)
    assert any(expected in v for v in found), found


def test_our_own_private_names_are_not_reported():
    snippet = "from . import _tiles\nclass A:\n    def __init__(self):\n        self._x = 1\n    def f(self):\n"
    snippet += "        return self._x + _tiles._helper()\ndef _helper():\n    pass\n"
    tree = ast.parse(snippet)
    assert _violations(ROOT / "probe.py", tree, _defined_names({ROOT / "probe.py": tree})) == []
