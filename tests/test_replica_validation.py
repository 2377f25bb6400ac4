"""Validation without global coupling (real processes): ``ReplicaValidation`` keeps ``sync_dist``, torchmetrics
objects and our ``OuterStepMonitor`` within each replica, and global rank 0's replica decides what must agree
(``ModelCheckpoint``'s choice and name, ``EarlyStopping``'s stop), counted as ``benchmarks/validation_sync.py``
counts them for docs/metrics.md's table."""

import pytest

from benchmarks import validation_sync
from lightning_loco.trainer.monitoring import OuterStepMonitor

import tiny


@pytest.mark.parametrize("feature", ["sync_dist", "torchmetrics", "OuterStepMonitor"])
def test_what_synchronised_every_replica_issues_no_collective_in_replica_mode(tmp_path, feature):
    counted = {mode: validation_sync.measure((feature,), mode, 2, 1, tmp_path) for mode in ("global", "replica")}
    assert counted["global"]["global_barriers"] >= 1  # Lightning's default: every replica waits for the slowest
    assert counted["replica"]["per_validation"] == {}  # one rank per replica: no message at all


def test_the_decisions_cost_one_small_broadcast_per_validation_and_saves_no_more_than_before(tmp_path):
    early = validation_sync.measure(("EarlyStopping",), "replica", 2, 1, tmp_path)
    assert early["per_validation"] == {"global:broadcast_object_list": 1.0}  # rank 0's metrics; then local decisions
    both = validation_sync.measure(("ModelCheckpoint", "EarlyStopping"), "replica", 2, 1, tmp_path)
    saving = validation_sync.measure(("ModelCheckpoint",), "replica", 2, 1, tmp_path)
    # the two callbacks' decisions (top k, file names, whether a file exists, the stop) share that one message: the
    # rest is the saves' own (the save id's broadcast, the consensus all-reduce, the barriers)
    assert both["per_validation"] == saving["per_validation"]
    assert saving["per_validation"].get("global:broadcast", 0) == 0
    everything = {mode: validation_sync.measure(validation_sync.FEATURES, mode, 2, 1, tmp_path)
                  for mode in ("global", "replica")}
    assert "global:all_gather" not in everything["replica"]["per_validation"]
    assert everything["replica"]["global_barriers"] < everything["global"]["global_barriers"]
    assert everything["replica"]["global"] < everything["global"]["global"]


def test_every_rank_decides_from_replica_0s_metrics_when_the_replicas_disagree(tmp_path):
    """Four replicas whose validation losses differ, top 2 of 4 validations: at the third, replica 0's loss enters the
    top 2 and others' do not. Every rank must save (or not) as rank 0 does, or the saves' collectives mismatch (the
    run failed so before the metrics Lightning's callbacks read, rebuilt at every read, became replica 0's)."""
    counted = validation_sync.measure(("ModelCheckpoint", "EarlyStopping"), "replica", 4, 1, tmp_path, validations=4)
    assert counted["per_validation"]["global:broadcast_object_list"] == 3.0  # the decisions' one, and two saves' ids
    assert "global:broadcast" not in counted["per_validation"]


def test_each_replica_logs_its_own_validation_and_rank_0s_replica_decides(tmp_path):
    checkpoint = {"dirpath": str(tmp_path / "ckpts"), "monitor": "val_loss", "save_top_k": 1,
                  "filename": "{step}-{val_loss:.4f}"}
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": 2, "ranks_per_replica": 2},
                       devices=4, max_steps=9, val_check_interval=3, replica_validation=True, checkpoint=checkpoint,
                       early_stopping={"monitor": "val_loss", "patience": 1000, "check_on_train_epoch_end": False})
    losses = [rec["val_losses"] for rec in recs]
    assert len(losses[0]) == 3
    assert losses[0] == losses[1] and losses[2] == losses[3]  # sync_dist=True: reduced within each replica
    assert losses[0] != losses[2]  # each replica its own validation, on its own share of the data
    assert all(rec["val_losses_read"] == losses[0] for rec in recs)  # the callbacks of every rank read replica 0's
    assert len({rec["best_model_path"] for rec in recs}) == 1  # rank 0's choice and name on every rank
    best = min(range(3), key=lambda i: losses[0][i])
    assert f"val_loss={losses[0][best]:.4f}" in recs[0]["best_model_path"]  # ranked by replica 0's val_loss


def test_early_stopping_stops_every_replica_on_rank_0s_decision(tmp_path):
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": 2}, devices=2, max_steps=12,
                       val_check_interval=3, replica_validation=True, val_sync_dist=False,
                       early_stopping={"monitor": "val_loss", "stopping_threshold": 1e9,
                                       "check_on_train_epoch_end": False})
    assert [len(rec["weights"]) for rec in recs] == [3, 3]  # the first validation stops both replicas


def test_the_monitor_logs_each_replicas_own_loss_unless_asked_for_the_mean():
    assert OuterStepMonitor().mean_over_replicas is False  # val/loss_replicas: a global all-gather, opt-in
