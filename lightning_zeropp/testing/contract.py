"""Support for the contract tests with Lightning (``tests/test_lightning_contract.py`` and
``tests/test_fabric_contract.py``): the small model of Lightning's own ModelParallelStrategy tests, and many
scenarios run one after another in one set of spawned ranks (each spawn costs seconds of imports; each scenario builds
its own Trainer or Fabric).

    results = spawn(worker, 2, str(tmp))        # worker(rank, world, tmp) returns run_scenarios(SCENARIOS, ...)
    per_rank = scenario_outcome(results, "1.5")  # each rank's return value, or the traceback of a rank that raised
"""

from __future__ import annotations

import os
import time
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FeedForward",
    "NonTensorMeta",
    "assert_path_exists_contract",
    "run_scenarios",
    "save_onto_existing",
    "scenario_outcome",
]


class FeedForward(nn.Module):
    """A SwiGLU-style feed-forward block, ``(B, 32) -> (B, 32)``: three biased Linears and no ``nn.ModuleList`` (so
    under the default policy the root is the only unit; ``auto_wrap_policy={nn.Linear}`` makes one unit per layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class NonTensorMeta:
    """A picklable object that is not a tensor (``torch.load(weights_only=True)`` refuses it), as user metadata in a
    checkpoint."""

    def __init__(self, value: int) -> None:
        self.value = value


def run_scenarios(
    scenarios: dict[str, Callable[[int, int, Path], Any]], rank: int, world: int, tmp: str
) -> dict[str, tuple[str, Any]]:
    """Runs ``scenario(rank, world, folder)`` for each named scenario, in order, each in a folder of its own under
    ``tmp``; returns ``{name: ("ok", value)}`` or ``{name: ("error", traceback)}``. A scenario that raises does not
    stop the others; the ranks meet at a barrier after each one (when a process group exists)."""
    results: dict[str, tuple[str, Any]] = {}
    for name, scenario in scenarios.items():
        folder = Path(tmp) / name.replace(".", "_").replace(" ", "_")
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            results[name] = ("ok", scenario(rank, world, folder))
        except Exception:
            results[name] = ("error", traceback.format_exc())
        results[name] = (*results[name], time.perf_counter() - start)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    return results


def scenario_outcome(results: list[dict[str, tuple[str, Any]]], name: str) -> list[Any]:
    """Each rank's return value of scenario ``name``; raises ``AssertionError`` with the traceback of every rank on
    which it raised."""
    errors = [f"rank {rank}:\n{outcome[name][1]}" for rank, outcome in enumerate(results) if outcome[name][0] != "ok"]
    if errors:
        raise AssertionError(f"scenario {name} raised:\n" + "\n".join(errors))
    return [outcome[name][1] for outcome in results]


# ----------------------------------------------------------------------------------------------- saving onto a path
def _make_targets(parent: Path) -> dict[str, Path]:
    """One target per case, each in a folder of its own (so a temporary left next to it would show)."""
    targets = {}
    for case in ("not_empty", "empty_folder", "checkpoint_folder", "empty_file", "other_file"):
        (parent / case).mkdir(parents=True, exist_ok=True)
        targets[case] = parent / case / "target"
    targets["not_empty"].mkdir()
    (targets["not_empty"] / "file").write_text("notes")
    targets["empty_folder"].mkdir()
    targets["checkpoint_folder"].mkdir()
    (targets["checkpoint_folder"] / "meta.pt").touch()  # upstream's sharded checkpoint: a folder with meta.pt
    targets["empty_file"].touch()
    targets["other_file"].write_text("not a checkpoint")
    return targets


def save_onto_existing(
    save: Callable[[Path], None], parent: Path, rank: int, barrier: Callable[[], None]
) -> dict[str, dict[str, Any]]:
    """Scenarios 1.7 and 3.8 (upstream ``test_save_checkpoint_path_exists``): ``save(path)`` (a collective: every
    rank calls it) onto each kind of existing path (see :func:`_make_targets`). Returns, per case, the error raised or
    what the path holds afterwards, and every name in its folder (a temporary left beside it would be one more)."""
    if rank == 0:
        _make_targets(parent)
    barrier()
    targets = {case: parent / case / "target" for case in os.listdir(parent)}
    out = {}
    for case, target in sorted(targets.items()):
        try:
            save(target)
            result = {"error": None}
        except (OSError, ValueError) as err:
            result = {"error": type(err).__name__, "message": str(err)}
        if target.is_dir():
            result["holds"] = sorted(os.listdir(target))
            result["notes"] = (target / "file").read_text() if (target / "file").is_file() else None
        else:
            result["holds"] = "zip" if zipfile.is_zipfile(target) else f"{target.stat().st_size} bytes"
            result["text"] = target.read_bytes()[:16] if case == "other_file" else None
        result["siblings"] = sorted(os.listdir(target.parent))
        out[case] = result
        barrier()
    return out


def assert_path_exists_contract(full: dict, sharded: dict, rank: int) -> None:
    """What may be replaced, for :func:`save_onto_existing`'s results in each format: a checkpoint of either format,
    an empty file and (sharded) an empty folder; a folder of other files and a non-empty file that is not a checkpoint
    are refused in both formats and kept as they were (Lightning writes a sharded checkpoint into the folder of other
    files and overwrites any file). No temporary is left beside the path."""
    for kind, cases in (("full", full), ("sharded", sharded)):
        for case, result in cases.items():
            assert result["siblings"] == ["target"], (rank, kind, case, result["siblings"])
        refused = cases["not_empty"]
        assert refused["holds"] == ["file"] and refused["notes"] == "notes", (rank, kind, refused)
        other = cases["other_file"]
        assert other["error"] == "FileExistsError", (rank, kind, other)
        assert "exists and is a file that is not a Lightning checkpoint" in other["message"], other["message"]
        assert other["text"] == b"not a checkpoint", (rank, kind, other)
    # full: one file; a folder that is not a checkpoint is refused (upstream: IsADirectoryError as well)
    for case in ("not_empty", "empty_folder"):
        assert full[case]["error"] == "IsADirectoryError", (rank, case, full[case])
        assert "exists and is a directory" in full[case]["message"], full[case]["message"]
    assert full["empty_folder"]["holds"] == []
    for case in ("checkpoint_folder", "empty_file"):
        assert full[case]["error"] is None and full[case]["holds"] == "zip", (rank, case, full[case])
    # sharded: a folder; the folder of notes is refused (upstream: written into, 1.7d)
    assert sharded["not_empty"]["error"] == "FileExistsError", (rank, sharded["not_empty"])
    message = sharded["not_empty"]["message"]
    assert "exists and is a folder of other files, not a checkpoint" in message, message
    for case in ("empty_folder", "checkpoint_folder", "empty_file"):
        result = sharded[case]
        assert result["error"] is None, (rank, case, result)
        assert {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(result["holds"]), (rank, case, result)
