"""Modelled step times for the training simulator: a virtual clock per replica.

Replicas in one process run at the speed of the machine, not at the speeds of the sites they stand
for. Given each replica's modelled step time s_i (``TrainingSimulator(step_seconds=...)``), every
replica gets a :class:`VirtualClock` that moves by s_i at each of its inner steps and, at an exchange,
to the time the last member of its group of the round posted: the exchange waits for the last
arrival (and takes no time itself). The replicas' drivers read these clocks, so that ``sync_seconds``
paces each replica on its modelled time, exactly as it would pace it on a real clock, and the reports'
compute seconds and compute share are in modelled seconds.

The wait is applied by a driver plug-in (:class:`WaitForLast`) when the round starts, after the
phase's compute was read: the round's time then counts as the round's, never as the next phase's
compute. :class:`PacedRounds` is the simulator's loop under ``sync_seconds``: each replica takes
inner steps until its own round is due, then every replica's exchange runs (in threads, as each
waits for its group). Since a replica's phase depends on nothing but its own clock, this is what
replicas running side by side would do, step for step. No Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.algorithms.schedules import Round
from lightning_loco.driver import lr_schedules
from lightning_loco.driver.plugins import DriverPlugin
from lightning_loco.replica.run import last_step


def check_step_seconds(step_seconds: Any, num_replicas: int) -> list[float]:
    """The modelled step times as floats; ``ValueError`` saying what to pass where they cannot serve."""
    try:
        values = [float(s) for s in step_seconds]
        wrong = isinstance(step_seconds, (str, bytes)) or any(isinstance(s, bool) for s in step_seconds)
    except (TypeError, ValueError):
        values, wrong = [], True
    if wrong or len(values) != num_replicas or not all(math.isfinite(s) and s > 0 for s in values):
        raise ValueError(
            f"step_seconds must give each of the {num_replicas} replicas its modelled step time, a number of "
            f"seconds > 0 (e.g. [1.0] * {max(0, num_replicas - 1)} + [2.0] for one replica 2x slower), got "
            f"{step_seconds!r}"
        )
    return values


def check_modelled_time(algorithm: OuterAlgorithm | None, num_replicas: int, step_seconds: Any) -> None:
    """Raises ``ValueError`` where ``step_seconds`` cannot serve (how it and pacing meet the other options is
    checked by the rules of :mod:`lightning_loco.rules`, the simulator's among them)."""
    if step_seconds is not None:
        if algorithm is None:
            raise ValueError("step_seconds models the waits at the outer step's exchanges: give an algorithm with it")
        check_step_seconds(step_seconds, num_replicas)


class VirtualClock:
    """A replica's clock in modelled seconds (what its driver reads)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ModelledTime:
    """Every replica's virtual clock and modelled compute.

    Args:
        step_seconds: each replica's modelled time per inner (optimizer) step.
        algorithm: the outer step, whose schedule says who waits for whom at each round.
    """

    def __init__(self, step_seconds: Sequence[float], algorithm: OuterAlgorithm) -> None:
        self.step_seconds = list(step_seconds)
        self.algorithm = algorithm
        n = len(self.step_seconds)
        self.clocks = [VirtualClock() for _ in range(n)]
        self.compute = [0.0] * n  # modelled seconds each replica has computed
        self.posted = [0.0] * n  # each replica's clock when the latest exchanges were posted

    @property
    def num_replicas(self) -> int:
        return len(self.clocks)

    def stepped(self, replica: int) -> None:
        """Replica ``replica`` took an inner step: its clock moves by its step time."""
        self.clocks[replica].now += self.step_seconds[replica]
        self.compute[replica] += self.step_seconds[replica]

    def arrive(self) -> None:
        """Every replica taking part in the next exchanges has done its phase's compute: the times they
        post at (called before the exchanges run, in the threads of the replicas)."""
        self.posted = [clock.now for clock in self.clocks]

    def plugin(self, replica: int) -> "WaitForLast":
        return WaitForLast(self, replica)

    def compute_share(self, replica: int) -> float:
        """Replica ``replica``'s modelled compute over its modelled wall time (1 when it never waited)."""
        wall = self.clocks[replica].now
        return self.compute[replica] / wall if wall > 0 else 1.0

    @property
    def wall_seconds(self) -> float:
        """The modelled time of the replica that is furthest on (the run's wall time so far)."""
        return max(clock.now for clock in self.clocks)


class WaitForLast(DriverPlugin):
    """At each round, the replica's clock goes to the time the last member of its group posted."""

    def __init__(self, time: ModelledTime, replica: int) -> None:
        self.time, self.replica = time, replica

    def before_round(self, optimizer_index: int, outer_step: int, schedule: Round) -> None:
        group = schedule.group_of(self.replica)
        clock = self.time.clocks[self.replica]
        clock.now = max(clock.now, *(self.time.posted[j] for j in group))


class PacedRounds:
    """The simulator's rounds (a mixin of :class:`~lightning_loco.simulator.TrainingSimulator`, which
    sets the attributes annotated here)."""

    num_replicas: int
    sync_every: int
    sync_seconds: float | str | None
    max_steps: int | None
    step_count: int
    time: ModelledTime | None
    drivers: list[Any]
    shards: list[Any]
    contexts: list[Any]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    params: list[list[torch.nn.Parameter]]
    gradient_clip_val: float | None
    accumulate_grad_batches: int
    lr_history: list[float]
    _replica_grads: Any
    _exchange: Any
    step: Any

    @property
    def rounds_done(self) -> int:
        """Rounds run so far; with fixed H, blocks of H steps begun (the last one ends at ``max_steps``)."""
        if self.sync_seconds is not None:
            return self.drivers[0].slots[0].outer_steps
        return -(-self.step_count // self.sync_every)

    def run_rounds(self, rounds: int | None = None, callback: Any = None) -> None:
        """``rounds`` rounds, or (``None``) the rest of the run's ⌈max_steps / H⌉; ``callback(self)``
        after each. With fixed H a round is H calls of ``step`` (fewer where ``max_steps`` ends it);
        under ``sync_seconds`` every replica takes its own steps, as its phase on its clock says."""
        total = None if self.max_steps is None else -(-self.max_steps // self.sync_every)
        if rounds is None:
            if total is None:
                raise ValueError("run_rounds() needs rounds=... or the simulator's max_steps")
            rounds = total - self.rounds_done
        if total is not None and self.rounds_done + rounds > total:
            raise ValueError(f"the run is {total} rounds (max_steps={self.max_steps}, sync_every={self.sync_every}) "
                             f"and {self.rounds_done} are done: {rounds} more do not fit")
        for _ in range(rounds):
            if self.sync_seconds is None:
                end = self.step_count + self.sync_every
                end = end if self.max_steps is None else min(end, self.max_steps)
                while self.step_count < end:
                    self.step()
            else:
                self._paced_round()
            if callback is not None:
                callback(self)

    def _paced_round(self) -> None:
        """Every replica's inner phase on its own clock, then the round's exchanges."""
        assert self.max_steps is not None
        last = [False] * self.num_replicas
        for i, driver in enumerate(self.drivers):
            while True:
                driver.restore_outer_weights()
                self._paced_step(i)
                last[i] = last_step(driver, 0, self.max_steps)  # the driver's count: the run ends on a round
                if driver.round_due(0):
                    break
                driver.after_inner_step(0, last[i])
                self._after_paced_step(i)
        self._exchange(last)
        for i in range(self.num_replicas):
            self._after_paced_step(i)
        self.step_count = max(driver.slots[0].inner_steps for driver in self.drivers)

    def _paced_step(self, i: int) -> None:
        """One optimizer step of replica ``i`` (its batches, clipping, the step) and its modelled time."""
        assert self.time is not None
        if i == 0:
            self.lr_history.append(float(self.optimizers[0].param_groups[0]["lr"]))
        self._replica_grads(i, self.shards[i].draw(self.accumulate_grad_batches))
        if self.gradient_clip_val is not None:
            torch.nn.utils.clip_grad_norm_(self.params[i], self.gradient_clip_val)
        self.optimizers[i].step()
        self.contexts[i].optimizer_stepped()
        self.time.stepped(i)

    def _after_paced_step(self, i: int) -> None:
        """What follows replica ``i``'s step and its round: its scheduler, on the run's nominal progress
        (as on a paced strategy), and the end of its data epoch."""
        nominal = self.drivers[i].nominal_step()
        self.contexts[i].follow_nominal(nominal)
        scheduler = self.schedulers[i]
        if scheduler is not None:
            scheduler.step()
            if lr_schedules.followable(scheduler):  # as the strategies' schedulers catch up with the run
                lr_schedules.catch_up(scheduler, nominal, limit=self.max_steps)
        if self.shards[i].at_epoch_end:
            self.contexts[i].end_epoch()
