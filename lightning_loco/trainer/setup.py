"""What the strategies know when ``fit`` starts (for the rules of :mod:`lightning_loco.rules`), when
``fit`` ends, and the warnings they give then. Lightning's side only: plain reads of the Trainer.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_loco.driver.fragments import next_round_step
from lightning_loco.replica.run import params_of
from lightning_loco.replica.short_runs import warn_if_short
from lightning_loco.rules import Fit, Launch
from lightning_loco.rules.table import shared_parameter


def fit_facts(trainer: "pl.Trainer", module: "pl.LightningModule", optimizers: list[Optimizer],
              device: torch.device) -> Fit:
    """What the rules checked when ``fit`` starts look at: the optimizers' parameters, the loop's length,
    validation and the callbacks that save by a replica's own step count, the model's device."""
    shared = shared_parameter([params_of(o) for o in optimizers])
    validates = trainer.limit_val_batches != 0 and is_overridden("validation_step", module)
    return Fit(
        parameters=tuple(len(params_of(o)) for o in optimizers), max_steps=trainer.max_steps,
        max_epochs=trainer.max_epochs, validates=bool(validates),
        step_checkpoints=tuple(type(cb).__name__ for cb in trainer.checkpoint_callbacks
                               if isinstance(cb, ModelCheckpoint)),
        model_device=device.type, shared_parameter=shared,
    )


def fit_ends_after_this_step(trainer: "pl.Trainer", optimizers_per_batch: int = 1) -> bool:
    """Whether the optimizer step being taken is the last of ``fit``: ``max_steps`` is reached with it,
    or it falls in the last batch of the last epoch (``max_epochs``). An early stop (``EarlyStopping``,
    ``max_time``, a signal) cannot be foreseen. With manual optimization ``optimizers_per_batch``
    optimizer steps are taken to make up one batch (one step each of the optimizers), so that every
    optimizer's step of the last batch counts as its last; a guess that proves wrong is undone when
    the next batch starts (``OuterStepDriver.restore_outer_weights``)."""
    if trainer.max_steps >= 0 and trainer.global_step + optimizers_per_batch >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs < 0 or trainer.current_epoch + 1 < max_epochs:
        return False
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.is_last_batch or progress.current.ready >= trainer.num_training_batches


def warn_if_one_replica(strategy: Any, launch: Launch) -> None:
    """A static run of one replica: nobody to exchange with."""
    world, k = launch.processes, strategy.ranks_per_replica
    if strategy.elastic is None and world // k == 1:
        rank_zero_warn(
            f"{type(strategy).__name__} with a single replica ({world} process(es), ranks_per_replica={k}): "
            "there is nobody to exchange with, so the outer steps only move this replica along its own "
            "pseudo-gradient. Use devices > 1 (or more nodes) for several replicas"
            + (", or strategy='ddp' for plain data parallelism." if k > 1 else ".")
        )


def warn_if_no_outer_step(strategy: Any, trainer: "pl.Trainer") -> None:
    """No round falls inside the fit's remaining steps."""
    remaining, h = trainer.max_steps - trainer.global_step, strategy.sync_every
    slots = strategy.outer_slots
    if trainer.max_steps >= 0 and all(s.inner_steps + remaining < next_round_step(s.offset, s.outer_steps, h)
                                      for s in slots):
        rank_zero_warn(
            f"No outer step will happen in this fit: {max(remaining, 0)} optimizer step(s) are left before "
            f"max_steps={trainer.max_steps}, fewer than the next outer step needs (sync_every={h}), "
            "so the replicas never meet. Lower sync_every or raise max_steps."
        )


def warn_if_short_run(strategy: Any, trainer: "pl.Trainer") -> None:
    """Once per fit, on global rank 0: the outer step's defaults on a run of fewer outer steps than
    B5 showed they need (:mod:`lightning_loco.replica.short_runs`). The run's length is ``max_steps``, else
    what ``max_epochs`` makes of the training batches."""
    steps = trainer.max_steps if trainer.max_steps >= 0 else trainer.estimated_stepping_batches
    warn_if_short(strategy.algorithm, steps, strategy.sync_every, rank_zero_warn)


def warn_if_replicas_read_the_same_data(strategy: Any, trainer: "pl.Trainer") -> None:
    """Elastic replicas: once the training data loaders are built, whether Lightning's sampler cuts them as
    :mod:`lightning_loco.elastic.data` says. A loader it cannot cut (an iterable dataset, a sampler of the
    module's own, ``use_distributed_sampler=False``) or one that does not shuffle without data slots would give
    every replica the same batches."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

    config = strategy.elastic
    if config is None or config.data_slots == 1:
        return
    loaders = trainer.train_dataloader
    flat = loaders.flattened if isinstance(loaders, CombinedLoader) else [loaders]
    wanted = strategy.distributed_sampler_kwargs
    fix = (f"Cut it by trainer.strategy.distributed_sampler_kwargs ({wanted}), or set elastic.data_slots=1 if the "
           "replicas should read the same data.")
    for loader in flat:
        if not isinstance(loader, DataLoader):
            continue
        sampler = loader.sampler
        if isinstance(loader.dataset, IterableDataset):
            problem = "an iterable dataset, which Lightning's sampler does not cut"
        elif not isinstance(sampler, DistributedSampler):  # Lightning's wrapper of a batch sampler is one too
            problem = f"a {type(sampler).__name__} of its own (or use_distributed_sampler=False)"
        elif (sampler.num_replicas, sampler.rank) != (wanted["num_replicas"], wanted["rank"]):
            problem = f"a sampler of its own for {sampler.num_replicas} replica(s)"
        elif config.data_slots is None and not getattr(sampler, "shuffle", True):
            problem = "no shuffling, so every replica reads the whole dataset in the same order"
            fix = ("Shuffle the training data (each replica then reads its own order), or set elastic.data_slots=N "
                   "to cut it into N parts, one per replica slot.")
        else:
            continue
        rank_zero_warn(f"Elastic replica {config.name!r}: its training data loader has {problem}, so every replica "
                       f"may train on the same batches. {fix}")
        return


def schedulers_on_nominal_steps(strategy: Any, trainer: "pl.Trainer") -> list[Any]:
    """With ``pacing``: the scheduler configs that follow the run's nominal progress (every step-interval
    scheduler Lightning steps that counts its steps, :mod:`lightning_loco.driver.lr_schedules`), with a warning for
    those that cannot (an epoch interval, ``ReduceLROnPlateau``, manual optimization's own stepping)."""
    from lightning_loco.driver.lr_schedules import followable

    if strategy.sync_seconds is None:
        return []
    follow, left = [], []
    automatic = trainer.lightning_module.automatic_optimization
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step" and followable(config.scheduler) and automatic:
            follow.append(config)
        else:
            left.append(type(config.scheduler).__name__)
    if left:
        rank_zero_warn(
            f"pacing ({strategy.options.pacing_text}) makes replicas take different numbers of steps; "
            f"{', '.join(left)} cannot be made to follow the run's progress here (an epoch interval, a metric's "
            "scheduler or manual optimization), so each replica's learning rate follows its own steps. Use a "
            "step-interval scheduler under automatic optimization, or compute the rate from "
            "trainer.strategy.nominal_step."
        )
    return follow
