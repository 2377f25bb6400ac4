"""Replica-local validation: ``sync_dist`` and torchmetrics reduce within a replica, and rank 0's replica decides.

By default Lightning's validation synchronises every rank of the run, every replica included: ``self.log(...,
sync_dist=True)`` (a barrier and an all-reduce over all ranks per value), each torchmetrics ``Metric`` at
``compute()`` (all-gathers over all ranks, with or without ``sync_dist``), and the decisions of ``EarlyStopping``
and ``ModelCheckpoint`` (an all-reduce each). Each makes every site wait for the slowest, which is what the
low-communication strategies exist to avoid. The callback :class:`ReplicaValidation` turns that off:

* ``sync_dist=True`` reduces within the replica (its own ranks' group; with one rank per replica, no message);
* every torchmetrics ``Metric`` of the module syncs within the replica (its ``process_group`` is set to the
  replica's group; with one rank per replica it does not sync at all);
* each replica therefore logs its own validation, on its own share of the data (loggers write on global rank 0:
  replica 0's);
* decisions that must agree across replicas (``EarlyStopping``'s stop, ``ModelCheckpoint``'s "is this in the top
  k", its file names, whether a file exists) are **global rank 0's**. At the end of each validation of a fit, rank 0
  broadcasts its validation metrics (``trainer.callback_metrics``) and the file names in each ``ModelCheckpoint``'s
  folder, one ``broadcast_object_list``; every rank then holds replica 0's metrics, and the callbacks that run after
  it decide locally, the same on every rank, with no message (``Strategy.reduce_boolean_decision`` returns the
  rank's own decision until the validation ends). So ``ModelCheckpoint(monitor="val_loss")`` ranks and names
  checkpoints by replica 0's ``val_loss``, and ``EarlyStopping`` stops every replica when replica 0's metric stops
  improving. Names and ``best_model_path`` are rank 0's on every rank (docs/checkpoints.md). A decision taken
  elsewhere (a checkpoint at a training epoch's end, ``every_n_train_steps``) is rank 0's too, one broadcast of one
  integer each.

The strategy side is :class:`ReplicaScope`, a layer of :class:`~lightning_loco.trainer.base.OuterStepStrategy`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_loco import _compat
from lightning_loco.trainer.views import ReplicaViews


@dataclass
class Agreed:
    """What every rank holds after a validation's one broadcast: rank 0's metrics and the names of the files in each
    ``ModelCheckpoint`` folder as rank 0 saw them, kept up to date with the saves and removals that follow."""

    metrics: dict[str, float]
    files: dict[str, set[str]] = field(default_factory=dict)  # folder -> file names in it

    def exists(self, filepath: Any) -> Optional[bool]:
        """Whether ``filepath`` exists as rank 0 would find it; None for a folder not listed."""
        folder, name = os.path.split(str(filepath))
        return name in self.files[folder] if folder in self.files else None

    def saved(self, filepath: Any, present: bool = True) -> None:
        folder, name = os.path.split(str(filepath))
        if folder in self.files:
            (self.files[folder].add if present else self.files[folder].discard)(name)


class ReplicaScope(ReplicaViews):
    """The strategy's reductions for Lightning's logging and callbacks: over all ranks (``"global"``, Lightning's
    own) or, under :class:`ReplicaValidation`, within the replica (``"replica"``)."""

    validation_scope: str = "global"
    agreed: Optional[Agreed] = None  # from ReplicaValidation's broadcast to the end of that validation
    # under ReplicaValidation: this replica's own validation metrics of the last validation, as it logged them (the
    # callbacks then read replica 0's in trainer.callback_metrics)
    replica_metrics: dict[str, float] = {}

    def replica_group(self) -> Optional[Any]:
        """The process group of this replica's ranks (None with one rank per replica, or before the launch)."""
        groups = self.replica.groups
        return groups.replica if groups is not None else None

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[Any, str]] = "mean") -> Union[Tensor, Any]:
        """Lightning's ``sync_dist`` reduction; under :class:`ReplicaValidation` within the replica only (one rank
        per replica: the value itself, no message)."""
        if self.validation_scope == "replica" and group is None:
            group = self.replica_group()
            if group is None:
                return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's agreement on a callback's decision. Under :class:`ReplicaValidation`: after a validation's
        broadcast every rank decides from rank 0's metrics, so the rank's own decision, with no message; elsewhere
        global rank 0's, one broadcast of one integer."""
        if self.validation_scope != "replica" or not dist.is_available() or not dist.is_initialized():
            return super().reduce_boolean_decision(decision, all)
        if self.agreed is not None:
            return bool(decision)
        return self.rank_zero_decision(decision)

    def rank_zero_decision(self, decision: bool) -> bool:
        """Global rank 0's ``decision`` on every rank: one broadcast of one integer."""
        flag = torch.tensor([int(bool(decision))], device=self.comm_device())
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    @override
    def on_validation_end(self) -> None:
        """After every callback's ``on_validation_end``: the decisions of this validation are taken."""
        super().on_validation_end()
        self.agreed = None


def scope_metrics(module: torch.nn.Module, group: Optional[Any]) -> int:
    """Makes every torchmetrics ``Metric`` in ``module`` sync within ``group`` at ``compute()`` (None: not at all).
    Returns how many there are."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    for metric in metrics:
        if group is None:
            metric.sync_on_compute = False
            metric._to_sync = False  # what compute() reads; torchmetrics resets it from sync_on_compute
        else:
            metric.process_group = group
    return len(metrics)


class ReplicaValidation(L.Callback):
    """Validation within each replica: see the module docstring. Add it to the Trainer's callbacks with one of
    our strategies; it changes nothing about training's own messages. Its ``on_validation_end`` runs before every
    other callback's (the strategy puts it first), so that they all decide from replica 0's metrics."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ReplicaScope):
            raise TypeError(f"ReplicaValidation needs one of lightning_loco's strategies (NoLoCo, DiLoCo, GASLoC), "
                            f"not {type(strategy).__name__}: under it every rank is one model, so there is no "
                            "replica to validate within.")
        strategy.validation_scope = "replica"
        self._scope(trainer, pl_module)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and "file_exists" not in vars(callback):
                callback.file_exists = _agreed_file_exists(callback, strategy)  # type: ignore[method-assign]

    def _scope(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ReplicaScope)
        scope_metrics(pl_module, strategy.replica_group())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._scope(trainer, pl_module)  # metrics made in configure_model

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._scope(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._scope(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """During fit, the validation's one message: rank 0's metrics and checkpoint folders to every rank (only where
        an ``EarlyStopping`` or a ``ModelCheckpoint`` is there to decide)."""
        strategy = trainer.strategy
        deciders = bool(trainer.early_stopping_callbacks) or any(isinstance(c, ModelCheckpoint)
                                                                 for c in trainer.checkpoint_callbacks)
        if (not deciders or not isinstance(strategy, ReplicaScope) or trainer.sanity_checking
                or trainer.state.fn != TrainerFn.FITTING or not dist.is_available() or not dist.is_initialized()
                or dist.get_world_size() == 1):
            return
        box: list[Any] = [None]
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if isinstance(v, (int, float)) or (isinstance(v, Tensor) and v.numel() == 1)}
        strategy.replica_metrics = metrics
        if trainer.is_global_zero:
            box[0] = Agreed(metrics, {folder: set(names) for folder, names in _checkpoint_folders(trainer).items()})
        dist.broadcast_object_list(box, src=0)
        agreed: Agreed = box[0]
        _compat.set_epoch_metrics(trainer, agreed.metrics)
        strategy.agreed = agreed

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, ReplicaScope):
            trainer.strategy.validation_scope = "global"
            trainer.strategy.agreed = None
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and "file_exists" in vars(callback):
                del callback.file_exists  # the class's own again


def put_first(trainer: L.Trainer) -> None:
    """Puts :class:`ReplicaValidation` first among the Trainer's callbacks (called by the strategy at setup, after
    Lightning has ordered them): its ``on_validation_end`` must run before the callbacks that decide."""
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
    first = [c for c in callbacks if isinstance(c, ReplicaValidation)]
    if first:
        callbacks[:] = first + [c for c in callbacks if not isinstance(c, ReplicaValidation)]


def _checkpoint_folders(trainer: L.Trainer) -> dict[str, list[str]]:
    """On rank 0: the names of the files in each ``ModelCheckpoint``'s folder (a folder not yet made: none)."""
    out: dict[str, list[str]] = {}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            folder = str(callback.dirpath)
            out[folder] = [e.name for e in os.scandir(folder) if e.is_file()] if os.path.isdir(folder) else []
    return out


def _agreed_file_exists(callback: ModelCheckpoint, strategy: ReplicaScope) -> Any:
    """``ModelCheckpoint.file_exists`` under :class:`ReplicaValidation`: from the validation's broadcast where it
    lists the folder (no message), else rank 0's look, broadcast (Lightning's own answer, without its all-reduce)."""

    def file_exists(filepath: Any, trainer: L.Trainer) -> bool:
        agreed = strategy.agreed
        known = agreed.exists(filepath) if agreed is not None else None
        if known is not None:
            return known
        return strategy.rank_zero_decision(callback._fs.exists(filepath) if trainer.is_global_zero else False)

    return file_exists
