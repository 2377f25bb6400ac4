"""The training simulator on an ordinary LightningModule: the user's own ``training_step`` (logging,
torchmetrics, ``self.lr_schedulers()``), its ``configure_optimizers`` (AdamW with a warm-up and cosine
schedule that reads ``self.trainer.max_steps``), gradient accumulation, clipping and bf16-mixed, with
no ``loss=`` function; and the batched path's fallback to the loop."""

from __future__ import annotations

import copy
import math
import warnings

import lightning as L
import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_loco.algorithms import NoLoCo
from lightning_loco.simulator import TrainingSimulator, distributed_shards

import tiny

FALLBACK = "batched path is not available"


def classes(samples: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(samples, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    """What a new user writes: nothing in it knows of the simulator."""

    def __init__(self, warmup: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.warmup = warmup

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.train_acc(logits.argmax(-1), y)
        self.log("train_acc", self.train_acc, prog_bar=True)
        self.log_dict({"train_loss": loss, "lr": self.lr_schedulers().get_last_lr()[0],
                       "seen_step": float(self.global_step)})
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        total = self.trainer.max_steps

        def factor(step: int) -> float:
            if step < self.warmup:
                return (step + 1) / self.warmup
            return 0.5 * (1 + math.cos(math.pi * (step - self.warmup) / max(1, total - self.warmup)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LoggingRegressor(tiny.TinyRegressor):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log_dict({"batch_idx": float(batch_idx), "scaled": 2 * loss})
        return loss


def accuracy_of(net: nn.Module, batch) -> float:
    x, y = batch
    with torch.no_grad():
        return (net(x).argmax(-1) == y).float().mean().item()


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if FALLBACK in str(w.message)]


@pytest.mark.parametrize("batched", ["auto", False])
def test_an_ordinary_module_trains_and_its_logged_values_are_read_per_replica(batched):
    n, steps = 2, 3
    shards = [list(s) for s in distributed_shards(classes(), n, batch_size=8, seed=0)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = TrainingSimulator(Classifier(), shards, NoLoCo(), sync_every=2, gradient_clip_val=1.0, max_steps=10,
                                batched=batched)
        sim.run(steps - 1)
        before = [copy.deepcopy(r.net) for r in sim.replicas]
        losses = sim.step()
    # "auto" falls back once, naming the cause (a metric's state cannot be kept per replica under vmap)
    assert len(fallback_warnings(caught)) == (0 if batched is False else 1)
    if batched == "auto":
        assert "torchmetrics" in fallback_warnings(caught)[0]
    assert not sim.batched
    for r in range(n):
        logged = sim.logged[r]
        last_batch = shards[r][steps - 1]
        assert logged["train_acc"] == pytest.approx(accuracy_of(before[r], last_batch))
        assert logged["train_loss"] == pytest.approx(losses[r])
        assert logged["seen_step"] == steps - 1  # self.global_step: the optimizer steps taken before
        assert logged["lr"] == pytest.approx(sim.lr_history[-1])
    assert sim.logged[0]["train_loss"] != sim.logged[1]["train_loss"]  # each replica's own
    assert sim.lr_history[0] == pytest.approx(0.01) and sim.lr_history[1] == pytest.approx(0.02)  # warm-up
    ev = sim.evaluate([classes()[:16]])  # evaluation calls training_step; what it logs is not kept
    assert math.isfinite(ev.consensus_loss) and sim.logged[0]["seen_step"] == steps - 1
    sim.finish()


def batched_fp32_bound(steps: int, lr: float, clip: float, terms: int, ops: int = 10) -> float:
    """How far vmap's float32 path may end from the loop's, on a model whose gradient is clipped to ``clip``.

    Both compute the same sums in another order (vmap's batched kernels block them differently; which order
    depends on the CPU's vector width). A sum of n terms in float32 is within n·ε·Σ|terms| of the exact one,
    so each gradient entry, at most ``clip`` after clipping and built by at most ``ops`` sums of at most
    ``terms`` terms (samples × features of one accumulation window), is within ops·terms·ε·clip of the exact
    value on either path; a step moves the weights by lr × that, and a difference in the weights feeds the
    next steps at most doubled each step (lr·L ≤ 1 for this small regressor, L the loss's curvature). Over
    ``steps`` steps: 2·steps·lr·clip·ops·terms·ε·2^steps, both paths' errors added."""
    return 2 * steps * lr * clip * ops * terms * torch.finfo(torch.float32).eps * 2**steps


@pytest.mark.parametrize(
    ("make", "data", "batch_size", "k", "batched", "precision", "atol"),
    [(Classifier, classes(40), 8, 2, False, "bf16-mixed", 0.0),
     (lambda: LoggingRegressor(scheduler=True), tiny.dataset(), 4, 5, False, "32-true", 0.0),
     (lambda: LoggingRegressor(scheduler=True), tiny.dataset(), 4, 5, True, "32-true",
      batched_fp32_bound(6, 0.05, 0.5, terms=4 * 5 * tiny.IN_FEATURES)),
     (lambda: LoggingRegressor(scheduler=True), tiny.dataset(), 4, 5, True, "bf16-mixed", 1e-4)],
    ids=["loop-bf16", "loop-fp32", "batched-fp32", "batched-bf16"],
)
def test_accumulation_precision_and_clipping_follow_a_lightning_trainer_on_one_replica(
    make, data, batch_size, k, batched, precision, atol
):
    """One replica, no outer step: the simulator against Lightning's own loop. The epochs' lengths
    (5 and 12 batches) are not multiples of k, so the last window of every epoch is cut short, as
    Lightning does. The loop is bitwise Lightning's, in float32 and bf16-mixed. vmap's path sums in another
    order: in float32 it stays within :func:`batched_fp32_bound` (bitwise on some CPUs, not on others); its
    bfloat16 matmuls round differently again."""
    settings = dict(accumulate_grad_batches=k, gradient_clip_val=0.5, precision=precision, max_steps=6)
    model = make()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False, **settings)
    trainer.fit(model, DataLoader(data, batch_size=batch_size, shuffle=False))
    sim = TrainingSimulator(make(), [DataLoader(data, batch_size=batch_size, shuffle=False)], None, batched=batched,
                            **settings)
    sim.run(6)
    sim.finish()
    assert sim.batched == batched
    assert trainer.global_step == sim.step_count == 6 and trainer.current_epoch == 2
    expected = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if atol == 0.0:
        assert torch.equal(sim.weights()[0], tiny.flat(model))
        assert sim.logged[0] == expected
    else:
        torch.testing.assert_close(sim.weights()[0], tiny.flat(model), atol=atol, rtol=0)
        assert sim.logged[0] == pytest.approx(expected, rel=0.01)
    assert all(p.dtype == torch.float32 for p in sim.replicas[0].parameters())


@pytest.mark.parametrize("batched", [True, False])
def test_accumulating_two_halves_is_one_batch_of_twice_the_size(batched):
    """Mean losses over equal halves: the gradient of the whole batch is the mean of the halves'."""
    def run(batch_size, k):
        shards = distributed_shards(tiny.dataset(), 2, batch_size=batch_size, seed=0)
        sim = TrainingSimulator(tiny.TinyRegressor(), shards, NoLoCo(), sync_every=2, batched=batched,
                                accumulate_grad_batches=k)
        losses = [sim.step() for _ in range(6)]  # two epochs of 24 samples per replica
        sim.finish()
        return sim, losses

    halves, halves_losses = run(4, 2)
    whole, whole_losses = run(8, 1)
    assert halves.batched == whole.batched == batched
    for a, b in zip(halves.weights(), whole.weights()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(halves_losses), torch.tensor(whole_losses), atol=1e-6, rtol=1e-5)
    # H counts optimizer steps: three rounds in six steps, not in twelve batches
    assert [r.outer_step for r in halves.drivers[0].reports] == [0, 1, 2]
    assert halves.shards[0].epoch == 1


def test_bf16_mixed_autocasts_the_forward_pass_on_both_paths():
    def run(precision, batched):
        sim = TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 2, 4), NoLoCo(),
                                sync_every=2, precision=precision, batched=batched)
        losses = [sim.step() for _ in range(4)]
        return sim, torch.tensor(losses)

    exact, exact_losses = run("32-true", False)
    for batched in (True, False):
        bf16, losses = run("bf16-mixed", batched)
        assert bf16.batched == batched
        assert not torch.equal(losses, exact_losses)  # bfloat16 matmuls really ran
        torch.testing.assert_close(losses, exact_losses, rtol=0.05, atol=0.02)
        assert all(p.dtype == torch.float32 for p in bf16.replicas[0].parameters())  # float32 master weights
        assert not torch.equal(bf16.weights()[0], exact.weights()[0])


class MaskedRegressor(tiny.TinyRegressor):
    """Selects rows by a data-dependent mask: an output of dynamic shape, which vmap cannot batch."""

    def loss(self, batch):
        x, y = batch
        keep = y[:, 0] > -100.0  # every row, but vmap cannot know it
        return nn.functional.mse_loss(self(x[keep]), y[keep])


def test_auto_falls_back_to_the_loop_on_any_error_of_the_first_batched_step():
    shards = [list(s) for s in distributed_shards(tiny.dataset(), 2, 4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = TrainingSimulator(MaskedRegressor(), shards, NoLoCo(), sync_every=2)
        assert sim.batched  # set up fine: the error shows in the first step
        sim.run(4)
    messages = fallback_warnings(caught)
    assert len(messages) == 1 and "RuntimeError" in messages[0]
    assert not sim.batched
    loop = TrainingSimulator(MaskedRegressor(), shards, NoLoCo(), sync_every=2, batched=False)
    loop.run(4)
    for a, b in zip(sim.weights(), loop.weights()):  # the failed step's batches were not lost
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError):
        TrainingSimulator(MaskedRegressor(), shards, NoLoCo(), sync_every=2, batched=True).step()


def test_the_batched_path_logs_every_replica_its_own_values():
    shards = distributed_shards(tiny.dataset(), 3, 4)
    runs = {}
    for batched in (True, False):
        sim = TrainingSimulator(LoggingRegressor(), shards, NoLoCo(), sync_every=2, batched=batched)
        assert sim.batched == batched
        sim.run(7)  # into the second epoch of four batches
        losses = sim.step()
        runs[batched] = sim.logged
        for r in range(3):
            assert sim.logged[r]["train_loss"] == pytest.approx(losses[r], rel=1e-6)
            assert sim.logged[r]["scaled"] == pytest.approx(2 * losses[r], rel=1e-6)
            assert sim.logged[r]["batch_idx"] == 3.0
    assert len({runs[True][r]["train_loss"] for r in range(3)}) == 3  # one value per replica, not one for all
    for a, b in zip(runs[True], runs[False]):
        assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"precision": "16-mixed"}, "bf16-mixed"), ({"accumulate_grad_batches": 0}, "accumulate_grad_batches")],
)
def test_bad_precision_and_accumulation_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 2, 4), **kwargs)


def test_a_module_with_manual_optimization_is_refused():
    with pytest.raises(ValueError, match="automatic_optimization"):
        TrainingSimulator(tiny.TinyRegressor(manual=True), distributed_shards(tiny.dataset(), 2, 4),
                          optimizers=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))


def test_a_lightning_without_the_private_parts_the_simulator_drives_is_named():
    from types import SimpleNamespace

    from lightning_loco.simulator.context import check_private_parts

    trainer = SimpleNamespace(_logger_connector=SimpleNamespace(on_batch_start=None))
    with pytest.raises(ImportError, match=r"_logger_connector\.on_batch_end.*lightning>=2\.4"):
        check_private_parts(trainer, None)  # type: ignore[arg-type]


def test_a_module_fitted_before_is_copied_without_its_trainer_and_keeps_it():
    model = tiny.TinyRegressor()
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model)
    sim = TrainingSimulator(model, distributed_shards(tiny.dataset(), 2, 4), NoLoCo(), sync_every=2)
    assert model.trainer is trainer
    assert all(r.trainer is not trainer and r.trainer is c.trainer for r, c in zip(sim.replicas, sim.contexts))
    sim.run(2)
    assert sim.replicas[0].trainer.global_step == 2
