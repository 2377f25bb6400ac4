"""The data splits of the convergence benchmark: a held-out part of every file, and files dealt to
replicas by size (non-iid shards)."""

import pytest
import torch

from lightning_loco.examples.text import ByteTextDataModule, assign_files, join, split_each_file


def write(tmp_path, texts):
    paths = []
    for k, text in enumerate(texts):
        path = tmp_path / f"play{k}.txt"
        path.write_bytes(text)
        paths.append(str(path))
    return paths


def test_every_file_gives_its_tail_to_the_validation_set(tmp_path):
    files = write(tmp_path, [b"a" * 100, b"b" * 200])
    train, val = split_each_file(files, 0.1)
    assert [t.numel() for t in train] == [90, 180]
    assert bytes(val.tolist()) == b"a" * 10 + b"\n" + b"b" * 20
    assert bytes(join(train).tolist()) == b"a" * 90 + b"\n" + b"b" * 180


def test_per_file_holdout_in_the_data_module(tmp_path):
    files = write(tmp_path, [b"x" * 400, b"y" * 400])
    end = ByteTextDataModule(files=files, block_size=8, batch_size=2, val_fraction=0.25)
    per_file = ByteTextDataModule(files=files, block_size=8, batch_size=2, val_fraction=0.25, holdout="per_file")
    end.setup("fit")
    per_file.setup("fit")
    assert set(end.val_set.tokens.tolist()) == {ord("y")}  # the end of the text: the last file only
    assert set(per_file.val_set.tokens.tolist()) == {ord("x"), ord("y"), 10}  # every file
    with pytest.raises(ValueError, match="holdout"):
        ByteTextDataModule(files=files, holdout="middle")


def test_files_are_dealt_to_shards_by_size():
    sizes = [50, 10, 40, 30, 20, 60]
    groups = assign_files(sizes, 3)
    assert sorted(i for g in groups for i in g) == list(range(6))  # each file exactly once
    totals = [sum(sizes[i] for i in g) for g in groups]
    assert max(totals) - min(totals) <= 10
    assert assign_files(sizes, 3) == groups  # deterministic
    with pytest.raises(ValueError, match="non-empty"):
        assign_files([1, 2], 3)


def test_missing_or_empty_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        split_each_file([str(tmp_path / "nope.txt")], 0.1)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        split_each_file([str(tmp_path / "empty.txt")], 0.1)
    assert torch.is_tensor(join([torch.tensor([1])]))
