"""Checkpoints that survive interruptions and say what is wrong when they do not fit.

- Saving writes to a hidden temporary name next to the target and renames it into place only when every rank has
  finished, so a killed rank or a full disk leaves the previous checkpoint at that path untouched.
- Loading first compares the checkpoint's tensors (names and global shapes) with the model's and refuses a mismatch
  with the list of differences, instead of an opaque error from deep inside ``torch.distributed.checkpoint``.
- A sharded checkpoint (a folder written by every rank) loads on any world size: tensors are stored with their global
  shapes and re-sliced for the loading job's shards.
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME

MODEL_KEY = "state_dict"
RNG_KEY = "zeropp_rng_states"


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model, or cannot be read; the message lists what is wrong."""


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")


def replace_atomically(tmp: Path, path: Path) -> None:
    """Moves a completely written ``tmp`` (file or folder) onto ``path``, replacing what was there."""
    if path.is_dir() and not path.is_symlink():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)  # a folder cannot be replaced in one step: move it aside first
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)  # put the previous checkpoint back where it was
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def save_full(checkpoint: dict[str, Any], path: Path, save: Callable[[dict[str, Any], Path], None]) -> None:
    """One-file checkpoint (called on rank 0 only): written next to ``path``, then renamed onto it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        save(checkpoint, tmp)
        replace_atomically(tmp, path)
    except BaseException:
        remove(tmp)
        raise


# ----------------------------------------------------------------------------------------------- random state
def rng_state() -> dict[str, Any]:
    """This process's random state (torch, CUDA, Python, NumPy) in types ``torch.load(weights_only=True)`` reads."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


# ----------------------------------------------------------------------------------------------- validation
def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and global shapes of the model tensors stored in a checkpoint (sharded folder or full file)."""
    if path.is_dir():
        if not (path / _METADATA_FILENAME).is_file():
            raise CheckpointMismatchError(
                f"ZeroPPStrategy: {path} is not a complete sharded checkpoint: it has no {_METADATA_FILENAME}."
                " A save that was interrupted leaves only a hidden '.<name>.partial-*' folder, never this; was the"
                " folder copied or edited by hand?"
            )
        from torch.distributed.checkpoint import FileSystemReader

        try:
            metadata = FileSystemReader(str(path)).read_metadata()
        except Exception as err:
            raise CheckpointMismatchError(f"ZeroPPStrategy: cannot read the checkpoint index of {path}: {err}") from err
        prefix = f"{MODEL_KEY}."
        return {
            key[len(prefix) :]: tuple(meta.size)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(meta, "size")
        }
    try:
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointMismatchError(f"ZeroPPStrategy: {path} is not a readable checkpoint file: {err}") from err
    if not isinstance(checkpoint, Mapping) or MODEL_KEY not in checkpoint:
        raise CheckpointMismatchError(f"ZeroPPStrategy: {path} holds no '{MODEL_KEY}': not a Lightning checkpoint.")
    return {k: tuple(v.shape) for k, v in checkpoint[MODEL_KEY].items() if isinstance(v, torch.Tensor)}


def check_compatible(path: Path, model_shapes: Mapping[str, tuple[int, ...]], strict: bool) -> None:
    """Raises :class:`CheckpointMismatchError` listing missing, unexpected and differently shaped tensors."""
    stored = _checkpoint_shapes(path)
    missing = sorted(set(model_shapes) - set(stored)) if strict else []
    unexpected = sorted(set(stored) - set(model_shapes)) if strict else []
    reshaped = sorted(
        f"{k}: checkpoint {list(stored[k])} vs model {list(model_shapes[k])}"
        for k in set(stored) & set(model_shapes)
        if tuple(stored[k]) != tuple(model_shapes[k])
    )
    problems = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("shape differs", reshaped)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{title}: {shown}")
    if problems:
        raise CheckpointMismatchError(
            f"ZeroPPStrategy: the checkpoint {path} does not fit this model; " + "; ".join(problems) + "."
        )
