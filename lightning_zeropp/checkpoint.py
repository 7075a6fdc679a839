"""Checkpoints of :class:`~lightning_zeropp.ZeroPPStrategy`: saving, loading, and the checks around them.

The strategy's ``save_checkpoint`` / ``load_checkpoint`` call :func:`save` and :func:`load`; this module holds the rest.

- Saving writes to a hidden temporary name next to the target (``.<name>.partial-*``) and swaps it into place only
  when every rank has finished, so a killed rank or a full disk leaves the previous checkpoint at that path intact.
  A sharded folder is complete once its metadata file is there (written last, under its name in one rename); a file
  once it is a whole zip archive. The swap is one ``renameat2(RENAME_EXCHANGE)`` where the filesystem has it;
  elsewhere the previous checkpoint is moved aside (``.<name>.old-*``) first, and a process killed between the two
  renames leaves the path empty: :func:`recover`, run before every save and load, puts the newest complete
  checkpoint back (a finished ``.partial``, else the ``.old``) and removes temporaries it can prove incomplete or
  superseded. Whenever a process dies, the next save or load finds the previous or the new checkpoint, whole. The
  file handling is :mod:`lightning_zeropp.checkpoint_files`.
- Only a checkpoint is ever replaced: a file Lightning wrote, a folder with Lightning's checkpoint metadata, an empty
  file, or (sharded) an empty folder. A save onto anything else (a folder of notes, another file) is refused on every
  rank before anything is written, and deletes nothing.
- Loading first compares the checkpoint with the job: tensor names and global shapes, each optimizer's state keys
  and param groups, and (sharded) that every shard file the index points into is there and long enough. A mismatch
  is refused with what differs and the likely cause on the first line, instead of an opaque error from deep inside
  ``torch.distributed.checkpoint``; its own failures are unpacked per rank into ``Type: message``.
- A sharded checkpoint (a folder written by every rank) loads on any world size: tensors are stored with their global
  shapes and re-sliced for the loading job's shards.
"""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .checkpoint_files import (
    check_replaceable,
    interrupted_saves,
    recover,
    remove,
    replace_atomically,
    save_full,
    temporary_name,
)
from .collectives import agree_or_raise
from .compat.lightning import METADATA_FILENAME

MODEL_KEY = "state_dict"
RNG_KEY = "zeropp_rng_states"
COMMS_KEY = "zeropp_comms"  # per rank: the collectives' counters and error feedback residuals (ZeroPPComms)
FABRIC_KEYS = "zeropp_fabric_keys"  # a Fabric full file: the user's keys of the model, optimizers and schedulers
VERSION_KEY = "pytorch-lightning_version"  # what marks a file as a Lightning checkpoint (replaceable by a save)
HIDDEN_ATTRIBUTE = "zeropp_strategy_entries"
"""A Fabric full file's top-level dict is an ``OrderedDict`` whose attribute of this name holds the strategy's own
entries (:data:`RNG_KEY`, :data:`COMMS_KEY`, :data:`FABRIC_KEYS`, :data:`VERSION_KEY`), as a ``state_dict()`` holds
its ``_metadata``: a plain Fabric's ``load`` returns the file's entries beyond the objects it restored, which are then
the user's alone; ``torch.load(weights_only=True)`` reads the attribute."""
_HIDDEN_KEYS = (RNG_KEY, COMMS_KEY, FABRIC_KEYS, VERSION_KEY)
OPTIMIZER_STATES = "optimizer_states"  # the Trainer's list of optimizer states (a full file)
SCHEDULERS_KEY = "lr_schedulers"  # the Trainer's list of learning-rate scheduler states


@dataclass(frozen=True)
class CheckpointKeys:
    """Where a checkpoint keeps the model's state dict and each optimizer's state, by top-level key.

    Three are read: the Trainer's (``state_dict``; in a full file the optimizers as the list
    ``optimizer_states``, in a sharded folder as ``optimizer_0``, ``optimizer_1``, ...), which this strategy writes
    from both front doors into sharded folders and from the Trainer into full files, and which Lightning's
    consolidation of a sharded folder produces (``state_dict``, ``optimizer_0``, ...); and a Fabric state's own keys
    (``{"model": ..., "optimizer": ...}``), which a plain ``Fabric`` and this strategy's Fabric front door write into
    full files (the latter names them under :data:`FABRIC_KEYS`)."""

    model: str
    optimizers: tuple[str, ...] = ()
    optimizers_in_list: bool = False  # the optimizers are ``checkpoint["optimizer_states"]``, in order
    schedulers: tuple[str, ...] | None = None  # a Fabric file's scheduler keys; None: the Trainer's ``lr_schedulers``

    def optimizer_count(self, stored: int | None = None) -> int:
        return len(self.optimizers) if not self.optimizers_in_list else int(stored or 0)


class Ranks(Protocol):
    """What checkpointing needs of the strategy: its rank, the world size, and a broadcast from rank 0."""

    world_size: int
    global_rank: int

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model, or cannot be read; the message lists what is wrong."""


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
def flat_keys(state: Any, prefix: str = "") -> set[str]:
    """The dotted keys ``torch.distributed.checkpoint`` stores a nested state under: mappings by key, lists that hold
    containers by index (``param_groups.0.lr``); anything else is one value."""
    if isinstance(state, Mapping):
        return set().union(*(flat_keys(v, f"{prefix}{k}.") for k, v in state.items())) if state else set()
    if isinstance(state, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in state):
        return set().union(*(flat_keys(v, f"{prefix}{i}.") for i, v in enumerate(state)))
    return {prefix[:-1]}


def optimizer_keys(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[set[str]]:
    """The keys each optimizer's state is loaded from (what Lightning's load asks ``torch.distributed.checkpoint``
    for): its state (created as by a first step if it has none yet) and its param groups' settings."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return [flat_keys(get_optimizer_state_dict(model, optimizer)) for optimizer in optimizers]


def _parameter_order(optimizer_state: Mapping[str, Any]) -> list[Any]:
    return [p for group in optimizer_state.get("param_groups", []) for p in group["params"]]


def index_keyed(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name (``get_optimizer_state_dict``) keyed by parameter index
    instead, as ``optimizer.state_dict()`` of an unsharded model is (parameters numbered in the order of the param
    groups): what a plain Fabric, DDP or one device loads."""
    index = {name: i for i, name in enumerate(_parameter_order(optimizer_state))}
    return {
        "state": {index[name]: value for name, value in optimizer_state.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in optimizer_state["param_groups"]
        ],
    }


def name_keyed(optimizer_state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The inverse of :func:`index_keyed` for ``optimizer``: index i is the i-th parameter of its param groups, as
    ``optimizer.load_state_dict`` reads it. A state keyed by name is returned as it is."""
    order = _parameter_order(optimizer_state)
    if not order or not isinstance(order[0], int):
        return optimizer_state
    names = {id(p): _checkpoint_name(name) for name, p in model.named_parameters()}  # a tied one: its first name
    live = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(live) != len(order):
        raise CheckpointMismatchError(
            f"ZeroPPStrategy: the checkpoint's optimizer state holds {len(order)} parameters, the optimizer"
            f" {type(optimizer).__name__} {len(live)}; load it into the optimizer it was saved from."
        )
    return {
        "state": {live[i]: value for i, value in optimizer_state.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [live[i] for i in group["params"]]} for group in optimizer_state["param_groups"]
        ],
    }


def _checkpoint_name(name: str) -> str:
    """A parameter's name as checkpoints store it: without the ``_orig_mod.`` of a block wrapped by ``torch.compile``
    (as ``torch.distributed.checkpoint.state_dict`` names it)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def read_checkpoint(
    path: Path,
    keys: CheckpointKeys,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Loads ``model`` and ``optimizers`` (in order) from the checkpoint at ``path`` laid out as ``keys``; returns
    everything else it holds. Collective. A sharded folder is read with ``torch.distributed.checkpoint`` (each rank its
    own slices); a full file is read by every rank, which keeps its slices (no broadcast). An optimizer state keyed by
    parameter index (a plain optimizer's) is mapped to the model's parameter names first."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if path.is_dir():
        names = keys.optimizers
        model_state = {keys.model: get_model_state_dict(model)}
        dcp_load(model_state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
        set_model_state_dict(model, model_state[keys.model], options=StateDictOptions(strict=strict))
        for name, optimizer in zip(names, optimizers):
            optimizer_state = {name: get_optimizer_state_dict(model, optimizer)}
            dcp_load(optimizer_state, checkpoint_id=path)
            set_optimizer_state_dict(model, optimizer, optimizer_state[name], options=StateDictOptions(strict=strict))
        # the metadata: Lightning's own objects (callbacks' states, hyperparameters), the user's in Fabric
        return dict(torch.load(path / METADATA_FILENAME, weights_only=bool(weights_only)))
    checkpoint = reveal_strategy_entries(torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only))
    full = StateDictOptions(full_state_dict=True, strict=strict)  # each rank keeps its slices: nothing is sent
    set_model_state_dict(model, checkpoint.pop(keys.model), options=full)
    if keys.optimizers_in_list:
        states = list(checkpoint.get(OPTIMIZER_STATES, []))
    else:
        states = [checkpoint.pop(name) for name in keys.optimizers]
    for optimizer, optimizer_state in zip(optimizers, states):
        optimizer_state = name_keyed(optimizer_state, model, optimizer)
        if optimizer_state.get("state"):
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=full)
        else:  # a stateless optimizer (SGD without momentum): only the settings of its param groups
            for group, stored in zip(optimizer.param_groups, optimizer_state["param_groups"]):
                group.update({k: v for k, v in stored.items() if k != "params"})
    return checkpoint


def hide_strategy_entries(checkpoint: Mapping[str, Any]) -> OrderedDict:
    """The checkpoint with the strategy's own entries moved into the :data:`HIDDEN_ATTRIBUTE` attribute."""
    visible = OrderedDict((k, v) for k, v in checkpoint.items() if k not in _HIDDEN_KEYS)
    setattr(visible, HIDDEN_ATTRIBUTE, {k: checkpoint[k] for k in _HIDDEN_KEYS if k in checkpoint})
    return visible


def reveal_strategy_entries(loaded: Mapping[str, Any]) -> dict[str, Any]:
    """A loaded file's entries as one dict, the hidden ones (:func:`hide_strategy_entries`) among them again."""
    return {**loaded, **getattr(loaded, HIDDEN_ATTRIBUTE, {})}


def load_plain_weights(path: Path, model: torch.nn.Module, strict: bool, weights_only: bool | None) -> None:
    """Loads a plain state-dict file (``torch.save(model.state_dict(), path)``) into the sharded ``model``; every rank
    reads the file and keeps its slices. ``strict``: the file's keys must be the model's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointMismatchError(
            f"ZeroPPStrategy: {path} is not a state-dict file (a dict of tensors, as `torch.save(model.state_dict())`"
            " writes); load a checkpoint with `fabric.load(path, {'model': model, ...})`."
        )
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if strict and (missing or unexpected):
        problems = [_listed(title, keys) for title, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise KeyError(
            f"ZeroPPStrategy: the state-dict file {path} does not fit the model; " + "; ".join(problems)
            + ". Pass `strict=False` to load the tensors both have."
        )  # fmt: skip
    set_model_state_dict(
        model, {k: v for k, v in state.items() if k in expected}, options=StateDictOptions(full_state_dict=True)
    )


def _check_shard_files(path: Path, metadata: Any) -> None:
    """Every file the index of a sharded checkpoint points into exists and is long enough."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointMismatchError(
                f"ZeroPPStrategy: the checkpoint {path} is damaged: shard file {name} is missing."
            )
        if file.stat().st_size < size:
            raise CheckpointMismatchError(
                f"ZeroPPStrategy: the checkpoint {path} is damaged: shard file {name} is truncated"
                f" ({file.stat().st_size} bytes; its index needs {size}). Copy the checkpoint again or use another one."
            )


def _by_state_name(keys: set[str]) -> set[str]:
    """Optimizer keys with the parameter left out (``state.*.exp_avg``): a full file's state may be keyed by parameter
    index (an ordinary or consolidated checkpoint) where the job's is keyed by name; the load maps one to the other."""
    out = set()
    for key in keys:
        parts = key.split(".")
        if parts[0] == "state" and len(parts) > 2:
            out.add(f"state.*.{parts[-1]}")
        elif not (parts[0] == "param_groups" and parts[-1] == "params"):
            out.add(key)
    return out


def _top_level_keys(path: Path) -> tuple[set[str], dict[str, Any]]:
    """The top-level keys of a checkpoint (a sharded folder's tensors and metadata, or a file's), and a full file's
    :data:`FABRIC_KEYS` entry (empty otherwise)."""
    if path.is_dir():
        metadata = _sharded_metadata(path)
        keys = {key.partition(".")[0] for key in metadata.state_dict_metadata}
        try:
            keys |= set(torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=False))
        except Exception as err:
            raise CheckpointMismatchError(f"ZeroPPStrategy: cannot read {path / METADATA_FILENAME}: {err}") from err
        return keys, {}
    checkpoint = _read_file(path)
    return set(checkpoint), dict(checkpoint.get(FABRIC_KEYS) or {})


def read_keys(path: Path, model_key: str | None = None, optimizer_keys: tuple[str, ...] = ()) -> CheckpointKeys:
    """Where the checkpoint at ``path`` keeps what (see :class:`CheckpointKeys`). ``model_key`` / ``optimizer_keys``:
    the keys a Fabric state gives the model and its optimizers, tried when the checkpoint is in neither of the
    Trainer's layouts (a plain ``Fabric``'s full file)."""
    keys, fabric_keys = _top_level_keys(path)
    if MODEL_KEY in keys:
        if OPTIMIZER_STATES in keys and not path.is_dir():
            return CheckpointKeys(MODEL_KEY, optimizers_in_list=True)
        numbered = sorted((int(k[10:]), k) for k in keys if k.startswith("optimizer_") and k[10:].isdigit())
        return CheckpointKeys(MODEL_KEY, tuple(k for _, k in numbered))
    if fabric_keys:
        return CheckpointKeys(
            fabric_keys["model"], tuple(fabric_keys["optimizers"]), schedulers=tuple(fabric_keys["lr_schedulers"])
        )
    if model_key is not None and model_key in keys:
        return CheckpointKeys(model_key, tuple(k for k in optimizer_keys if k in keys))
    wanted = f"'{MODEL_KEY}'" + (f" or {model_key!r}" if model_key and model_key != MODEL_KEY else "")
    raise CheckpointMismatchError(
        f"ZeroPPStrategy: {path} holds no model state under {wanted} (its keys: {sorted(keys)[:8]}): not a checkpoint"
        " of this model. Pass the state under the key the model was saved with (`fabric.load(path, {key: model})`)."
    )


def _sharded_metadata(path: Path) -> Any:
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
    _check_shard_files(path, metadata)
    return metadata


def _read_file(path: Path) -> Mapping[str, Any]:
    try:
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointMismatchError(f"ZeroPPStrategy: {path} is not a readable checkpoint file: {err}") from err
    if not isinstance(checkpoint, Mapping):
        raise CheckpointMismatchError(
            f"ZeroPPStrategy: {path} holds a {type(checkpoint).__name__}, not a checkpoint (a dict of states)."
        )
    return reveal_strategy_entries(checkpoint)


def _stored(path: Path, keys: CheckpointKeys) -> tuple[dict[str, tuple[int, ...]], list[set[str]]]:
    """Names and global shapes of the model tensors stored in a checkpoint (sharded folder or full file), and each
    optimizer's state keys (for a full file, by state name only: see :func:`_by_state_name`)."""
    if path.is_dir():
        metadata = _sharded_metadata(path)
        prefix = f"{keys.model}."
        shapes = {
            key[len(prefix) :]: tuple(meta.size)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(meta, "size")
        }
        optimizers: dict[str, set[str]] = {name: set() for name in keys.optimizers}
        for key in metadata.state_dict_metadata:
            head, _, rest = key.partition(".")
            if head in optimizers:
                optimizers[head].add(rest)
        return shapes, [optimizers[name] for name in keys.optimizers]
    checkpoint = _read_file(path)
    model = checkpoint[keys.model]
    shapes = {k: tuple(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
    states = checkpoint.get(OPTIMIZER_STATES, []) if keys.optimizers_in_list else [
        checkpoint[k] for k in keys.optimizers
    ]  # fmt: skip
    return shapes, [_by_state_name(flat_keys(state)) for state in states]


def _listed(title: str, items: list[str]) -> str:
    shown = ", ".join(items[:4]) + (f", ... ({len(items)} in all)" if len(items) > 4 else "")
    return f"{title}: {shown}"


def _groups(keys: set[str]) -> int:
    return len({k.split(".")[1] for k in keys if k.startswith("param_groups.")})


def _check_optimizers(
    path: Path, stored: list[set[str]], expected: list[set[str]], names: list[str], sharded: bool
) -> None:
    if expected and not stored:
        raise CheckpointMismatchError(
            f"ZeroPPStrategy: the checkpoint {path} holds no optimizer state (saved with weights_only=True?), and this"
            f" run resumes {len(expected)} optimizer(s). Resume from a full training checkpoint, or load only the"
            " weights into the model before fit."
        )
    if len(stored) != len(expected):
        raise CheckpointMismatchError(
            f"ZeroPPStrategy: the checkpoint {path} holds the state of {len(stored)} optimizer(s); this run has"
            f" {len(expected)} ({', '.join(names)}). Configure the optimizers the checkpoint was saved with."
        )
    for i, (have, want) in enumerate(zip(stored, expected)):
        state = lambda keys: {k for k in keys if k.startswith("state.")}  # noqa: E731
        # a sharded load asks torch.distributed.checkpoint for every key (settings too) and fails on a missing one;
        # a full file's param groups are loaded as saved (torch fills in settings newer than the file)
        required = want if sharded else state(want)
        state_first = lambda key: (not key.startswith("state."), key)  # noqa: E731
        missing = sorted(required - have, key=state_first)
        unexpected = sorted(state(have) - state(want), key=state_first)
        problems = [_listed(t, x) for t, x in (("missing", missing), ("unexpected", unexpected)) if x]
        if _groups(have) != _groups(want):
            problems.append(f"param groups: {_groups(have)} in the checkpoint, {_groups(want)} here")
        if problems:
            raise CheckpointMismatchError(
                f"ZeroPPStrategy: optimizer {i}'s state in the checkpoint {path} does not fit this run's {names[i]}; "
                + "; ".join(problems)
                + ". It was likely saved with another optimizer (e.g. SGD vs AdamW) or other param groups: resume with"
                " the optimizer it was saved with, or start the new optimizer from its weights (consolidate it with"
                " `python -m lightning_zeropp.consolidate`, load the `state_dict` into the model, then fit)."
            )


def check_compatible(
    path: Path,
    model_shapes: Mapping[str, tuple[int, ...]],
    strict: bool,
    optimizers: list[tuple[str, set[str]]] | None = None,
    keys: CheckpointKeys | None = None,
) -> None:
    """Raises :class:`CheckpointMismatchError` listing missing, unexpected and differently shaped tensors; then, for
    ``optimizers`` (name and expected keys of each optimizer this run restores), missing and unexpected state.
    ``keys``: where the checkpoint keeps them (default: read from it, see :func:`read_keys`)."""
    stored, stored_optimizers = _stored(path, keys or read_keys(path))
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
    if optimizers:
        expected = [keys if path.is_dir() else _by_state_name(keys) for _, keys in optimizers]
        _check_optimizers(path, stored_optimizers, expected, [name for name, _ in optimizers], path.is_dir())


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
    :meth:`ZeroPPComms.state_dict`; its tensors are written by each rank into a sharded checkpoint (the state keeps a
    note of each), or gathered with it into the one file."""
    path = Path(ranks.broadcast(filepath))

    def prepare() -> None:  # before anything is written: repair an interrupted save, refuse to replace a non-checkpoint
        recover(path)
        check_replaceable(path, state_dict_type)

    agree_or_raise(_attempt(prepare) if ranks.is_global_zero else None)
    checkpoint[RNG_KEY] = gather_rng_states(ranks.world_size)  # every rank's, so a resume continues each stream
    rank_tensors: dict[str, torch.Tensor] = {}
    if comms_state is not None:
        full = state_dict_type == "full"
        checkpoint[COMMS_KEY] = _gather_to_zero(_stash(comms_state, None if full else rank_tensors), ranks)
    if state_dict_type == "full":
        if FABRIC_KEYS in checkpoint:  # Fabric's: a plain Fabric's load returns the user's entries alone
            checkpoint = hide_strategy_entries(checkpoint)
        error = _attempt(lambda: save_full(checkpoint, path, save_file)) if ranks.is_global_zero else None
        agree_or_raise(error, f"ZeroPPStrategy: saving the checkpoint {path}", after=_UNTOUCHED)
        return
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException

    tmp = Path(ranks.broadcast(str(temporary_name(path)) if ranks.is_global_zero else None))
    tensors = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    if rank_tensors:  # each rank its own, under its rank: rank-local tensors, not shards of one global tensor
        tensors[COMMS_KEY] = {f"rank{ranks.global_rank}": rank_tensors}
    try:
        dcp_save(tensors, checkpoint_id=tmp)  # every rank writes its shards; fails on all if one does
    except CheckpointException as err:  # a BaseException: it would slip past `except Exception` in user code
        if ranks.is_global_zero:
            remove(tmp)
        raise RuntimeError(
            f"ZeroPPStrategy: saving the checkpoint {path} failed ({describe_failures(err)}). {_UNTOUCHED}"
        ) from err

    def finish() -> None:
        try:
            # last, and under its name in one step: a folder without it is incomplete, one with it is whole
            written = tmp / f"{METADATA_FILENAME}.partial"
            torch.save(checkpoint, written)
            os.replace(written, tmp / METADATA_FILENAME)
            replace_atomically(tmp, path)
        except BaseException:
            remove(tmp)
            raise

    error = _attempt(finish) if ranks.is_global_zero else None
    agree_or_raise(error, f"ZeroPPStrategy: saving the checkpoint {path}", after=_UNTOUCHED)


def describe_failures(err: BaseException) -> str:
    """``"rank r: Type: message; ..."`` for a ``CheckpointException`` of torch.distributed.checkpoint, whose failures
    are per rank an exception or, in newer torch, an ``(exception, stack)`` pair; ranks that failed alike are named
    together (``ranks 0, 1: ...``). The error itself for any other exception."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, Mapping) or not failures:
        return f"{type(err).__name__}: {err}"
    ranks_by_text: dict[str, list[int]] = {}
    for rank, failure in sorted(failures.items()):
        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
            failure = failure[0]
        failure = getattr(failure, "exc", failure)  # older torch: a WrappedException holding .exc and .formatted
        ranks_by_text.setdefault(f"{type(failure).__name__}: {failure}", []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
        for text, ranks in ranks_by_text.items()
    )


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
    read: Callable[[Path, CheckpointKeys], dict[str, Any]],
    restore: Callable[[Any, Path], None] | None = None,
    optimizers: list[tuple[str, set[str]]] | None = None,
    model_key: str | None = None,
    optimizer_keys: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Repairs an interrupted save at the path (:func:`recover`), reads its :class:`CheckpointKeys` (``model_key`` and
    ``optimizer_keys``: a Fabric state's names, see :func:`read_keys`), checks the checkpoint against the model and
    the ``optimizers`` (name and expected state keys of each) on every rank (each reads the files itself: they may
    not share a filesystem), and only then runs the collective ``read(path, keys)``; restores this rank's random
    state. Returns what ``read`` returned, without the random states and the collectives' state (handed to
    ``restore(state, path)``)."""
    path = Path(ranks.broadcast(filepath))
    agree_or_raise(_attempt(lambda: recover(path)) if ranks.is_global_zero else None)
    if ranks.is_global_zero and (unfinished := interrupted_saves(path.parent, path)):
        rank_zero_warn(
            f"ZeroPPStrategy: loading {path}. Next to it, the save of {', '.join(unfinished)} is incomplete: a process"
            " was killed while saving (for example by SIGKILL at the end of SLURM's grace period), or a save is still"
            " running. An incomplete save never replaces a checkpoint; the next save to that name removes it."
        )
    problem: Exception | None = None
    try:
        if not os.path.lexists(path):  # a filesystem of this node's own: repair its copy too
            recover(path)
        if not path.exists():
            raise FileNotFoundError(f"ZeroPPStrategy: checkpoint {path} does not exist.")
        keys = read_keys(path, model_key, optimizer_keys)
        check_compatible(path, model_shapes, strict, optimizers, keys)
    except (FileNotFoundError, CheckpointMismatchError) as err:
        problem = err
    agree_or_raise(problem)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        loaded = read(path, keys)
    except CheckpointMismatchError:
        raise
    except (Exception, CheckpointException) as err:  # an unreadable shard: the cause first, per rank
        raise CheckpointMismatchError(
            f"ZeroPPStrategy: loading the checkpoint {path} failed: {describe_failures(err)}"
        ) from err
    restore_rng_states(loaded.pop(RNG_KEY, None), ranks.world_size, ranks.global_rank)
    if restore is not None:
        restore(loaded.pop(COMMS_KEY, None), path)
    else:
        loaded.pop(COMMS_KEY, None)
    return loaded


# ----------------------------------------------------------------------------------------------- collectives' state
_STORED = "zeropp_stored_tensor"  # a note standing for a per-rank tensor of a sharded checkpoint


def _stash(state: Any, tensors: dict[str, torch.Tensor] | None, key: tuple[str, ...] = ()) -> Any:
    """``state`` with its tensors on the CPU (``tensors`` None: they are written with it), or each replaced by a note
    of its name, shape and dtype, the tensor put into ``tensors`` under that name (written by DCP)."""
    if isinstance(state, torch.Tensor):
        if tensors is None:
            return state.detach().cpu()
        name = "/".join(key)
        tensors[name] = state.detach()
        return {_STORED: name, "shape": list(state.shape), "dtype": str(state.dtype).removeprefix("torch.")}
    if isinstance(state, dict):
        return {k: _stash(v, tensors, (*key, str(k))) for k, v in state.items()}
    return state


def _notes(state: Any) -> dict[str, dict[str, Any]]:
    """The notes :func:`_stash` left in ``state``, by tensor name."""
    if not isinstance(state, dict):
        return {}
    if _STORED in state:
        return {state[_STORED]: state}
    return {name: note for value in state.values() for name, note in _notes(value).items()}


def _unstash(state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``state`` with each note replaced by its tensor from ``tensors`` (a note without one stays)."""
    if not isinstance(state, dict):
        return state
    if _STORED in state:
        return tensors.get(state[_STORED], state)
    return {k: _unstash(v, tensors) for k, v in state.items()}


def _upgraded(state: dict[str, Any]) -> dict[str, Any]:
    """A collectives' state as earlier versions wrote it (the step count with the residuals, a sharded file's
    residuals named by unit alone, a layout without the residuals' width or the reduction they belong to) in today's
    form."""
    layout = state.get("layout")
    if isinstance(layout, dict) and "error_feedback_bits" not in layout:  # residuals were fp32 then
        layout = {**layout, "error_feedback_bits": 32}
    if isinstance(layout, dict) and "reduction" not in layout:  # qgZ's two hops were the only reduction with residuals
        layout = {**layout, "reduction": "two_hop"}
    if layout is not state.get("layout"):
        state = {**state, "layout": layout}
    feedback = state.get("error_feedback")
    if feedback is None or "steps" not in feedback:
        return state
    feedback = dict(feedback)
    state = {**state, "steps": feedback.pop("steps"), "error_feedback": feedback}
    if "shapes" in feedback:
        shapes = feedback.pop("shapes")
        feedback["residuals"] = {u: {_STORED: u, "shape": list(s), "dtype": "float32"} for u, s in shapes.items()}
    return state


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
    """Hands ``comms`` (a :class:`~lightning_zeropp.comm.ZeroPPComms`) this rank's state from a checkpoint, with the
    per-rank tensors of a sharded one read back (collective: every rank reads its own) when the checkpoint was
    written by as many ranks; :meth:`ZeroPPComms.load_state_dict` decides what of it applies."""
    if not states:
        return
    states = [_upgraded(state) for state in states]
    mine = states[rank] if len(states) == world_size else states[0]
    tensors: dict[str, torch.Tensor] = {}
    if sharded and len(states) == world_size and any(_notes(state) for state in states):
        from torch.distributed.checkpoint import load as dcp_load

        tensors = {
            name: torch.empty(note["shape"], dtype=getattr(torch, note["dtype"])) for name, note in _notes(mine).items()
        }
        dcp_load({COMMS_KEY: {f"rank{rank}": tensors}}, checkpoint_id=path)
    comms.load_state_dict(_unstash(mine, tensors), source=f"the checkpoint {path}")


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
