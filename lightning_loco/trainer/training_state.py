"""What a Lightning replica's training state holds outside the outer-step driver, and what an elastic
replica says when it stops.

An elastic replica that heals (:mod:`lightning_loco.elastic`) takes its donor's whole training state, so
that it steps, logs, checkpoints and stops as the donor does. The driver's part (anchor, outer state,
counters) and the weights travel through the driver plug-in; :class:`LightningTrainingState` gives it the
rest, as a :class:`~lightning_loco.driver.plugins.TrainingState`:

* the module's state that no optimizer trains: buffers (a BatchNorm's running statistics) and frozen
  parameters (the trained ones travel as the driver's flat weights);
* the inner optimizers' state (AdamW's moments and step counts, the learning rates of its groups), unless
  the donor's plug-in leaves it out (its ``heal_optimizer`` is False): then ``None`` stands in its place, and the
  joiner's optimizers keep their own state (a restarted process's: none, so they start afresh) and take the
  schedule's rates;
* the learning-rate schedulers' state (where each is in its schedule);
* the precision plugin's state (a loss scaler's scale and growth tracker; nothing for most plugins);
* the fit loop's counters (``_compat.LOOP_COUNTERS``): ``global_step`` and what the loop derives from it,
  the epoch and the batch index, scheduler steps, the step loggers get.

With FSDP2 inside the replica (``replica_sharding="fsdp"``) each rank exports its own part: its local shards
of the sharded tensors (the inner optimizer's moments, frozen sharded parameters) as plain tensors, with the
layout of the model's shards (:func:`~lightning_loco.replica.sharding.layout`); rank i of a joiner loads them into its
own ``DTensor`` objects, which are placed alike, and a donor that shards differently is an error before anything
is loaded. Nothing is gathered: the state crosses shard by shard.

Both sides export and load at the start of a training batch, where every counter of the previous batch
is complete and the current batch's fetch is counted alike on both: :class:`BetweenSteps`, first among
the Trainer's callbacks while fit runs, calls the plug-in's ``between_steps`` there, before any other
callback's ``on_train_batch_start`` logs the batch's step or learning rate. What is not healed is listed
in docs/elastic.md.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.tensor import DTensor

from lightning_loco import _compat
from lightning_loco.driver.plugins import TrainingState

log = logging.getLogger("lightning_loco")


class LightningTrainingState:
    """The training state of ``trainer``'s fit outside the driver (see the module docstring); ``layout``:
    the replica's (:mod:`.layout`), which says how a sharded replica's part of it is exported and loaded."""

    def __init__(self, trainer: Any, layout: Any) -> None:
        self.trainer, self.layout = trainer, layout

    def _schedulers(self) -> list[Any]:
        return [config.scheduler for config in self.trainer.lr_scheduler_configs]

    def _untrained(self) -> dict[str, Any]:
        """The module's state_dict entries that no optimizer trains (buffers, frozen parameters); sharded
        ones as ``DTensor`` objects."""
        trained = {_data_ptr(p) for o in self.trainer.strategy.optimizers for g in o.param_groups for p in g["params"]}
        state = self.trainer.lightning_module.state_dict()
        return {name: value for name, value in state.items() if _data_ptr(value) not in trained}

    def export(self, optimizers: bool = True) -> dict[str, Any]:
        """This replica's state; without the inner optimizers' (``None`` in its place) unless ``optimizers``."""
        trainer = self.trainer
        state = {
            "module": self._untrained(),
            "optimizers": [o.state_dict() for o in trainer.strategy.optimizers] if optimizers else None,
            "lr_schedulers": [scheduler.state_dict() for scheduler in self._schedulers()],
            "precision": trainer.precision_plugin.state_dict(),
            "loops": _compat.loop_counters(trainer),
        }
        return self.layout.export_tree(state)  # sharded: this rank's local shards, and how the model is sharded

    def load(self, state: dict[str, Any], everything: bool) -> None:
        """Takes ``state`` (from a donor's :meth:`export`): everything, or (``everything=False``) only the loop's
        counters and the schedulers, which count steps too. A state without the optimizers' (``None``: the
        donor's ``heal_optimizer=False``) leaves this replica's optimizers as they are."""
        trainer = self.trainer
        optimizers, schedulers = trainer.strategy.optimizers, self._schedulers()
        sent = state["optimizers"]
        if (sent is not None and len(sent) != len(optimizers)) or len(state["lr_schedulers"]) != len(schedulers):
            theirs = "no optimizer state (heal_optimizer=False)" if sent is None else f"{len(sent)} optimizer(s)"
            raise RuntimeError(
                f"The donor's training state has {theirs} and "
                f"{len(state['lr_schedulers'])} LR scheduler(s), this replica {len(optimizers)} and {len(schedulers)}: "
                "every replica must run the same model and configure_optimizers."
            )
        if everything:
            own = self._untrained()
            if set(state["module"]) != set(own):
                raise RuntimeError(
                    f"The donor's module holds {sorted(set(state['module']) ^ set(own))} where this replica's does "
                    "not, or the other way round: every replica must run the same model."
                )
            self.layout.load_module_state(trainer.lightning_module, state["module"])
            for optimizer, saved in zip(optimizers, sent or ()):
                optimizer.load_state_dict(self.layout.optimizer_state(optimizer, saved))
            trainer.precision_plugin.load_state_dict(state["precision"])
        for scheduler, saved in zip(schedulers, state["lr_schedulers"]):
            scheduler.load_state_dict(saved)
            if (not everything or sent is None) and hasattr(scheduler, "get_last_lr"):
                # the optimizer kept its own state: its groups take the schedule's current learning rates
                for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                    group["lr"] = lr
        _compat.load_loop_counters(trainer, state["loops"])

    def check(self, state: dict[str, Any]) -> None:
        """Rank i of a sharded replica heals only from a donor's rank i that holds the same shards (and a
        replica that is not sharded only from one that is not): ``RuntimeError`` otherwise, before anything
        is loaded."""
        mine = self.layout.module_state()
        theirs = state.get("layout")
        if theirs == mine:
            return
        if mine is None or theirs is None:
            diff = ("the donor is sharded, this replica not" if mine is None
                    else "this replica is sharded, the donor not")
        else:
            diff = next((f"{a} here, {b} there" for a, b in zip(mine, theirs) if a != b),
                        f"{len(mine)} parameters here, {len(theirs)} there")
        raise RuntimeError(
            f"The donor shards the model differently from this replica ({diff}); nothing of its state was loaded. "
            "Every replica must shard identically (the same replica_sharding, fully_shard calls and "
            "ranks_per_replica), since rank i of a joiner takes the shards of the donor's rank i."
        )

    def for_plugin(self) -> TrainingState:
        return TrainingState(export=self.export, load=self.load, check=self.check)


def _data_ptr(t: Any) -> int:
    """Where a tensor's data lives; a ``DTensor``'s: its local shard's."""
    return t.to_local().data_ptr() if isinstance(t, DTensor) else t.data_ptr()


class BetweenSteps(Callback):
    """Calls the driver plug-in's ``between_steps`` at the start of each training batch and lets the schedulers
    follow the nominal progress at its end; :meth:`insert` puts it before every other callback, :meth:`remove`
    takes it out again."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        driver = getattr(trainer.strategy, "driver", None)
        if driver is not None:
            driver.plugin.between_steps()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After the loop stepped its schedulers, before any other callback (a checkpoint, a monitor) reads them:
        under ``pacing`` they catch up with the run's nominal progress."""
        follow = getattr(trainer.strategy, "follow_nominal_steps", None)
        if follow is not None:
            follow()

    @classmethod
    def insert(cls, trainer: Any) -> None:
        cls.remove(trainer)
        trainer.callbacks.insert(0, cls())

    @classmethod
    def remove(cls, trainer: Any) -> None:
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, cls)]


def stop_on_sigterm(trainer: Any, label: str) -> Callable[[str], None]:
    """The ``check_stop`` of an elastic replica's waits: raises Lightning's ``SIGTERMException`` (the fit then
    stops as on a SIGTERM between batches) once the replica received SIGTERM."""

    def check(waiting_for: str) -> None:
        if trainer.received_sigterm:
            log.info("%s received SIGTERM while waiting for %s; stopping.", label, waiting_for)
            raise SIGTERMException()

    return check


def say_why_fit_ended(trainer: Any, label: str, outer_steps: int, interrupted: bool) -> None:
    """One log line: the step this replica stopped at, and why when that is not the run's ``max_steps``."""
    step, max_steps = trainer.global_step, trainer.max_steps
    if not interrupted and max_steps >= 0 and step >= max_steps:
        log.info("%s: training ended at step %d, the run's max_steps, after %d outer steps.", label, step, outer_steps)
        return
    max_epochs = trainer.max_epochs
    if trainer.received_sigterm:
        why = "it received SIGTERM"
    elif interrupted:
        why = "fit was interrupted (an error, or Ctrl-C)"
    elif max_epochs is not None and max_epochs >= 0 and trainer.current_epoch >= max_epochs:
        why = f"max_epochs={max_epochs} was reached first"
    elif trainer.should_stop:
        why = "trainer.should_stop was set (EarlyStopping, max_time, or the module)"
    else:
        why = "the training data ran out"
    until = f", before max_steps={max_steps}" if max_steps >= 0 else ""
    log.warning("%s: training stopped at step %d%s, after %d outer steps: %s.", label, step, until, outer_steps, why)
