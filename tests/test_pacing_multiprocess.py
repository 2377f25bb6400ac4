"""Replicas of different speeds in real processes (``tests/tiny.py``, gloo, CPU) under ``sync_seconds``.

One replica is made slow: by sleeping in every step (real time), or on a clock of its own that moves
by a fixed step time per batch (so that every pacing decision, and hence a resumed run, is exact).
Every replica must run the same rounds and stop on the same one, whatever its number of steps. The
last tests need no processes: what a paced fit refuses before training, the monitor's fields, and the
example GPT's schedule under a paced strategy.
"""

import glob
import math

import lightning as L
import pytest
import torch

from lightning_loco import NoLoCoStrategy
from lightning_loco.rules import Facts, check_rules
from lightning_loco.trainer.setup import fit_facts

import tiny
from test_checkpoints import assert_same_tree


def rounds_of(record):
    return [(r["outer_step"], r["phase_steps"], r["final"]) for r in record["reports"]]


@pytest.mark.parametrize("algorithm", ["noloco", "diloco"])
def test_a_replica_that_sleeps_in_every_step_runs_the_same_rounds_with_fewer_steps(tmp_path, algorithm):
    H, max_steps = 10, 40  # four rounds
    kwargs = {"sync_every": H, "pacing": 0.3}
    # each rank on a clock of its own that moves by its step time at every batch (0.01 s and 0.1 s a step):
    # what a sleep in every step would do, without the machine's load in it
    recs = tiny.launch(tmp_path, strategy=algorithm, strategy_kwargs=kwargs, devices=2, max_steps=max_steps,
                       virtual_step_seconds=[0.01, 0.1])
    fast, slow = recs
    for rec in recs:
        assert [t for t, _, _ in rounds_of(rec)] == [0, 1, 2, 3]  # the same rounds, in order
        assert [final for _, _, final in rounds_of(rec)] == [False, False, False, True]  # the same last one
        assert rec["outer_states"][0]["outer_steps"] == 4
        assert all(1 <= h <= H for _, h, _ in rounds_of(rec))
        assert sum(h for _, h, _ in rounds_of(rec)) == rec["outer_states"][0]["inner_steps"] == len(rec["weights"])
    # a round is due after k steps once (k + 1/2)·s >= T: the fast replica reaches H = 10 first, the slow one
    # posts after 3 steps (3.5 × 0.1 s >= 0.3 s > 2.5 × 0.1 s)
    assert [h for _, h, _ in rounds_of(fast)] == [10, 10, 10, 10]
    assert [h for _, h, _ in rounds_of(slow)] == [3, 3, 3, 3]
    # the round that ended the run landed without the momentum on both: DiLoCo's replicas end identical
    if algorithm == "diloco":
        assert torch.equal(fast["weights"][-1], slow["weights"][-1])


@pytest.mark.parametrize("algorithm", ["noloco", "diloco"])
def test_a_standard_scheduler_follows_the_runs_progress_on_a_slow_replica(tmp_path, algorithm):
    """OneCycleLR over max_steps, stepped by Lightning every step, with one replica 10× slower (3 steps a
    round instead of 10): at every round both replicas' schedulers have taken t·H steps, so their learning
    rates agree there, and both end where a replica that never waited ends (the schedule's end)."""
    H, max_steps = 10, 40
    recs = tiny.launch(tmp_path, strategy=algorithm, strategy_kwargs={"sync_every": H, "pacing": 0.3}, devices=2,
                       max_steps=max_steps, virtual_step_seconds=[0.01, 0.1], scheduler="onecycle")
    fast, slow = recs
    assert [h for _, h, _ in rounds_of(fast)] == [10] * 4 and [h for _, h, _ in rounds_of(slow)] == [3] * 4
    reference = torch.optim.lr_scheduler.OneCycleLR(torch.optim.SGD([torch.zeros(1)], lr=0.05), max_lr=0.05,
                                                    total_steps=max_steps)
    at_rounds = []
    for _ in range(4):
        for _ in range(H):
            reference.step()
        at_rounds.append(reference.get_last_lr()[0])
    # the learning rate after each round's last step: t·H scheduler steps on both
    assert [fast["step_lrs"][H * (t + 1) - 1] for t in range(4)] == at_rounds
    assert [slow["step_lrs"][3 * (t + 1) - 1] for t in range(4)] == at_rounds
    assert fast["lrs"] == slow["lrs"] == [at_rounds[-1]]  # both end at the schedule's end
    # between rounds the slow replica's rate moves on with its nominal progress, 10/3 scheduler steps a step
    assert slow["step_lrs"][0] != fast["step_lrs"][0]


def test_auto_pacing_finds_t_from_the_replicas_step_times(tmp_path):
    """pacing="auto" in two processes, one replica twice as slow (0.02 s a step on its clock, against 0.01 s):
    the first round is H steps on both; once the replicas have read each other's step times from the run's
    store, T = H × 0.01 s and the slow one takes 5 steps a round (5.5 × 0.02 s ≥ 0.1 s > 4.5 × 0.02 s)."""
    H, max_steps = 10, 60
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": H, "pacing": "auto"}, devices=2,
                       max_steps=max_steps, virtual_step_seconds=[0.01, 0.02])
    fast, slow = ([h for _, h, _ in rounds_of(rec)] for rec in recs)
    assert fast[0] == slow[0] == H and fast == [H] * 6
    assert slow[2:] == [5] * 4
    for rec in recs:
        assert [t for t, _, _ in rounds_of(rec)] == list(range(6)) and rounds_of(rec)[-1][2]  # the same rounds


def test_exact_resume_from_a_round_checkpoint_with_replicas_at_different_steps(tmp_path):
    # Speeds 1 and 2 on their own clocks, T = 4, H = 4: H_i = 4 and 2. 16 nominal steps: 4 rounds. One batch
    # per epoch (24 of the 48 samples per replica) so that every checkpoint is at the end of a data epoch.
    ckpts = tmp_path / "ckpts"
    common = {"strategy": "gasloc", "strategy_kwargs": {"sync_every": 4, "pacing": 4.0}, "devices": 2,
              "max_steps": 16, "batch_size": 24, "virtual_step_seconds": [1.0, 2.0],
              "outer_checkpoint": {"dirpath": str(ckpts), "every_n_outer_steps": 2}}
    straight = tiny.launch(tmp_path / "straight", **common)
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["outer_step=2.ckpt", "outer_step=4.ckpt"]
    assert len(glob.glob(str(ckpts / ".replicas" / "outer_step=2.ckpt-*" / "replica-*.pt"))) == 2
    assert [h for _, h, _ in rounds_of(straight[0])] == [4, 4, 4, 4]
    assert [h for _, h, _ in rounds_of(straight[1])] == [2, 2, 2, 2]
    resumed = tiny.launch(tmp_path / "resumed", ckpt_path=str(ckpts / "outer_step=2.ckpt"), **common)
    for r, done in enumerate([8, 4]):  # each replica resumes at its own step (its own loops, from its file)
        assert len(straight[r]["weights"]) - len(resumed[r]["weights"]) == done
        for step, (a, b) in enumerate(zip(straight[r]["weights"][done:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, done + step)
        assert rounds_of(resumed[r]) == rounds_of(straight[r])[2:]
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")
        assert_same_tree(straight[r]["optimizer_states"], resumed[r]["optimizer_states"], "optimizer")
    assert not torch.equal(straight[0]["weights"][-1], straight[1]["weights"][0])


def test_a_round_paced_fit_that_saves_by_step_count_fails_before_training(tmp_path):
    proc = tiny.launch(tmp_path, expect_failure=True, strategy="noloco",
                       strategy_kwargs={"sync_every": 4, "pacing": 1.0}, devices=2, max_steps=8,
                       checkpoint={"dirpath": str(tmp_path / "ckpts"), "every_n_train_steps": 2})
    assert "pacing cannot run this fit: ModelCheckpoint saves by each replica's own step" in proc.stderr
    assert "OuterStepCheckpoint" in proc.stderr


def trainer(**kwargs):
    return L.Trainer(strategy=NoLoCoStrategy(sync_every=4, pacing=1.0), accelerator="cpu", devices=2,
                     logger=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize("kwargs,optimizers,match", [
    ({"max_steps": 8, "enable_checkpointing": False, "limit_val_batches": 0}, 2, "paces the rounds of one optimizer"),
    ({"max_epochs": 3, "enable_checkpointing": False, "limit_val_batches": 0}, 1, "set Trainer\\(max_steps=...\\)"),
    ({"max_steps": 8, "max_epochs": 3, "enable_checkpointing": False, "limit_val_batches": 0}, 1,
     "leave max_epochs unset"),
    ({"max_steps": 8, "limit_val_batches": 0}, 1, "ModelCheckpoint saves by each replica's own step or epoch count"),
    ({"max_steps": 8, "enable_checkpointing": False}, 1, "set limit_val_batches=0 and validate after fit"),
])
def test_what_a_round_paced_fit_cannot_do_is_named(kwargs, optimizers, match):
    def check(fit_trainer: L.Trainer, count: int) -> None:
        found = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0) for _ in range(count)]
        facts = fit_facts(fit_trainer, tiny.TinyRegressor(), found, torch.device("cpu"))
        check_rules("fit", Facts(fit_trainer.strategy.options, fit=facts))

    with pytest.raises(ValueError, match="pacing cannot run this fit: .*" + match):
        check(trainer(**kwargs), optimizers)
    check(trainer(max_steps=8, enable_checkpointing=False, limit_val_batches=0), 1)


def test_the_monitor_logs_each_rounds_steps_compute_and_share(tmp_path):
    # rank 0 (whose replica the logger writes) runs on a clock that moves 1 s a step, rank 1 2 s: H_i = 4 and 2
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": 4, "pacing": 4.0},
                       devices=2, max_steps=12, virtual_step_seconds=[1.0, 2.0], monitor={})
    from test_monitoring import logged

    metrics = logged(tmp_path)
    assert [v for _, v in metrics["outer/phase_steps"]] == [4, 4, 4]
    assert [s for s, _ in metrics["outer/phase_steps"]] == [4, 8, 12]  # at each round's own global step
    assert [v for _, v in metrics["outer/compute_seconds"]] == [4.0, 4.0, 4.0]
    assert all(v == 1.0 for _, v in metrics["outer/compute_share"])  # no time passes on this clock at an exchange
    assert [r["phase_steps"] for r in recs[1]["reports"]] == [2, 2, 2]


def test_report_fields_reach_the_monitors_metrics():
    from lightning_loco.driver.reports import OuterStepReport
    from lightning_loco.trainer.monitoring import OuterStepMonitor

    report = OuterStepReport(optimizer_index=0, outer_step=3, inner_step=8, peers=(2,), bytes_sent=4, bytes_received=4,
                             comm_seconds=0.1, seconds=0.2, phase_steps=5, compute_seconds=1.5, compute_share=0.75)
    metrics = OuterStepMonitor._metrics(report, num_optimizers=1)
    seen = (metrics["outer/phase_steps"], metrics["outer/compute_seconds"], metrics["outer/compute_share"])
    assert seen == (5, 1.5, 0.75)


def test_the_example_gpt_schedule_follows_nominal_progress_under_sync_seconds():
    from types import SimpleNamespace

    from lightning_loco.examples.gpt import GPT

    model = GPT(n_layer=1, n_embd=8, n_head=2, block_size=8, warmup_steps=10, max_steps=110)
    schedule = model.configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0]
    alone = [schedule(step) for step in (0, 5, 10, 60, 110)]
    model._trainer = SimpleNamespace(strategy=SimpleNamespace(nominal_step=None))  # fixed H: the step count
    assert [schedule(step) for step in (0, 5, 10, 60, 110)] == alone
    model._trainer.strategy.nominal_step = 60.0  # a paced run half-way, whatever this replica's own count
    assert schedule(3) == schedule(1000) == alone[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    model._trainer.strategy.nominal_step = 110.0
    assert schedule(3) == pytest.approx(0.1)  # the end of the run: lr/10 on every replica


@pytest.mark.slow
def test_the_ranks_of_a_replica_take_the_same_rounds_steps_and_learning_rates(tmp_path):
    # Two replicas of two ranks each (DDP inside a replica); one rank of replica 1 runs on a clock ten times
    # slower (its own clock, moved by its step time at every batch), which makes its whole replica slow. The
    # schedule follows nominal progress, read on each rank: the ranks of a replica must agree on their rounds,
    # their H_i and their learning rates, step by step.
    H, max_steps = 8, 32  # four rounds
    kwargs = {"sync_every": H, "pacing": 0.3, "ranks_per_replica": 2}
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs=kwargs, devices=4, max_steps=max_steps,
                       virtual_step_seconds=[0.01, 0.01, 0.01, 0.1], nominal_schedule=[H, max_steps])
    for rec in recs:
        assert [t for t, _, _ in rounds_of(rec)] == [0, 1, 2, 3]  # the same rounds everywhere
        assert [final for _, _, final in rounds_of(rec)] == [False, False, False, True]  # the same last one
        assert rec["outer_states"][0]["outer_steps"] == 4
    for a, b in ((0, 1), (2, 3)):  # the ranks of each replica
        assert rounds_of(recs[a]) == rounds_of(recs[b])  # the same H_i every round
        assert len(recs[a]["weights"]) == len(recs[b]["weights"])
        for step, (x, y) in enumerate(zip(recs[a]["weights"], recs[b]["weights"])):
            assert torch.equal(x, y), f"ranks {a} and {b} apart after step {step + 1}"
        assert recs[a]["lrs"] == recs[b]["lrs"]
    fast, slow = recs[0], recs[2]
    # the ranks of a replica agree on the slowest clock: replica 1 posts after 3 steps, replica 0 after H
    assert [h for _, h, _ in rounds_of(fast)] == [H] * 4
    assert [h for _, h, _ in rounds_of(slow)] == [3] * 4
    assert fast["lrs"] != [0.05]  # the schedule moved (the warm-up and decay ran on nominal steps)
