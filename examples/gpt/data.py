"""Byte-level corpus: the Python standard library's own ``.py`` files (present wherever Python is), or any file.

Files are read in sorted order and concatenated; the last ``val_fraction`` of the bytes is the validation split,
so the split is fixed for a given corpus. Samples are non-overlapping windows of ``block_size + 1`` bytes.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(path: str | None = None, max_bytes: int | None = None) -> torch.Tensor:
    """The corpus as a uint8 tensor: ``path`` (a file or a folder of ``.py`` files) or the standard library."""
    if path is None:
        files = stdlib_files()
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"ByteCorpusDataModule: `path={path!r}` does not exist; give a text file or folder."
            )
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if not blob:
        raise ValueError(f"ByteCorpusDataModule: no bytes found at {path or 'the standard library'}.")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class ByteWindows(Dataset):
    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(f"ByteWindows: {data.numel()} bytes cannot fill one window of block_size={block_size}.")
        self.data, self.block_size = data, block_size
        self.n = (data.numel() - 1) // block_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return window[:-1], window[1:]


class ByteCorpusDataModule(LightningDataModule):
    """Args:
    path: a text file or folder of ``.py`` files; ``None``: the standard library.
    block_size: context length (must match the model's).
    batch_size: windows per rank per step.
    val_fraction: share of the bytes (from the end) held out for validation.
    max_bytes: use only the first ``max_bytes`` bytes of the corpus.
    val_windows: cap on validation windows (keeps validation short on CPU).
    num_workers: DataLoader workers.
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_bytes: int | None = None,
        val_windows: int | None = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"ByteCorpusDataModule: `val_fraction={val_fraction}` must be between 0 and 1.")
        self.save_hyperparameters()
        self.train_set: ByteWindows | None = None
        self.val_set: Dataset | None = None

    def setup(self, stage: str) -> None:
        h = self.hparams
        data = load_corpus(h.path, h.max_bytes)
        split = int(data.numel() * (1 - h.val_fraction))
        self.train_set = ByteWindows(data[:split], h.block_size)
        val = ByteWindows(data[split:], h.block_size)
        if h.val_windows is not None and len(val) > h.val_windows:
            val = torch.utils.data.Subset(val, range(h.val_windows))
        self.val_set = val

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.hparams.batch_size, shuffle=False, num_workers=self.hparams.num_workers)
