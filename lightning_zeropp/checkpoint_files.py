"""Checkpoint files on disk: temporary names, swapping a finished checkpoint into place, recognising a checkpoint,
and repairing what a killed save left behind.

A save writes ``.<name>.partial-*`` next to the target (``<name>`` with ``_`` written ``%5F``, so that Lightning's
search for ``hpc_ckpt_N`` never reads a temporary as a checkpoint) and swaps it in with one
``renameat2(RENAME_EXCHANGE)`` where the system has it; elsewhere the previous checkpoint is moved aside
(``.<name>.old-*``) first, and a process killed between the two renames leaves the path empty until :func:`recover`
(run before every save and load) puts the newest complete checkpoint back. Only a checkpoint, an empty file or
(sharded) an empty folder is ever replaced (:func:`check_replaceable`); nothing else at the path is deleted.
"""

from __future__ import annotations

import ctypes
import errno
import os
import pickletools
import shutil
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .compat.lightning import METADATA_FILENAME


def _stem(path: Path) -> str:
    """The hidden prefix of ``path``'s temporaries: ``.<name>`` with ``%`` and ``_`` percent-encoded.

    Lightning finds the newest ``hpc_ckpt_N.ckpt`` (the SLURM requeue checkpoint) by reading the digits after
    ``hpc_ckpt_`` (or ``ckpt_``) in every name of the folder, hidden ones included: a temporary named
    ``.hpc_ckpt_3.ckpt.partial-ab12cd34`` left by a killed save would read as checkpoint 31234, which does not exist,
    and the requeued job would fail to resume. Without ``_`` a temporary never matches; the encoding is one-to-one.
    """
    return "." + path.name.replace("%", "%25").replace("_", "%5F")


def target_name(temporary: str) -> str | None:
    """The name of the checkpoint a temporary (``.<name>.partial-*`` or ``.<name>.old-*``) belongs to, else None."""
    for kind in (".partial-", ".old-"):
        stem, found, _ = temporary.rpartition(kind)
        if found and stem.startswith(".") and "_" not in stem:
            return unquote(stem[1:])
    return None


def temporary_name(path: Path) -> Path:
    return path.with_name(f"{_stem(path)}.partial-{uuid.uuid4().hex[:8]}")


def _aside_name(path: Path) -> Path:
    return path.with_name(f"{_stem(path)}.old-{uuid.uuid4().hex[:8]}")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _load_renameat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):  # not Linux, or a libc older than glibc 2.28
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def exchange_available() -> bool:
    """Whether this system has the exchange rename (``renameat2`` with ``RENAME_EXCHANGE``, Linux)."""
    return _renameat2 is not None


def exchange(a: Path, b: Path) -> bool:
    """Swaps the two existing names ``a`` and ``b`` (files or folders) in one atomic step. False where the system or
    filesystem has no exchange rename; raises other errors."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def replace_atomically(tmp: Path, path: Path) -> None:
    """Moves a completely written ``tmp`` (file or folder) onto ``path``, replacing what was there; at every moment
    ``path`` holds either the previous or the new content, or (two-rename fallback only) :func:`recover` can put one
    back."""
    if not os.path.lexists(path) or (path.is_file() and tmp.is_file()) or path.is_symlink():
        os.replace(tmp, path)  # one atomic step
        return
    if exchange(tmp, path):
        remove(tmp)  # now the previous checkpoint
        return
    old = _aside_name(path)
    os.replace(path, old)  # a folder cannot be replaced in one step without the exchange: move it aside first
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(old, path)  # put the previous checkpoint back where it was
        raise
    remove(old)


# ----------------------------------------------------------------------------------------------- what is a checkpoint
def is_checkpoint_file(path: Path) -> bool:
    """Whether ``path`` is a Lightning checkpoint file (torch's zip format holding ``state_dict`` and Lightning's
    version key), found by reading the pickle's strings, never by unpickling it."""
    try:
        if not path.is_file() or not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                return False
            strings = {arg for _, arg, _ in pickletools.genops(archive.read(name)) if isinstance(arg, str)}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return False
    return "state_dict" in strings and "pytorch-lightning_version" in strings


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint: DCP's index and Lightning's metadata (written last)."""
    return path.is_dir() and (path / METADATA_FILENAME).is_file() and (path / ".metadata").is_file()


def is_checkpoint(path: Path) -> bool:
    return is_checkpoint_folder(path) if path.is_dir() else is_checkpoint_file(path)


def check_replaceable(path: Path, state_dict_type: str) -> None:
    """Raises unless a save of ``state_dict_type`` may replace what is at ``path``: nothing, a symlink, a checkpoint of
    either format (switching ``state_dict_type`` replaces the other format's; a folder is Lightning's sharded checkpoint
    when it holds its metadata file), an empty file, or (sharded only, as in Lightning) an empty folder."""
    if not os.path.lexists(path) or path.is_symlink():
        return
    if path.is_dir():
        if (path / METADATA_FILENAME).is_file() or (state_dict_type == "sharded" and not any(path.iterdir())):
            return
        if state_dict_type == "full":
            raise IsADirectoryError(
                f"ZeroPPStrategy: the checkpoint path {path} exists and is a directory that is not a checkpoint (no"
                f" {METADATA_FILENAME}); a full checkpoint is one file and a save never deletes files it did not"
                " write: choose another path or remove it."
            )
        raise FileExistsError(
            f"ZeroPPStrategy: the checkpoint path {path} exists and is a folder of other files, not a checkpoint (no"
            f" {METADATA_FILENAME}); a save never deletes files it did not write: choose another path or remove it."
        )
    if path.stat().st_size > 0 and not is_checkpoint_file(path):
        raise FileExistsError(
            f"ZeroPPStrategy: the checkpoint path {path} exists and is a file that is not a Lightning checkpoint; a"
            " save never deletes files it did not write: choose another path or remove it."
        )


def _temporaries(path: Path) -> list[Path]:
    """This path's hidden siblings a save leaves when it is killed: ``.<name>.partial-*`` and ``.<name>.old-*``."""
    if not path.parent.is_dir():
        return []
    found = [
        p
        for p in path.parent.iterdir()
        if p.name.startswith(f"{_stem(path)}.partial-") or p.name.startswith(f"{_stem(path)}.old-")
    ]
    return sorted(found, key=lambda p: p.lstat().st_mtime_ns, reverse=True)


def recover(path: Path) -> list[str]:
    """Repairs what a save killed mid-way left at ``path``: if the path is missing, the newest complete temporary
    (a finished ``.partial``, else an ``.old``) is renamed back onto it; then temporaries that are incomplete, or
    complete but superseded by a checkpoint at the path, are removed. Returns what was done (empty: nothing)."""
    done = []
    temporaries = _temporaries(path)
    if not os.path.lexists(path):
        complete = [p for p in temporaries if is_checkpoint(p)]
        chosen = next((p for p in complete if ".partial-" in p.name), complete[0] if complete else None)
        if chosen is not None:
            os.replace(chosen, path)
            done.append(f"restored {path.name} from {chosen.name}")
            temporaries.remove(chosen)
    if is_checkpoint(path) or not temporaries:
        for leftover in temporaries:
            remove(leftover)
            done.append(f"removed {leftover.name}")
    else:  # no checkpoint at the path: remove only what is provably incomplete
        for leftover in temporaries:
            if not is_checkpoint(leftover):
                remove(leftover)
                done.append(f"removed {leftover.name}")
    if done:
        rank_zero_warn(f"ZeroPPStrategy: an earlier save to {path} was interrupted; " + "; ".join(done) + ".")
    return done


def interrupted_saves(folder: Path, other_than: Path) -> list[str]:
    """Names of the checkpoints in ``folder`` (``other_than`` excepted) whose save was killed before it was complete:
    an incomplete ``.<name>.partial-*`` is there. The next save to that name, or load from it, removes it."""
    if not folder.is_dir():
        return []
    found = set()
    for p in folder.iterdir():
        name = target_name(p.name)
        if name is not None and name != other_than.name and ".partial-" in p.name and not is_checkpoint(p):
            found.add(name)
    return sorted(found)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        (path / METADATA_FILENAME).unlink(missing_ok=True)  # first: a half-removed folder must not look complete
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def save_full(checkpoint: dict[str, Any], path: Path, save: Callable[[dict[str, Any], Path], None]) -> None:
    """One-file checkpoint (called on rank 0 only): written next to ``path``, then renamed onto it.

    The temporary file is created here first, so that a folder this process may not write is named in the error:
    Lightning's ``CheckpointIO`` (its atomic save) swallows a ``PermissionError`` and writes nothing, and the rename
    would then fail on a missing file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        tmp.touch(exist_ok=False)
    except PermissionError as err:
        raise PermissionError(
            f"ZeroPPStrategy: cannot save the checkpoint {str(path)!r}: no permission to create files in"
            f" {str(path.parent)!r} ({err.strerror}). Save to a folder you can write (ModelCheckpoint(dirpath=...),"
            " Trainer(default_root_dir=...)) or change its permissions."
        ) from None
    try:
        save(checkpoint, tmp)
        if tmp.stat().st_size == 0:
            raise OSError(
                f"ZeroPPStrategy: saving the checkpoint {str(path)!r} wrote nothing to {str(tmp)!r}: the checkpoint IO"
                " plugin failed without an error. Check that the folder is writable and has free space."
            )
        replace_atomically(tmp, path)
    except BaseException:
        remove(tmp)
        raise
