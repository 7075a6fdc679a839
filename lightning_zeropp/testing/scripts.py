"""Loading a script of the repository (the example's ``train.py``, a benchmark) as a module in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """``path`` executed as the module ``name``. Scripts find their neighbouring files by putting their own folder on
    the import path, as when they run; the import path is put back as it was afterwards."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
