"""Checkpoints of :class:`~lightning_zeropp.ZeroPPStrategy`: saving, loading, and the checks around them.

The strategy's ``save_checkpoint`` / ``load_checkpoint`` call :func:`save` and :func:`load`; this module holds the rest.

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
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .collectives import agree_or_raise
from .compat.lightning import METADATA_FILENAME

MODEL_KEY = "state_dict"
RNG_KEY = "zeropp_rng_states"
COMMS_KEY = "zeropp_comms"  # per rank: the collectives' counters and error feedback residuals (ZeroPPComms)


class Ranks(Protocol):
    """What checkpointing needs of the strategy: its rank, the world size, and a broadcast from rank 0."""

    world_size: int
    global_rank: int

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


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
        if not (path / METADATA_FILENAME).is_file():
            raise CheckpointMismatchError(
                f"ZeroPPStrategy: {path} is not a complete sharded checkpoint: it has no {METADATA_FILENAME}."
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


# ----------------------------------------------------------------------------------------------- save and load
_UNTOUCHED = "The checkpoint previously at that path, if any, is untouched."


def save(
    ranks: Ranks,
    checkpoint: dict[str, Any],
    filepath: str | os.PathLike,
    state_dict_type: Literal["sharded", "full"],
    save_file: Callable[[dict[str, Any], Path], None],
    comms_state: dict[str, Any] | None = None,
) -> None:
    """Writes ``checkpoint`` (Lightning's dict, the model and optimizer states as the strategy collected them) to a
    temporary name and renames it onto ``filepath`` when complete. Collective: every rank calls it; if any rank fails,
    every rank raises. ``save_file`` writes one file (the ``full`` format, on rank 0). ``comms_state``: this rank's
    :meth:`ZeroPPComms.state_dict`; its residuals are written by each rank into a sharded checkpoint, or gathered
    into the one file."""
    path = Path(ranks.broadcast(filepath))
    checkpoint[RNG_KEY] = gather_rng_states(ranks.world_size)  # every rank's, so a resume continues each stream
    residuals = _split_residuals(comms_state) if comms_state is not None else {}
    if "error_feedback" in (comms_state or {}) and state_dict_type == "full":
        comms_state["error_feedback"]["residuals"] = {u: r.cpu() for u, r in residuals.items()}
        residuals = {}
    if comms_state is not None:
        checkpoint[COMMS_KEY] = _gather_to_zero(comms_state, ranks)
    if state_dict_type == "full":
        error = _attempt(lambda: save_full(checkpoint, path, save_file)) if ranks.is_global_zero else None
        agree_or_raise(error, f"ZeroPPStrategy: saving the checkpoint {path}", after=_UNTOUCHED)
        return
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException

    tmp = Path(ranks.broadcast(str(temporary_name(path)) if ranks.is_global_zero else None))
    tensors = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    if residuals:  # each rank its own, under its rank: rank-local tensors, not shards of one global tensor
        tensors[COMMS_KEY] = {f"rank{ranks.global_rank}": residuals}
    try:
        dcp_save(tensors, checkpoint_id=tmp)  # every rank writes its shards; fails on all if one does
    except CheckpointException as err:  # a BaseException: it would slip past `except Exception` in user code
        if ranks.is_global_zero:
            remove(tmp)
        failures = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(err.failures.items()))
        raise RuntimeError(f"ZeroPPStrategy: saving the checkpoint {path} failed ({failures}). {_UNTOUCHED}") from err

    def finish() -> None:
        try:
            torch.save(checkpoint, tmp / METADATA_FILENAME)  # last: a folder without it is incomplete
            replace_atomically(tmp, path)
        except BaseException:
            remove(tmp)
            raise

    error = _attempt(finish) if ranks.is_global_zero else None
    agree_or_raise(error, f"ZeroPPStrategy: saving the checkpoint {path}", after=_UNTOUCHED)


def _attempt(write: Callable[[], None]) -> Exception | None:
    try:
        write()
    except Exception as err:
        return err
    return None


def load(
    ranks: Ranks,
    filepath: str | os.PathLike,
    model_shapes: Mapping[str, tuple[int, ...]],
    strict: bool,
    read: Callable[[Path], dict[str, Any]],
    restore: Callable[[Any, Path], None] | None = None,
) -> dict[str, Any]:
    """Checks the checkpoint against the model on every rank (each reads the files itself: they may not share a
    filesystem) and only then runs the collective ``read(path)``; restores this rank's random state. Returns what
    ``read`` returned, without the random states and the collectives' state (handed to ``restore(state, path)``)."""
    path = Path(ranks.broadcast(filepath))
    problem: Exception | None = None
    try:
        if not path.exists():
            raise FileNotFoundError(f"ZeroPPStrategy: checkpoint {path} does not exist.")
        check_compatible(path, model_shapes, strict)
    except (FileNotFoundError, CheckpointMismatchError) as err:
        problem = err
    agree_or_raise(problem)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        loaded = read(path)
    except CheckpointMismatchError:
        raise
    except (Exception, CheckpointException) as err:  # a truncated shard, an unreadable file: name them
        raise CheckpointMismatchError(f"ZeroPPStrategy: loading the checkpoint {path} failed: {err}") from err
    restore_rng_states(loaded.pop(RNG_KEY, None), ranks.world_size, ranks.global_rank)
    if restore is not None:
        restore(loaded.pop(COMMS_KEY, None), path)
    else:
        loaded.pop(COMMS_KEY, None)
    return loaded


# ----------------------------------------------------------------------------------------------- collectives' state
def _split_residuals(comms_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Takes the residual tensors out of ``comms_state`` (leaving their shapes); returns them by unit."""
    feedback = comms_state.get("error_feedback")
    if feedback is None:
        return {}
    residuals = feedback.pop("residuals")
    feedback["shapes"] = {unit: tuple(r.shape) for unit, r in residuals.items()}
    return residuals


def _gather_to_zero(state: dict[str, Any], ranks: Ranks) -> list[dict[str, Any]] | None:
    """Every rank's ``state`` on rank 0 (None elsewhere: only rank 0's copy of the checkpoint dict is written)."""
    if ranks.world_size == 1:
        return [state]
    gathered: list[Any] | None = [None] * ranks.world_size if ranks.is_global_zero else None
    dist.gather_object(state, gathered, dst=0)
    return gathered


def restore_comms(
    comms: Any, states: list[dict[str, Any]] | None, path: Path, sharded: bool, world_size: int, rank: int
) -> None:
    """Gives ``comms`` (a :class:`~lightning_zeropp.comm.ZeroPPComms`) its state from a checkpoint: the counters
    always; the error feedback residuals when the checkpoint was written by a job of the same shape (ranks per node,
    nodes, pipeline stages, blocks), else they start from zero, with one warning. Collective for a sharded checkpoint
    with residuals (every rank reads its own)."""
    if not states:
        return
    mine = states[rank] if len(states) == world_size else states[0]
    comms.gradient_calls = int(mine["gradient_calls"])
    feedback = mine.get("error_feedback")
    if comms.feedback is None:
        return
    comms.feedback.clear()
    if feedback is None:
        rank_zero_warn(
            f"ZeroPPStrategy: the checkpoint {path} has no error feedback residuals (it was saved without"
            " `gradient_error_feedback`); they start from zero."
        )
        return
    comms.feedback.steps = int(feedback["steps"])
    if len(states) != world_size or mine["layout"] != comms.layout():
        rank_zero_warn(
            f"ZeroPPStrategy: the checkpoint {path} was written by {len(states)} ranks laid out as {mine['layout']};"
            f" this job has {world_size} ranks laid out as {comms.layout()}. The error feedback residuals belong to"
            " that layout and are dropped (they start from zero); everything else resumes as saved."
        )
        return
    residuals = feedback.get("residuals")
    if residuals is None and sharded:
        from torch.distributed.checkpoint import load as dcp_load

        target = {u: torch.empty(shape, dtype=torch.float32) for u, shape in feedback["shapes"].items()}
        dcp_load({COMMS_KEY: {f"rank{rank}": target}}, checkpoint_id=path)
        residuals = target
    comms.feedback.load_state_dict({"residuals": residuals or {}, "periods": feedback["periods"]})


def gather_rng_states(world_size: int) -> list[dict[str, Any]]:
    states: list[Any] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(states, rng_state())
    else:
        states[0] = rng_state()
    return states


def restore_rng_states(states: list[dict[str, Any]] | None, world_size: int, rank: int) -> None:
    if not states:
        return
    if len(states) != world_size:
        rank_zero_warn(
            f"ZeroPPStrategy: the checkpoint was written by {len(states)} ranks and is loaded by {world_size};"
            " the weights, optimizer and loops resume exactly, the random number streams (dropout) start afresh."
        )
        return
    set_rng_state(states[rank])
