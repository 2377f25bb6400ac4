"""Learning-rate schedulers on the run's nominal progress, for replicas of different speeds (``pacing``).

With ``pacing`` each replica takes its own number of inner steps per round, so a scheduler stepped once per
optimizer step would run slow on a slow replica (it ends the run far from the schedule's end) and the
replicas' learning rates would drift apart. The run's progress is its nominal step instead (t·H plus the
share of the current round done, :meth:`~lightning_loco.driver.pacing.Pacing.nominal_step`): never behind a
replica's own step count, the same on every replica at each round.

:func:`catch_up` steps a scheduler, after the loop's own step, as many more times as it takes for the
scheduler's count to reach the nominal step. It only counts calls of ``step()``, so any scheduler whose
``last_epoch`` counts them follows (``OneCycleLR``, ``CosineAnnealingLR``, ``LambdaLR``, ``SequentialLR``,
...): at every round each replica's scheduler has taken t·H steps, its learning rate is the one a
replica that never waited would have, and a run that ends on round R ends with every scheduler at
min(R·H, ``max_steps``). Between rounds a slow replica takes its extra steps as its nominal progress
passes them. No Lightning here.
"""

from __future__ import annotations

import math
from typing import Any, Optional


def followable(scheduler: Any) -> bool:
    """Whether ``scheduler`` counts its steps in ``last_epoch`` (every ``torch.optim.lr_scheduler.LRScheduler``
    does; ``ReduceLROnPlateau`` steps on a metric, not on progress)."""
    from torch.optim.lr_scheduler import LRScheduler

    return isinstance(scheduler, LRScheduler) and isinstance(getattr(scheduler, "last_epoch", None), int)


def catch_up(scheduler: Any, nominal_step: float, frequency: int = 1, limit: Optional[int] = None) -> int:
    """Steps ``scheduler`` until its count (``last_epoch``) is ⌊nominal_step / frequency⌋, or ``limit`` (a
    scheduler stepped every ``frequency`` optimizer steps, as Lightning's ``frequency`` does). Returns the
    steps taken (none when it is there already: a scheduler is never stepped back)."""
    target = math.floor(nominal_step + 1e-9) // frequency
    if limit is not None:
        target = min(target, limit)
    taken = 0
    while scheduler.last_epoch < target:
        scheduler.step()
        taken += 1
    return taken
