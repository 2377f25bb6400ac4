"""Public plug-in points of the outer-step driver, and what a landed round's outcome was.

The driver (:mod:`lightning_loco.driver.driver`) runs rounds; a :class:`DriverPlugin` is told around them and
may act between rounds, never inside one. The default plug-in does nothing: the static launch runs
without one. Elastic replicas (:mod:`lightning_loco.elastic.plugin`) use these points to take up
memberships between rounds, heal, and keep their records.

The hooks, in the order a run calls them:

* :meth:`DriverPlugin.attach`: once, when the driver is built;
* :meth:`DriverPlugin.use_training_state`: once, by whoever runs the inner loop (the Lightning strategy),
  with the parts of the training state that live outside the driver (:class:`TrainingState`);
* :meth:`DriverPlugin.before_training`: once, after the optimizers' slots are added and a resumed
  state is loaded, before the first inner step;
* :meth:`DriverPlugin.between_steps`: by whoever runs the inner loop, before each inner step, where no
  step is half taken (the Lightning strategy: at the start of each training batch);
* :meth:`DriverPlugin.before_round`: before round t of an optimizer is posted, with its schedule;
* :meth:`DriverPlugin.after_landing`: after it landed (or was dropped), with its :class:`Landing`;
* :meth:`DriverPlugin.close`: once, when training stops, however it stops.

:meth:`DriverPlugin.peer_ids` names the peers of each round's report (``OuterStepReport.peer_ids``);
:meth:`DriverPlugin.check_savable` says, before a checkpoint is written, whether the outer state may be.
A plug-in reads the driver it is attached to through :class:`Driver`, the part of
:class:`~lightning_loco.driver.driver.OuterStepDriver` it may use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional, Protocol

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.algorithms.schedules import Round
from lightning_loco.transport.base import Transport
from lightning_loco.wire.codecs import WireFormat


class Driver(Protocol):
    """What a plug-in may read and call of the driver it is attached to."""

    label: str
    algorithm: OuterAlgorithm
    transport: Transport
    wire: Optional[WireFormat]
    slots: list[Any]  # OuterSlot: its flat parameters, outer state and counters
    reports: list[Any]  # OuterStepReport: one per landed round, the last one the landing's

    def state_dict(self) -> list[dict[str, Any]]: ...

    def load_state_dict(self, saved: Sequence[dict[str, Any]]) -> None: ...


class Outcome(str, Enum):
    """How a round ended for this replica."""

    EXCHANGED = "exchanged"  # the group's sum came: the ordinary outer step
    ALONE = "alone"  # the transport finished it without its partners: the outer step of a group of one
    DROPPED = "dropped"  # a collective round finished alone: not applied, the outer state is unchanged


@dataclass(frozen=True)
class Landing:
    """What the driver tells a plug-in about a round that has just landed (or was dropped)."""

    optimizer_index: int
    outer_step: int  # t
    group: tuple[int, ...]  # replica indices of the round's group, this replica included
    outcome: Outcome
    final: bool  # landed as the end of training (no round follows)


@dataclass(frozen=True)
class TrainingState:
    """The parts of a replica's training state that live outside the driver: the inner optimizers' state,
    the learning-rate schedulers, a loss scaler, the training loop's step counters. Given by whoever runs
    the inner loop (the Lightning strategy), so that a plug-in can copy a replica's whole state to another
    without knowing what is inside.

    ``export(optimizers)`` returns it as a dict of tensors and plain values (it must survive ``torch.save``
    and ``torch.load(weights_only=True)``; its tensors may be the live ones, so serialize it at once), as
    it stands between two inner steps; with ``optimizers`` False the inner optimizers' state is left out
    (``None`` in its place). ``load(state, everything)``
    takes it: everything (``True``) or only what counts steps (``False``: the loop's counters and the
    learning-rate schedulers; the optimizers' and scaler's own state stay). ``check(state)``, if given, raises
    before anything of a donor's state is loaded (the driver's included) when this replica cannot take it."""

    export: Callable[[bool], dict[str, Any]]
    load: Callable[[dict[str, Any], bool], None]
    check: Optional[Callable[[dict[str, Any]], None]] = None


class DriverPlugin:
    """Does nothing; subclasses override the hooks they need (see the module docstring)."""

    # Whether the run's end is decided by the driver's count of inner steps rather than by Lightning's
    # loop: a plug-in whose counters can differ from the loop's sets it.
    ends_by_driver_steps: bool = False
    training_state: Optional[TrainingState] = None

    def attach(self, driver: Driver) -> None:
        self.driver = driver

    def use_training_state(self, state: TrainingState) -> None:
        """The training state outside the driver (see :class:`TrainingState`)."""
        self.training_state = state

    def before_training(self) -> None:
        """Before the first inner step (after a resumed state is loaded)."""

    def between_steps(self) -> None:
        """Before an inner step, with no step half taken: the training state is whole here."""

    def before_round(self, optimizer_index: int, outer_step: int, schedule: Round) -> None:
        """Before round ``outer_step`` of optimizer ``optimizer_index`` is posted; ``schedule``: its groups."""

    def after_landing(self, landing: Landing) -> None:
        """After a round landed or was dropped."""

    def close(self) -> None:
        """Training stopped (the end of ``fit``, an error or a signal)."""

    def check_savable(self) -> None:
        """Raises ``RuntimeError`` saying why when the driver's outer state must not be written to a
        checkpoint now (e.g. an elastic heal into it stopped part way)."""

    def peer_ids(self, group: Sequence[int]) -> tuple[str, ...]:
        """The names of this replica's peers in ``group`` (replica indices), for the round's report. The
        static launch names replicas by their index; elastic replicas by their replica id."""
        own = self.driver.transport.replica
        return tuple(str(j) for j in group if j != own)

