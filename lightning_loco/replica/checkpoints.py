"""Checkpoints that keep every replica.

Under NoLoCo and GASLoC every replica holds different weights, inner optimizer state and outer
state; Lightning alone would write rank 0's and drop the rest. Our strategies write:

* ``<dir>/<name>.ckpt`` — an ordinary Lightning checkpoint whose ``state_dict`` is the **consensus
  model** (the average of the replicas), so ``MyModule.load_from_checkpoint(path)`` and
  ``ModelCheckpoint.best_model_path`` work as usual. Its loops and callback states are rank 0's, and
  a ``"lightning_loco"`` entry points to the replica files.
* ``<dir>/.replicas/<name>.ckpt-<save id>/replica-<k>.pt`` — one file per replica: its own weights,
  inner optimizer and LR-scheduler states, and outer state with the step counters. Tensors and plain
  values only, so they load with ``torch.load(weights_only=True)``. With FSDP2 inside the replicas
  (``replica_sharding="fsdp"``) each rank writes its own shards, ``replica-<k>-shard-<j>.pt``, and the
  main file's consensus model is full (unsharded) while its inner optimizer state is left empty.
* ``<dir>/.replicas/<name>.ckpt-<save id>/save.json`` — written once every replica file of the save
  exists, before the main file: it marks the save complete and records its global step, so that
  ``ckpt_path="last"`` can tell a ``last.ckpt`` whose newer save was interrupted (see
  :func:`newer_complete_checkpoint`).

A save is atomic from the reader's point of view: replica files go into a folder with a fresh name,
and the main file is written last (Lightning's checkpoint IO replaces it in one step). A save killed
half-way leaves either the previous checkpoint, intact, or no checkpoint at that path, plus an
orphan replica folder that the next save at that path removes.

Every file goes through the fsspec filesystem that Lightning's checkpoint IO uses for the main file
(``fsspec.core.url_to_fs``, as ``lightning.fabric.utilities.cloud_io.get_filesystem``): local
paths, ``file://``, ``s3://``, ``gs://``, ``memory://``... All ranks must see the same storage
(Lightning assumes the same for ``ckpt_path``).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import pickle
import posixpath
import re
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

FORMAT_VERSION = 1
META_KEY = "lightning_loco"
SIDECAR_ROOT = ".replicas"
MANIFEST = "save.json"


class CheckpointError(RuntimeError):
    """A checkpoint of ours that cannot be used as it is. The message names the file and what to do."""


def storage(path: Any) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of a path or URL (the one Lightning's checkpoint IO writes the main file
    with) and the path within it: absolute and ``/``-separated, without the protocol."""
    return url_to_fs(str(os.fspath(path)))


def _location(fs: AbstractFileSystem, inner: str) -> str:
    """A path within ``fs`` as a path or URL that :func:`storage` maps back to it (local paths stay plain)."""
    return inner if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(inner)


def sidecar_name(filepath: Any, save_id: str) -> str:
    """The replica folder of a save, relative to the main file's folder."""
    return posixpath.join(SIDECAR_ROOT, f"{posixpath.basename(storage(filepath)[1])}-{save_id}")


def replica_file(sidecar_dir: str, replica: int, shard: Optional[int] = None) -> str:
    """One replica's file, or with ``shard`` the file of one rank of a sharded replica."""
    if shard is None:
        return posixpath.join(sidecar_dir, f"replica-{replica:05d}.pt")
    return posixpath.join(sidecar_dir, f"replica-{replica:05d}-shard-{shard:05d}.pt")


def _shards(meta: Mapping[str, Any]) -> list[Optional[int]]:
    """The shard indices of each replica's files: ``[None]`` for one file per replica."""
    return list(range(meta["shards"])) if meta.get("shards") else [None]


def resolve_sidecar(filepath: Any, meta: Mapping[str, Any]) -> str:
    """The replica folder a main file points to (links such as ``save_last="link"`` are followed)."""
    fs, inner = storage(filepath)
    if isinstance(fs, LocalFileSystem):
        inner = os.path.realpath(inner)
    return _location(fs, posixpath.join(posixpath.dirname(inner), meta["replicas"]))


def _write_atomically(fs: AbstractFileSystem, path: str, write: Callable[[Any], None]) -> None:
    """Writes a file under a temporary name, then renames it into place: readers never see half a file."""
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    partial = path + ".partial"
    with fs.open(partial, "wb") as f:
        write(f)
    fs.mv(partial, path)


def write_replica(sidecar_dir: str, replica: int, payload: dict[str, Any], shard: Optional[int] = None) -> str:
    """Writes one replica's file (or one shard's) under a temporary name, then renames it into place."""
    fs, folder = storage(sidecar_dir)
    final = replica_file(folder, replica, shard)
    _write_atomically(fs, final, lambda f: torch.save(payload, f))
    return _location(fs, final)


def remove_sidecars(filepath: Any, keep: Optional[str] = None) -> None:
    """Removes the replica folders of ``filepath`` (all saves at that path) except ``keep``."""
    fs, inner = storage(filepath)
    root = posixpath.join(posixpath.dirname(inner), SIDECAR_ROOT)
    prefix = posixpath.basename(inner) + "-"
    kept = posixpath.normpath(storage(keep)[1]) if keep is not None else None
    for folder in _folders(fs, root):
        if posixpath.basename(folder).startswith(prefix) and folder != kept:
            try:
                fs.rm(folder, recursive=True)
            except OSError:
                pass  # removed by someone else, or not ours to remove
    try:
        if fs.isdir(root) and not fs.ls(root, detail=False):
            fs.rmdir(root)
    except OSError:
        pass


def _folders(fs: AbstractFileSystem, root: str) -> list[str]:
    """The folders directly inside ``root`` (none when it does not exist)."""
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [posixpath.normpath(e["name"]) for e in entries if e["type"] == "directory"]


def read_replica(filepath: Any, meta: Mapping[str, Any], replica: int, shard: Optional[int] = None) -> dict[str, Any]:
    """Loads replica ``replica``'s file (shard ``shard``'s of a sharded replica) of the checkpoint
    ``filepath``, with errors that say what to do."""
    path = replica_file(resolve_sidecar(filepath, meta), replica, shard)
    fs, inner = storage(path)
    advice = (
        "The checkpoint is incomplete: restore that file, resume from another checkpoint, or start a new "
        f"run from the consensus model (`MyModule.load_from_checkpoint({str(filepath)!r})`, then fit without "
        "ckpt_path)."
    )
    if not fs.isfile(inner):
        raise CheckpointError(f"Replica file missing: {path} (replica {replica} of checkpoint {filepath}). {advice}")
    try:
        with fs.open(inner, "rb") as f:
            payload = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file
        raise CheckpointError(f"Replica file unreadable: {path} ({type(err).__name__}: {err}). {advice}") from err
    found = (payload.get("save_id"), payload.get("replica"), payload.get("shard"))
    if found != (meta.get("save_id"), replica, shard):
        raise CheckpointError(
            f"Replica file {path} belongs to another save (save id {payload.get('save_id')!r}, replica "
            f"{payload.get('replica')!r}; expected {meta.get('save_id')!r}, {replica}). {advice}"
        )
    return payload


def _missing_replica_files(fs: AbstractFileSystem, sidecar: str, num_replicas: int,
                           shards: Optional[int] = None) -> list[str]:
    files = [replica_file(sidecar, k, j) for k in range(num_replicas) for j in _shards({"shards": shards})]
    return [f for f in files if not fs.isfile(f)]


def check_replica_files(filepath: Any, meta: Mapping[str, Any]) -> None:
    """Raises if any replica file of the checkpoint is missing (cheap; every rank can check all)."""
    fs, sidecar = storage(resolve_sidecar(filepath, meta))
    missing = [_location(fs, p) for p in _missing_replica_files(fs, sidecar, meta["num_replicas"], meta.get("shards"))]
    if missing:
        raise CheckpointError(
            f"Checkpoint {filepath} is incomplete: {len(missing)} replica file(s) missing, e.g. {missing[0]}. "
            "Restore them, resume from another checkpoint, or start a new run from the consensus model "
            f"(`MyModule.load_from_checkpoint({str(filepath)!r})`, then fit without ckpt_path)."
        )


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint holds pickled objects beyond tensors and plain values: loading it would run code
    from the file."""


def _safe_checkpoint_types() -> list[Any]:
    """Types found in ordinary Lightning checkpoints besides tensors and plain values: Lightning saves
    hyper-parameters and callback states as plain dicts, whose values may be paths or durations.
    Each of these only rebuilds a value."""
    return [pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath,
            datetime.timedelta]


def _load_for_export(path: Any, trust_checkpoint: bool = False) -> dict[str, Any]:
    """Loads a checkpoint file with ``weights_only=True`` (plus ``_safe_checkpoint_types``), or with
    full unpickling when ``trust_checkpoint`` is set."""
    fs, inner = storage(path)
    try:
        with fs.open(inner, "rb") as f:
            if trust_checkpoint:
                return torch.load(f, map_location="cpu", weights_only=False)
            with torch.serialization.safe_globals(_safe_checkpoint_types()):
                return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err)) or re.search(
            r"WeightsUnpickler error:\s*(.+)", str(err)
        )
        what = f" ({found.group(1).strip()})" if found else ""
        raise UntrustedCheckpointError(
            f"{path} holds a pickled Python object that is not a tensor or a plain value{what}; loading it "
            "would run code from the file. If you trust where the file comes from, pass --trust-checkpoint "
            "(export_consensus(..., trust_checkpoint=True))."
        ) from None


def export_consensus(
    checkpoint_path: Any, output_path: Any, state_dict_only: bool = False, trust_checkpoint: bool = False
) -> str:
    """Writes the consensus model of a checkpoint as one plain file for inference.

    Args:
        checkpoint_path: a checkpoint written by one of our strategies (or any Lightning checkpoint).
        output_path: the file to write.
        state_dict_only: write just the model's ``state_dict`` (for ``module.load_state_dict``); by
            default a Lightning checkpoint without training state, which loads with
            ``MyModule.load_from_checkpoint(output_path)``.
        trust_checkpoint: unpickle whatever the file holds (``weights_only=False``): this runs code
            from the file. By default only tensors, plain values and the few types of ordinary
            Lightning checkpoints are loaded, and anything else raises ``UntrustedCheckpointError``.

    Neither output needs replica files; both load with ``torch.load(weights_only=True)`` as long as
    the module's saved hyper-parameters are plain values.
    """
    checkpoint = _load_for_export(checkpoint_path, trust_checkpoint)
    if state_dict_only:
        out: dict[str, Any] = checkpoint["state_dict"]
    else:
        keep = ("state_dict", "hyper_parameters", "hparams_name", "pytorch-lightning_version", "epoch", "global_step")
        out = {k: checkpoint[k] for k in keep if k in checkpoint}
    fs, inner = storage(output_path)
    _write_atomically(fs, inner, lambda f: torch.save(out, f))
    return str(os.fspath(output_path)).removeprefix("file://")


# ---------------------------------------------------------------- what the strategies save and load


def sidecar_dir(filepath: Any, save_id: str) -> str:
    """The replica folder of a save: an absolute path, or a URL on remote storage."""
    fs, inner = storage(filepath)
    return _location(fs, posixpath.join(posixpath.dirname(inner), sidecar_name(filepath, save_id)))


def main_meta(filepath: Any, save_id: str, algorithm: str, num_replicas: int,
              shards: Optional[int] = None) -> dict[str, Any]:
    """The ``"lightning_loco"`` entry of a main file: it points to the replica folder (``shards``: the
    ranks of each sharded replica, one file each)."""
    meta = {
        "format": FORMAT_VERSION, "algorithm": algorithm, "num_replicas": num_replicas, "save_id": save_id,
        "replicas": sidecar_name(filepath, save_id),
    }
    if shards is not None:
        meta["shards"] = shards
    return meta


def replica_payload(
    checkpoint: Mapping[str, Any], save_id: str, replica: int, num_replicas: int, algorithm: str,
    outer: list[dict[str, Any]],
) -> dict[str, Any]:
    """One replica's file: its weights, inner optimizer and LR-scheduler states, and its outer state
    (per optimizer: counters, the algorithm's state, a round in flight with its received sum)."""
    return {
        "format": FORMAT_VERSION, "save_id": save_id, "replica": replica, "num_replicas": num_replicas,
        "algorithm": algorithm, "state_dict": checkpoint["state_dict"],
        "optimizer_states": checkpoint.get("optimizer_states"), "lr_schedulers": checkpoint.get("lr_schedulers"),
        "outer": outer,
    }


def read_own_replica(
    checkpoint: Mapping[str, Any], filepath: str, replica: int, num_replicas: int, algorithm: str,
    agree: Callable[[Optional[str]], Optional[str]], shard: Optional[int] = None, shards: Optional[int] = None,
) -> Optional[dict[str, Any]]:
    """This replica's file of the loaded main file ``checkpoint``, or ``None`` when every replica
    starts from the main file's consensus model (a plain Lightning checkpoint, or one written with
    another number of replicas, which warns).

    ``agree`` is called on every rank with this rank's error message (or ``None``) and returns the
    first rank's: every rank then raises the same :class:`CheckpointError`, even when ranks see
    different files (a shared filesystem that lags on one node), and nobody is left waiting.

    ``shard`` and ``shards``: this rank's index in its sharded replica and the replica's ranks
    (``None``: replicas hold whole models); the checkpoint must have been sharded alike."""
    meta = checkpoint.get(META_KEY)
    if meta is None:
        return None
    if meta["num_replicas"] != num_replicas:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            f"Checkpoint {filepath} holds {meta['num_replicas']} replicas but this run has {num_replicas}: "
            "every replica starts from the consensus model (the replicas' average) with fresh outer state"
            + (" and fresh inner optimizer state (a sharded checkpoint keeps it in the replica files only)."
               if meta.get("shards") else ".")
        )
        return None
    if meta.get("shards") != shards:
        def how(n: Optional[int]) -> str:
            return f"replica_sharding='fsdp' over {n} rank(s) per replica" if n else "no replica_sharding"

        raise CheckpointError(
            f"Checkpoint {filepath} was written with {how(meta.get('shards'))}; this run uses {how(shards)}. Resume "
            "with the same replica_sharding and ranks_per_replica, or start a new run from its consensus model: "
            f"`MyModule.load_from_checkpoint({filepath!r})`, then fit without ckpt_path."
        )
    if meta["algorithm"] != algorithm:
        raise CheckpointError(
            f"Checkpoint {filepath} was written by {meta['algorithm']!r}; its outer state does not fit "
            f"{algorithm!r}. Resume it with the {meta['algorithm']!r} strategy, or start a new "
            f"{algorithm!r} run from its consensus model: "
            f"`MyModule.load_from_checkpoint({filepath!r})`, then fit without ckpt_path."
        )
    payload: Optional[dict[str, Any]] = None
    error: Optional[CheckpointError] = None
    try:
        check_replica_files(filepath, meta)  # every rank checks every file
        payload = read_replica(filepath, meta, replica, shard)
    except CheckpointError as err:
        error = err
    message = agree(str(error) if error is not None else None)
    if message is not None:
        raise CheckpointError(message) from error
    return payload


# ---------------------------------------------------------------- complete saves, and "last"


def write_manifest(sidecar_dir: str, filepath: Any, checkpoint: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Marks a save complete: call it once every replica file of the save exists, before the main
    file is written. It records which main file the save belongs to and its global step."""
    fs, folder = storage(sidecar_dir)
    record = {
        "format": FORMAT_VERSION, "complete": True, "checkpoint": posixpath.basename(storage(filepath)[1]),
        "save_id": meta["save_id"], "num_replicas": meta["num_replicas"], "algorithm": meta["algorithm"],
        "global_step": int(checkpoint.get("global_step", -1)), "epoch": int(checkpoint.get("epoch", -1)),
        "shards": meta.get("shards"),
    }
    _write_atomically(fs, posixpath.join(folder, MANIFEST), lambda f: f.write(json.dumps(record).encode()))


def _read_manifest(fs: AbstractFileSystem, folder: str) -> Optional[dict[str, Any]]:
    """The manifest of a replica folder, or ``None`` when the save did not complete (or predates manifests)."""
    try:
        with fs.open(posixpath.join(folder, MANIFEST), "rb") as f:
            record = json.loads(f.read().decode())
        if record.get("complete") is True and isinstance(record.get("global_step"), int):
            return record
    except (OSError, ValueError):
        pass
    return None


def newer_complete_checkpoint(filepath: Any, global_step: int) -> Optional[tuple[str, int]]:
    """A complete checkpoint that is further along than ``filepath``, a "last" checkpoint at
    ``global_step``, or ``None``.

    ``ModelCheckpoint`` writes ``last.ckpt`` after the step's other checkpoints; when that write is
    interrupted (a signal, a crash) the previous ``last.ckpt`` stays, and Lightning's
    ``ckpt_path="last"`` resumes from it although a newer checkpoint is complete. This looks in the
    folder of ``filepath`` for saves whose manifest says complete, whose replica files all exist, whose
    main file is there and was written no earlier than ``filepath`` (older files are left over from an
    earlier run, or from the run's other branch), at a larger global step. Returns the path or URL
    of the main file with the largest step (the newest among equals) and that step.
    """
    fs, inner = storage(filepath)
    folder = posixpath.dirname(inner)
    try:
        since = fs.modified(inner)
    except (NotImplementedError, OSError):
        return None  # storage without modification times: Lightning cannot rank "last" files there either
    found = []
    for sidecar in _folders(fs, posixpath.join(folder, SIDECAR_ROOT)):
        record = _read_manifest(fs, sidecar)
        if record is None or record["global_step"] <= global_step or record["checkpoint"] == posixpath.basename(inner):
            continue
        main = posixpath.join(folder, record["checkpoint"])
        try:
            written = fs.modified(main)
        except (NotImplementedError, OSError):
            continue  # its main file was never written (or was removed)
        if written >= since and not _missing_replica_files(fs, sidecar, record["num_replicas"], record.get("shards")):
            found.append((record["global_step"], written, main))
    if not found:
        return None
    step, _, main = max(found)
    return _location(fs, main), step
