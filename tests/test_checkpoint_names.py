"""Checkpoint names agreed across the replicas: a file-name template with a metric that differs between
replicas still gives one name per save, whose main file and replica files meet (real processes).

Each replica validates on its own shard and logs ``val_loss`` without ``sync_dist``, so every rank would format
its own ``{epoch}-{val_loss:.4f}`` name. The save is named after global rank 0's, and every rank's
``ModelCheckpoint`` takes rank 0's bookkeeping (best and k-th best paths) with it.
"""

import json
import os

import pytest
import torch

from lightning_loco.replica import checkpoints

import tiny

BATCHES = 6  # tiny's data: 6 batches per replica and epoch on 2 ranks


def main_files(ckpts):
    return sorted(f for f in os.listdir(ckpts) if f.endswith(".ckpt"))


def test_a_metric_in_the_file_name_gives_one_name_per_save_and_every_save_resumes(tmp_path):
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{epoch}-{val_loss:.4f}", "monitor": "val_loss",
                  "save_top_k": 2, "save_last": True}
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": 3}, "devices": 2, "val_sync_dist": False,
              "val_check_interval": BATCHES, "checkpoint": checkpoint}
    recs = tiny.launch(tmp_path / "run", max_steps=4 * BATCHES, **common)

    # the replicas' own validation losses differ, so their ranks would format different names
    assert recs[0]["best_model_path"] == recs[1]["best_model_path"]  # rank 0's bookkeeping on every rank
    best = recs[0]["best_model_path"]
    names = main_files(ckpts)
    assert len(names) == 3 and "last.ckpt" in names and os.path.basename(best) in names  # save_top_k=2, and last

    # one complete replica folder per main file: no orphans left by names that differ, or by save_top_k's deletions
    folders = os.listdir(ckpts / ".replicas")
    manifests = [json.loads((ckpts / ".replicas" / f / "save.json").read_text()) for f in folders]
    assert sorted(m["checkpoint"] for m in manifests) == names
    for folder, manifest in zip(folders, manifests):
        assert manifest["complete"] is True
        assert folder.startswith(manifest["checkpoint"] + "-")
        assert sorted(os.listdir(ckpts / ".replicas" / folder)) == ["replica-00000.pt", "replica-00001.pt",
                                                                    "save.json"]
        main = torch.load(ckpts / manifest["checkpoint"], weights_only=False)
        checkpoints.check_replica_files(ckpts / manifest["checkpoint"], main[checkpoints.META_KEY])

    # both the best and the last resume
    more = {**common, "checkpoint": {**checkpoint, "dirpath": str(tmp_path / "more")}}
    for name, path in (("best", best), ("last", str(ckpts / "last.ckpt"))):
        resumed = tiny.launch(tmp_path / name, max_steps=5 * BATCHES, ckpt_path=path, **more)
        saved = torch.load(path, weights_only=False)["global_step"]
        assert len(resumed[0]["weights"]) == 5 * BATCHES - saved


def test_a_save_whose_folder_lacks_a_replica_file_is_removed_and_never_marked_complete(tmp_path):
    from lightning_loco.replica.replica import _complete_or_removed

    path = tmp_path / "epoch=1-val_loss=0.5.ckpt"
    meta = checkpoints.main_meta(path, "abc", "noloco", 2)
    folder = checkpoints.sidecar_dir(path, "abc")
    checkpoints.write_replica(folder, 0, {"save_id": "abc", "replica": 0})  # replica 1's file never came
    with pytest.raises(checkpoints.CheckpointError, match="could not complete.*removed.*1 replica file"):
        _complete_or_removed(path, meta, folder)
    assert not os.path.exists(folder) and not path.exists()
