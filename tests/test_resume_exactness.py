"""Which resumes are exact, as docs/checkpoints.md states them, against plain DDP under the same Lightning loops
(real processes, tiny's data: 6 batches per replica and epoch on 2 ranks).

* At an epoch's end, whether ``ModelCheckpoint`` saves on the epoch's last batch (``every_n_train_steps``) or at
  the epoch's end (``save_on_train_epoch_end``): every step after the resume equals the uninterrupted run's, under
  NoLoCo as under DDP (the outer state resumes mid-round: H = 4 does not divide 6).
* In the middle of an epoch, with a DataLoader that is not resumable: Lightning restarts that epoch's data and
  warns, and the run goes on from there, differing from the uninterrupted run, under DDP as under NoLoCo.
"""

import pytest
import torch

import tiny

BATCHES = 6


def run(tmp_path, strategy, checkpoint, ckpt_path=None):
    config = {"strategy": strategy, "devices": 2, "max_steps": -1, "max_epochs": 3, "start_method": "popen",
              "checkpoint": {"dirpath": str(tmp_path / "ckpts"), "filename": "{step}", "save_top_k": -1,
                             **checkpoint}}
    if strategy != "ddp":
        config["strategy_kwargs"] = {"sync_every": 4}
    if ckpt_path is not None:
        config["ckpt_path"] = str(tmp_path.parent / "straight" / "ckpts" / ckpt_path)
    return tiny.launch(tmp_path, **config)


def same_steps(straight, resumed, saved_at):
    return [all(torch.equal(a, b) for a, b in zip(s["weights"][saved_at:], r["weights"]))
            for s, r in zip(straight, resumed)]


@pytest.mark.parametrize("strategy", ["ddp", "noloco"])
@pytest.mark.parametrize("checkpoint", [{"every_n_train_steps": 3}, {"every_n_epochs": 1,
                                                                      "save_on_train_epoch_end": True}],
                         ids=["last-batch", "epoch-end"])
def test_epoch_end_checkpoints_resume_exactly_and_mid_epoch_ones_restart_the_epochs_data(tmp_path, strategy,
                                                                                       checkpoint):
    straight = run(tmp_path / "straight", strategy, checkpoint)
    assert len(straight[0]["weights"]) == 3 * BATCHES
    at_end = run(tmp_path / "end", strategy, checkpoint, ckpt_path=f"step={BATCHES}.ckpt")
    assert len(at_end[0]["weights"]) == 2 * BATCHES
    assert same_steps(straight, at_end, BATCHES) == [True, True]
    assert "ended before the epoch ended" not in at_end[0]["stderr"]
    if "every_n_train_steps" in checkpoint:  # a checkpoint at step 3, mid-epoch
        mid = run(tmp_path / "mid", strategy, checkpoint, ckpt_path="step=3.ckpt")
        assert "ended before the epoch ended and your dataloader is not resumable" in mid[0]["stderr"]
        assert same_steps(straight, mid, 3) == [False, False]
