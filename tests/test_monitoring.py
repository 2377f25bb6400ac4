"""OuterStepMonitor in real multi-process runs: logged values against values recomputed from every
replica's recorded weights, and the consensus swap during validation."""

import csv
import dataclasses
import glob
from pathlib import Path

import pytest
import torch
import yaml

from lightning_loco.algorithms.schedules import random_groups
from lightning_loco.trainer.base import OuterStepReport
from lightning_loco.trainer.monitoring import OuterStepMonitor

import tiny


def tensorboard(logdir):
    """Scalars and text entries of a TensorBoard run folder, read as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})  # 0: keep every entry
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    texts = {tag.removesuffix("/text_summary"): [(e.step, make_ndarray(e.tensor_proto).item().decode())
                                                 for e in acc.Tensors(tag)]
             for tag in tags["tensors"] if tag.endswith("/text_summary")}
    return scalars, texts


def logged(tmp_path):
    with open(tmp_path / "out" / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and value != "":
                out.setdefault(key, []).append((int(row["step"]), float(value)))
    return out


@pytest.mark.slow
def test_outer_metrics_replica_spread_and_consensus_validation(tmp_path):
    h, steps, n = 2, 8, 4
    recs = tiny.launch(
        tmp_path, strategy="noloco", strategy_kwargs={"sync_every": h, "average_at_end": False}, devices=n,
        max_steps=steps, val_check_interval=4,
        monitor={"spread_every": 1, "consensus_validation": True, "mean_over_replicas": True},
        tensorboard=True,
        # saves at the end of each validation, where a consensus left in the model would leak into it;
        # the monitored value must reach callback_metrics
        checkpoint={"dirpath": str(tmp_path / "ckpts"), "filename": "{step}", "save_top_k": -1,
                    "monitor": "val/loss_consensus"},
    )
    # the monitor's values are equal on every rank already: Lightning has no reason to advise sync_dist
    assert "sync_dist=True" not in recs[0]["stderr"]
    metrics = logged(tmp_path)
    numel = recs[0]["outer_states"][0]["numel"]
    # at each outer step's own global step, and only there
    assert [s for s, _ in metrics["outer/step"]] == [2, 4, 6, 8]
    assert [v for _, v in metrics["outer/step"]] == [0, 1, 2, 3]
    assert all(v == 4 * numel for _, v in metrics["outer/bytes_sent"])
    # the peer is a name, not a quantity: text in TensorBoard (where a chart would smooth it), no scalar anywhere
    scalars, texts = tensorboard(tmp_path / "out" / "tb" / "version_0")
    assert "outer/peer" not in metrics and "outer/peer" not in scalars
    assert texts["outer/peer"] == [
        (2 * (t + 1), f"outer step {t}: replica 0 met replica {random_groups(n, 2, 0, t).peers_of(0)[0]}")
        for t in range(4)
    ]
    assert [s for s, _ in scalars["outer/step"]] == [2, 4, 6, 8]  # the quantities stay scalars
    assert "hp_metric" not in scalars  # no placeholder -1 card where the logger is configured as ours are
    # the spread is the RMS distance of the replicas from their mean, right after the outer step
    for step, value in metrics["outer/replica_spread"]:
        weights = torch.stack([rec["weights"][step - 1] for rec in recs]).double()
        expected = (weights - weights.mean(0)).pow(2).sum(1).mean().sqrt().item()
        assert value == pytest.approx(expected, rel=1e-5)
    # the update norm is how far rank 0's anchor moved: from the previous anchor (the anchor right after
    # the previous outer step, or the initial weights) to the new one
    anchors = [recs[0]["initial"]] + [recs[0]["anchors"][step - 1] for step, _ in metrics["outer/step"]]
    for t, (_, value) in enumerate(metrics["outer/update_norm"]):
        assert value == pytest.approx((anchors[t + 1] - anchors[t]).norm().item(), rel=1e-5)
    assert all(v > 0 for _, v in metrics["outer/pseudo_gradient_norm"])
    # validation: the replica metric is the module's synced val_loss; the consensus differs from it
    assert [v for _, v in metrics["val/loss_replicas"]] == pytest.approx([v for _, v in metrics["val_loss"]])
    assert len(metrics["val/loss_consensus"]) == 2
    assert metrics["val/loss_consensus"] != metrics["val/loss_replicas"]
    for rec in recs:
        # the consensus was swapped out again: every replica has its own weights back, bit for bit
        assert len(rec["before_validation"]) == 2
        for before, after in zip(rec["before_validation"], rec["after_validation"]):
            assert torch.equal(before, after)
    after = [rec["after_validation"][0] for rec in recs]
    assert not all(torch.equal(after[0], w) for w in after[1:])  # replicas differ (pair partners may agree)
    # a checkpoint written at that validation holds the replicas' own weights, not the consensus
    replica1 = torch.load(glob.glob(str(tmp_path / "ckpts" / ".replicas" / "step=4.ckpt-*" / "replica-00001.pt"))[0],
                          weights_only=True)
    module = tiny.TinyRegressor()
    module.load_state_dict(replica1["state_dict"])
    assert torch.equal(tiny.flat(module), recs[1]["after_validation"][0])


def test_bad_monitor_arguments():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="spread_every"):
            OuterStepMonitor(spread_every=bad)


def test_defaults_make_no_global_collective():
    monitor = OuterStepMonitor()
    assert monitor.spread_every == 0  # replica spread: two world all-reduces, opt-in
    assert monitor.consensus_validation is False  # a weight all-reduce per validation, opt-in
    assert monitor.mean_over_replicas is False  # val/loss_replicas: a global all-gather per validation, opt-in


def test_peer_distance_is_logged_when_the_strategy_provides_it():
    report = OuterStepReport(optimizer_index=1, outer_step=3, inner_step=8, peers=(2,), bytes_sent=4, bytes_received=4,
                             comm_seconds=0.1, seconds=0.2, peer_distance=0.25)
    assert OuterStepMonitor._metrics(report, num_optimizers=1)["outer/peer_distance"] == 0.25
    assert OuterStepMonitor._metrics(report, num_optimizers=2)["outer/peer_distance_opt1"] == 0.25
    report = dataclasses.replace(report, peer_distance=None)
    assert not any("peer_distance" in k for k in OuterStepMonitor._metrics(report, num_optimizers=1))


def test_peer_text_names_the_replicas_met():
    report = OuterStepReport(optimizer_index=0, outer_step=3, inner_step=8, peers=(2,), bytes_sent=4, bytes_received=4,
                             comm_seconds=0.1, seconds=0.2)
    assert OuterStepMonitor._peer_text(report, 0) == "outer step 3: replica 0 met replica 2"
    assert OuterStepMonitor._peer_text(dataclasses.replace(report, peers=(1, 3)), 2) == \
        "outer step 3: replica 2 met replicas 1, 3"
    assert OuterStepMonitor._peer_text(dataclasses.replace(report, peers=()), 1) == "outer step 3: replica 1 met nobody"
    elastic = dataclasses.replace(report, peers=(1,), peer_ids=("site-b",))  # the index moves with the membership
    assert OuterStepMonitor._peer_text(elastic, "site-a") == "outer step 3: replica site-a met replica site-b"
    alone = dataclasses.replace(elastic, peers=(1, 2), peer_ids=("site-b", "site-c"), alone=True)
    assert OuterStepMonitor._peer_text(alone, "site-a") == \
        "outer step 3: replica site-a met nobody (taken alone, without site-b, site-c)"
    assert not any("peer" in k and "distance" not in k for k in OuterStepMonitor._metrics(report, num_optimizers=1))


def test_example_configs_log_no_placeholder_hp_metric():
    """TensorBoardLogger logs hp_metric = -1 as the first card unless told not to."""
    configs = sorted((Path(__file__).parent.parent / "examples" / "shakespeare").glob("*.yaml"))
    assert configs
    for path in configs:
        logger = yaml.safe_load(path.read_text())["trainer"]["logger"]
        assert logger["class_path"].endswith("TensorBoardLogger"), path.name
        assert logger["init_args"]["default_hp_metric"] is False, path.name
