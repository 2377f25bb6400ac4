"""The GPU check's two modes (the GPU run and the CPU dry run), the parts' time budgets, progress lines."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

TOTAL_BUDGET_S = 370.0  # all parts together: with the grace below and start-up, under 7 minutes
GRACE_S = 15.0  # a part's process is stopped this long after its budget (an isolated part)
START_S = 10.0  # of a part's budget, what starting its process (imports, CUDA) takes
# part -> (title, time budget in seconds on one H200)
PARTS: dict[int, tuple[str, float]] = {
    1: ("inner-step overhead", 110.0),
    2: ("host synchronisation", 50.0),
    3: ("peak memory", 60.0),
    4: ("two processes on one GPU (gloo)", 90.0),
    5: ("NCCL on one GPU", 45.0),
    6: ("FSDP2 inside a replica, one shard", 60.0),
    7: ("codecs against a copy", 40.0),
}
# The CPU dry run has no budgets, only limits that stop a hang: far beyond what a run takes on a
# loaded machine (seconds), so that reaching one means that something hangs, not that it was slow.
DRY_RUN_HANG_S = 240.0  # one run of part 4's two worker processes
DRY_PART_HANG_S = 600.0  # a part in a process of its own (part 4 runs its workers twice)


@dataclass(frozen=True)
class Setting:
    """The model and run sizes of one mode (GPU, or the CPU dry run)."""

    accelerator: str
    precision: str
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    warmup: int  # steps not timed
    overhead_steps: int  # part 1: timed steps per run
    overhead_repeats: int
    sync_every: int  # part 1's H
    short_steps: int  # parts 2, 3, 5: steps per run
    short_sync_every: int
    pair_steps: int  # part 4
    pair_sync_every: int
    pair_overlap: int
    lr: float
    codec_values: int  # part 7: float32 values of the payload
    codec_repeats: int  # part 7: interleaved repeats


GPU = Setting("gpu", "bf16-mixed", 14, 12, 768, 256, 32, 20, 150, 3, 50, 30, 10, 60, 20, 4, 1e-3, 50_000_000, 20)
DRY = Setting("cpu", "32-true", 1, 2, 32, 16, 4, 2, 8, 1, 4, 8, 3, 8, 4, 1, 1e-2, 100_000, 5)


class Budget:
    """A part's time budget: parts ask between runs whether they may start another. ``seconds=None``
    is no budget (the CPU dry run): every run may start. The runs a budget turned down are kept in
    ``skipped``, so that the part's result and the table show them."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.seconds, self.started = seconds, time.perf_counter()
        self.skipped: list[str] = []

    @property
    def limited(self) -> bool:
        return self.seconds is not None

    def left(self) -> float:
        """Seconds left (infinite without a budget)."""
        if self.seconds is None:
            return math.inf
        return self.seconds - (time.perf_counter() - self.started)

    def allows(self, fraction: float, what: str) -> bool:
        """Whether a run expected to take ``fraction`` of the budget still fits; says so if not."""
        if self.seconds is None or self.left() >= fraction * self.seconds:
            return True
        say(f"  skipping {what}: {self.left():.0f} s left of the part's {self.seconds:.0f} s")
        self.skipped.append(what)
        return False


def say(message: str) -> None:
    """A progress line with the time, so that a partial log shows how far the run came."""
    print(f"[{datetime.now(timezone.utc):%H:%M:%S}] {message}", flush=True)
