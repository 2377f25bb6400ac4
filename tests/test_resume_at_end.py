"""Resume is a no-op at the end: ``fit(ckpt_path=...)`` of a checkpoint taken when the run ended (at ``max_steps``,
by ``ModelCheckpoint`` before the end's average, or after ``fit`` returned) and ``fabric.load`` of one saved after
``finish()`` give bitwise the run's own final model (real processes, 3 or 4 replicas: with 2, NoLoCo's last round
already leaves every replica on the average and the difference would not show)."""

import test_fabric
import torch

import tiny

H = 3  # tiny's data on 4 ranks: 3 batches per replica and epoch


def after_fit(out, world=4):
    return [torch.load(out / "out" / f"after_fit{r}.pt")["weights"] for r in range(world)]


def test_fit_resumed_from_a_checkpoint_taken_at_max_steps_returns_the_runs_own_final_model(tmp_path):
    ckpts = tmp_path / "ckpts"
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": H}, "devices": 4, "max_steps": 2 * H,
              "checkpoint": {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": 2 * H,
                             "save_last": True}}
    tiny.launch(tmp_path / "run", save_to=str(tmp_path / "after_fit.ckpt"), **common)
    final = after_fit(tmp_path / "run")
    assert all(torch.equal(w, final[0]) for w in final)  # average_at_end: every replica on the average
    # at max_steps, before the end's average (ModelCheckpoint), and after fit returned (trainer.save_checkpoint)
    for name, ckpt in (("last", "last"), ("saved_after_fit", str(tmp_path / "after_fit.ckpt"))):
        out = tmp_path / name
        proc = tiny.run_forked(out / "out", {**common, "ckpt_path": ckpt}, timeout=240)  # takes no step
        assert proc.returncode == 0, proc.stderr[-3000:]
        for r, weights in enumerate(after_fit(out)):
            assert torch.equal(weights, final[r]), (name, r, (weights - final[r]).abs().max())
    main = tiny.flat(tiny.TinyRegressor.load_from_checkpoint(ckpts / "last.ckpt"))
    assert torch.equal(main, final[0])  # the main file is that same model


def test_a_fabric_run_loaded_after_finish_ends_on_its_own_final_model(tmp_path):
    checkpoint = tmp_path / "ckpt" / "end.ckpt"  # saved at STEPS, after the last step's own finish()
    config = {"name": "noloco", "world": 3, "finish": True, "count": True}
    whole = test_fabric.run(tmp_path, "fabric", save_at=test_fabric.STEPS, checkpoint=str(checkpoint), **config)
    resumed = test_fabric.run(tmp_path / "again", "fabric", resume=str(checkpoint), **config)
    for rank in range(3):
        assert resumed[rank]["finished"] and resumed[rank]["outer_steps"] == 0
        assert torch.equal(resumed[rank]["final"], whole[rank]["final"]), rank
        assert resumed[rank]["finish_calls"] == []  # the checkpoint holds the average already: not taken again
