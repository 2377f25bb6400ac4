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
* decisions that must agree across replicas (``Strategy.reduce_boolean_decision``: ``EarlyStopping``'s stop,
  ``ModelCheckpoint``'s "is this in the top k", whether a file exists) are **global rank 0's**, broadcast to every
  rank: one small broadcast (one integer) per decision. So ``ModelCheckpoint(monitor="val_loss")`` ranks and
  names checkpoints by replica 0's ``val_loss``, and ``EarlyStopping`` stops every replica when replica 0's
  metric stops improving. Names and ``best_model_path`` are rank 0's on every rank (docs/checkpoints.md).

The strategy side is :class:`ReplicaScope`, a layer of :class:`~lightning_loco.trainer.base.OuterStepStrategy`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_loco.trainer.views import ReplicaViews


class ReplicaScope(ReplicaViews):
    """The strategy's reductions for Lightning's logging and callbacks: over all ranks (``"global"``, Lightning's
    own) or, under :class:`ReplicaValidation`, within the replica (``"replica"``)."""

    validation_scope: str = "global"

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
        """Lightning's agreement on a callback's decision; under :class:`ReplicaValidation` global rank 0's, one
        broadcast of one integer."""
        if self.validation_scope != "replica" or not dist.is_available() or not dist.is_initialized():
            return super().reduce_boolean_decision(decision, all)
        flag = torch.tensor([int(bool(decision))], device=self.comm_device())
        dist.broadcast(flag, src=0)
        return bool(flag.item())


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
    our strategies; it changes nothing about training's own messages."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ReplicaScope):
            raise TypeError(f"ReplicaValidation needs one of lightning_loco's strategies (NoLoCo, DiLoCo, GASLoC), "
                            f"not {type(strategy).__name__}: under it every rank is one model, so there is no "
                            "replica to validate within.")
        strategy.validation_scope = "replica"
        self._scope(trainer, pl_module)

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

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, ReplicaScope):
            trainer.strategy.validation_scope = "global"
