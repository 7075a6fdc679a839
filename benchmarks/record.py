"""What a benchmark run leaves beside its data: a manifest saying where the figures came from.

Every script writes its JSON through :func:`write`, which also appends one entry to the file's manifest
(``NAME.manifest.json`` beside ``NAME.json``): the commit (and whether the tree had uncommitted changes), the
torch / Lightning / Triton versions, the machine, the command and the date. A file that several invocations fill
(the accuracy study adds runs to one file) gets one entry per invocation that wrote it. ``benchmarks/report.py``
reads the manifests into each page's "Runs" table.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_WRITTEN: dict[Path, int] = {}
"""The manifest entry each data file written by this process has (an invocation that rewrites its file as it goes,
one write per finished run, keeps one entry with its first and last dates)."""


def manifest_path(path: Path | str) -> Path:
    """The manifest beside a data file: ``x.json`` -> ``x.manifest.json``."""
    path = Path(path)
    return path.with_name(path.stem + ".manifest.json")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _machine() -> dict[str, Any]:
    machine: dict[str, Any] = {"system": platform.system(), "cpu": platform.machine(), "cpus": os.cpu_count()}
    try:
        import torch

        if torch.cuda.is_available():
            machine["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return machine


def changed(status: str, own: tuple[str, ...] = ()) -> bool:
    """Whether ``git status --porcelain`` output ``status`` shows a change other than to the paths ``own`` (what the
    recording itself writes: a file run again shows its own earlier write as a change)."""
    return any(line[3:] not in own for line in status.splitlines() if line.strip())


def manifest(argv: list[str] | None = None, own: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The manifest entry of the running command (``argv`` defaults to ``sys.argv``); ``own``: the files the
    recording writes, which do not count as uncommitted changes."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_relative_to(ROOT):
        argv = [str(script.relative_to(ROOT)), *argv[1:]]
    status = _git("status", "--porcelain", "--untracked-files=no")
    mine = tuple(str(p.resolve().relative_to(ROOT)) for p in own if p.resolve().is_relative_to(ROOT))
    return {
        # paths inside the repository as the repository sees them, so a command reads the same on every checkout
        "command": "python " + shlex.join(argv).replace(str(ROOT) + "/", ""),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": changed(status, mine) if status is not None else None,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "lightning": _version("lightning"),
            "triton": _version("triton"),
        },
        "machine": _machine(),
    }


def read_manifest(path: Path | str) -> list[dict[str, Any]]:
    """The manifest entries of a data file, oldest first ([] when it has none)."""
    mpath = manifest_path(path)
    return json.loads(mpath.read_text())["runs"] if mpath.is_file() else []


def write(path: Path | str, data: Any, argv: list[str] | None = None, *, indent: int = 2) -> None:
    """Write ``data`` as JSON to ``path`` (atomically) and append this command's entry to its manifest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    tmp.replace(path)
    entries = read_manifest(path)
    entry = manifest(argv, own=(path, manifest_path(path)))
    key = path.resolve()
    if key in _WRITTEN and _WRITTEN[key] < len(entries):  # this invocation wrote the file before: one entry
        before = entries[_WRITTEN[key]]
        entries[_WRITTEN[key]] = {**entry, "first_date": before.get("first_date", before["date"])}
    else:
        _WRITTEN[key] = len(entries)
        entries.append(entry)
    manifest_path(path).write_text(json.dumps({"runs": entries}, indent=2) + "\n")
