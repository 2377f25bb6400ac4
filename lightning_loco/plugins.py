"""Public plug-in points of the outer-step driver, and what a landed round's outcome was.

The driver (:mod:`lightning_loco.driver`) runs rounds; a :class:`DriverPlugin` is told around them and
may act between rounds, never inside one. The default plug-in does nothing: the static launch runs
without one. Elastic replicas (:mod:`lightning_loco.elastic.plugin`) use these points to take up
memberships between rounds, heal, and keep their records.

The hooks, in the order a run calls them:

* :meth:`DriverPlugin.attach`: once, when the driver is built;
* :meth:`DriverPlugin.before_training`: once, after the optimizers' slots are added and a resumed
  state is loaded, before the first inner step;
* :meth:`DriverPlugin.before_round`: before round t of an optimizer is posted;
* :meth:`DriverPlugin.after_landing`: after it landed (or was dropped), with its :class:`Landing`;
* :meth:`DriverPlugin.close`: once, when training stops, however it stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_loco.driver import OuterStepDriver


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


class DriverPlugin:
    """Does nothing; subclasses override the hooks they need (see the module docstring)."""

    # Whether the run's end is decided by the driver's count of inner steps rather than by Lightning's
    # loop: a plug-in that changes the counters (a replica that healed took a donor's) sets it.
    ends_by_driver_steps: bool = False

    def attach(self, driver: "OuterStepDriver") -> None:
        self.driver = driver

    def before_training(self) -> None:
        """Before the first inner step (after a resumed state is loaded)."""

    def before_round(self, optimizer_index: int, outer_step: int) -> None:
        """Before round ``outer_step`` of optimizer ``optimizer_index`` is posted."""

    def after_landing(self, landing: Landing) -> None:
        """After a round landed or was dropped."""

    def close(self) -> None:
        """Training stopped (the end of ``fit``, an error or a signal)."""


def no_plugin(transport: object) -> DriverPlugin:
    """The static launch's plug-in factory: a plug-in that does nothing (a module-level function, so that
    strategies that hold it still pickle for spawned ranks)."""
    return DriverPlugin()
