"""Training set-ups the outer step must get right: fp16 with a grad scaler that skips a step, BatchNorm
buffers in the consensus model, and an LR scheduler's state in the replica files.

Multi-process runs of ``tests/tiny.py`` (the ranks forked from one process).
"""

import glob

import pytest
import torch

import tiny

H = 3


def test_a_step_the_fp16_scaler_skips_still_counts_so_every_replica_meets_on_time(tmp_path):
    # Replica 1's loss overflows at step 1: its scaler skips that optimizer step (the weights do not
    # move) while replica 0 steps. Inner steps count optimizer_step calls, skipped or not, so both
    # replicas still start rounds after steps H and 2H; counting only real updates would leave
    # replica 1 one step behind and the pair waiting for each other.
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": H, "average_at_end": False},
                       devices=2, max_steps=2 * H, fp16_scaler=True, inf_loss_at=[1, 1])
    skipped = recs[1]["weights"]
    assert torch.equal(skipped[0], skipped[1])  # the overflowing step changed nothing on replica 1
    assert not torch.equal(recs[0]["weights"][0], recs[0]["weights"][1])
    for rec in recs:
        assert [(r["outer_step"], r["inner_step"]) for r in rec["reports"]] == [(0, H), (1, 2 * H)]
        assert rec["outer_states"][0]["inner_steps"] == 2 * H
        assert all(torch.isfinite(w).all() for w in rec["weights"])


def test_batchnorm_buffers_are_averaged_into_the_consensus_model(tmp_path):
    steps = 2 * H + 1
    checkpoint = {"dirpath": str(tmp_path), "filename": "end", "every_n_train_steps": steps}
    recs = tiny.launch(tmp_path, strategy="diloco", strategy_kwargs={"sync_every": H}, devices=2, max_steps=steps,
                       batchnorm=True, checkpoint=checkpoint)
    ckpt = tmp_path / "end.ckpt"  # written after the last step, before the end of fit averages the replicas
    own = [rec["buffers"] for rec in recs]  # at the end of training, before the strategy's average
    assert not torch.equal(own[0]["norm.running_mean"], own[1]["norm.running_mean"])  # buffers stay per replica
    ends = [torch.load(tmp_path / "out" / f"after_fit{r}.pt") for r in range(2)]
    for name in ("norm.running_mean", "norm.running_var"):
        mean = (own[0][name] + own[1][name]) / 2
        for end in ends:  # average_at_end: the consensus, buffers included, on every replica
            assert torch.allclose(end["buffers"][name], mean, atol=1e-6)
        main = torch.load(ckpt, weights_only=False)
        assert torch.allclose(main["state_dict"][name], mean, atol=1e-6)  # the main file holds it too


@pytest.mark.slow
def test_the_lr_scheduler_state_is_in_every_replica_file_and_resumes(tmp_path):
    ckpts = tmp_path / "ckpts"
    # saved after step 6, the end of a data epoch (Lightning restarts a plain DataLoader's epoch on resume)
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": 6, "save_top_k": -1}
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": 4}, "devices": 2, "max_steps": 12,
              "scheduler": True}
    straight = tiny.launch(tmp_path / "straight", checkpoint=checkpoint, **common)
    files = sorted(glob.glob(str(ckpts / ".replicas" / "step=6.ckpt-*" / "replica-*.pt")))
    assert len(files) == 2
    for path in files:
        (scheduler,) = torch.load(path, weights_only=True)["lr_schedulers"]
        assert scheduler["last_epoch"] == 6 and scheduler["_last_lr"] == [0.05 * 0.5**3]
    resumed = tiny.launch(tmp_path / "resumed", ckpt_path=str(ckpts / "step=6.ckpt"), **common)
    for a, b in zip(straight, resumed):
        assert a["lrs"] == b["lrs"] == [0.05 * 0.5**6]
        assert len(b["weights"]) == 6
        for x, y in zip(a["weights"][6:], b["weights"]):
            assert torch.equal(x, y)
