"""What a strategy tells about its options and its replica: read by users, the monitor, checkpoints and tests.

``ReplicaViews`` is the first layer of :class:`~lightning_loco.trainer.base.OuterStepStrategy` over
Lightning's ``DDPStrategy``: beyond what the Fabric strategies show alike (:mod:`lightning_loco.replica.views`:
the algorithm, the replica's index and count, its layout, run and driver), the other options as attributes,
its outer state (one slot per optimizer) and counters, and the run's nominal progress. Plain reads: no
message.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_loco.driver.reports import OuterStepReport
from lightning_loco.driver.slots import OuterSlot
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.replica.modes import RunMode
from lightning_loco.replica.views import AdapterViews


class ReplicaViews(AdapterViews, DDPStrategy):
    """Properties over the strategy's options, run and launch."""

    outer_step_reports: list[OuterStepReport]

    # ------------------------------------------------------------------ the options

    @property
    def fragments(self) -> int:
        return self.options.fragments

    @property
    def overlap_steps(self) -> Union[int, str]:
        return self.options.overlap_steps

    @property
    def overlap_merge(self) -> str:
        return self.options.overlap_merge

    @property
    def sync_seconds(self) -> Union[None, float, str]:
        """T, with ``pacing`` ("auto": chosen at every round; None without)."""
        return self.options.sync_seconds

    @property
    def elastic(self) -> Optional[ElasticConfig]:
        return self.options.elastic

    # ------------------------------------------------------------------ the replica

    @property
    def mode(self) -> RunMode:
        """The static launch or an elastic replica (:mod:`lightning_loco.replica.modes`)."""
        return self.replica.mode

    @property
    def replica_module(self) -> Optional["pl.LightningModule"]:
        """The model the replica trains (None before the Trainer connected one)."""
        return self.lightning_module

    @property
    def module(self) -> "pl.LightningModule":
        """The LightningModule (once the Trainer connected it)."""
        module = self.lightning_module
        assert module is not None, "the strategy has no LightningModule yet"
        return module

    @property
    def outer_state_device(self) -> torch.device:
        return self.replica.outer_state_device

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """What Lightning's distributed sampler is built with: the launch's world, or an elastic replica's own
        part of the data (:mod:`lightning_loco.elastic.data`)."""
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # as Lightning seeds its sampler
        return self.mode.sampler_kwargs(super().distributed_sampler_kwargs, self.global_rank % self.ranks_per_replica,
                                        self.ranks_per_replica, seed)

    @property
    def replica_name(self) -> Union[int, str]:
        """How logs name this replica: its index, or an elastic replica's id (indices change with the membership)."""
        return self.mode.replica_name(self.replica_index)

    def comm_device(self) -> torch.device:
        """Where buffers cross the network: the accelerator with NCCL, else the CPU."""
        return self.root_device if self._get_process_group_backend() == "nccl" else torch.device("cpu")

    @property
    def outer_slots(self) -> list[OuterSlot]:
        """This replica's outer state, one slot per optimizer and fragment (optimizer 0's fragments first;
        empty outside ``fit``)."""
        return self.driver.slots if self.driver is not None else []

    @property
    def outer_steps(self) -> int:
        """Rounds started by the first optimizer (by its first fragment, with ``fragments``), resumed ones
        included; after ``fit``, the count it ended with (0 before training)."""
        return self.replica.outer_steps

    @property
    def nominal_step(self) -> Optional[float]:
        """With ``pacing``, the run's progress in nominal inner steps (t·H plus the share of the current
        phase done): what a step-based learning-rate schedule should follow, the same on every replica at
        the same wall time. None otherwise: the step count is the progress."""
        return self.replica.nominal_step

    @property
    def last_outer_step(self) -> Optional[OuterStepReport]:
        return self.outer_step_reports[-1] if self.outer_step_reports else None
