"""Scripts of the repository in tests: loaded as a module (the example's ``train.py``, a benchmark), or run as a
program (the Fabric examples)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load_script(path: Path, name: str) -> ModuleType:
    """``path`` executed as the module ``name``. Scripts find their neighbouring files by putting their own folder on
    the import path, as when they run; the import path is put back as it was afterwards."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered as an import is: a dataclass in the script looks its module up
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def run_fabric_example(script: Path, folder: Path, *args: str) -> dict[str, Any]:
    """Runs a Fabric example (``examples/fabric/train.py`` or one built on its loop) with ``args`` in ``folder``
    (logs under ``folder/logs``); returns the JSON summary it writes, or fails with the end of its stderr."""
    summary = folder / "summary.json"
    cmd = [sys.executable, str(script), *args, "--log-dir", str(folder / "logs"), "--summary", str(summary)]
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(summary.read_text())
