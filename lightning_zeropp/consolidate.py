"""Turn a sharded ZeroPPStrategy checkpoint (a folder) into one ordinary Lightning checkpoint file.

    python -m lightning_zeropp.consolidate SRC_FOLDER DST_FILE

The result needs no strategy and no process group: ``torch.load(DST)`` reads it, and
``YourModule.load_from_checkpoint(DST)`` restores the model on one process. Optimizer states are re-keyed from
parameter names to the integer ids ``torch.optim.Optimizer.load_state_dict`` expects (the order of each param
group), and everything else (epoch, step, loops, callbacks, hyper-parameters) is copied from the folder's metadata.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .checkpoint import MODEL_KEY, CheckpointMismatchError, index_keyed, save_full
from .compat.lightning import METADATA_FILENAME


def _to_plain(value: Any) -> Any:
    """Tensors as plain CPU tensors, containers recursively."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_plain(v) for v in value)
    return value


def load_sharded(src: Path, scratch: Path | None = None) -> dict[str, Any]:
    """The whole checkpoint in one process: model and optimizer tensors gathered, metadata merged. ``scratch``: a
    folder for the intermediate single-file copy (default: the system's temporary folder)."""
    if not (src.is_dir() and (src / METADATA_FILENAME).is_file()):
        raise CheckpointMismatchError(
            f"consolidate: {src} is not a sharded checkpoint folder (a folder holding {METADATA_FILENAME})."
        )
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        flat_file = Path(tmp) / "flat.pt"
        dcp_to_torch_save(str(src), str(flat_file))
        stored = torch.load(flat_file, map_location="cpu", weights_only=False)
    checkpoint = torch.load(src / METADATA_FILENAME, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = _to_plain(stored.pop(MODEL_KEY))
    optimizer_keys = sorted((k for k in stored if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [index_keyed(_to_plain(stored[k])) for k in optimizer_keys]
    return checkpoint


def consolidate(src: str | Path, dst: str | Path) -> Path:
    src, dst = Path(src), Path(dst)
    if dst.is_dir():
        raise IsADirectoryError(f"consolidate: the destination {dst} is a folder; give a file name such as last.ckpt.")
    dst.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = load_sharded(src, scratch=dst.parent)  # next to the result: the space is needed there anyway
    save_full(checkpoint, dst, lambda c, p: torch.save(c, p))
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_zeropp.consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path, help="sharded checkpoint folder written by ZeroPPStrategy")
    parser.add_argument("dst", type=Path, help="the single checkpoint file to write")
    args = parser.parse_args(argv)
    try:
        out = consolidate(args.src, args.dst)
    except (CheckpointMismatchError, IsADirectoryError) as err:
        print(err, file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
