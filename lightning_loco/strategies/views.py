"""What a strategy tells about its replica: read by users, the monitor, checkpoints and tests.

``ReplicaViews`` is mixed into :class:`~lightning_loco.strategies.base.OuterStepStrategy`: the replica's
index and count, its outer state (one slot per optimizer) and counters, and the run's nominal progress.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_loco.reports import OuterStepReport
from lightning_loco.slots import OuterSlot


class ReplicaViews:
    """Properties over the strategy's driver and launch (plain reads: no message)."""

    driver: Any
    ranks_per_replica: int
    outer_step_reports: list[OuterStepReport]
    _outer_state_device: Optional[torch.device]
    _final_outer_steps: int

    @property
    def outer_state_device(self) -> torch.device:
        return self._outer_state_device if self._outer_state_device is not None else self.root_device

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.ranks_per_replica

    @property
    def replica_index(self) -> int:
        return self.global_rank // self.ranks_per_replica

    @property
    def outer_slots(self) -> list[OuterSlot]:
        """This replica's outer state, one slot per optimizer and fragment (optimizer 0's fragments first;
        empty outside ``fit``)."""
        return self.driver.slots if self.driver is not None else []

    @property
    def outer_steps(self) -> int:
        """Rounds started by the first optimizer (by its first fragment, with ``fragments``), resumed ones
        included; after ``fit``, the count it ended with (0 before training)."""
        return self.outer_slots[0].outer_steps if self.outer_slots else self._final_outer_steps

    @property
    def nominal_step(self) -> Optional[float]:
        """With ``sync_seconds``, the run's progress in nominal inner steps (t·H plus the share of the
        current phase done): what a step-based learning-rate schedule should follow, the same on
        every replica at the same wall time. None otherwise: the step count is the progress."""
        if self.driver is None or self.driver.pacing is None:
            return None
        return self.driver.nominal_step()

    @property
    def last_outer_step(self) -> Optional[OuterStepReport]:
        return self.outer_step_reports[-1] if self.outer_step_reports else None

    def _comm_device(self) -> torch.device:
        return self.root_device if self._get_process_group_backend() == "nccl" else torch.device("cpu")
