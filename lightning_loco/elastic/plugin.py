"""The driver plug-in of an elastic replica: memberships change between rounds, never inside one.

:class:`ElasticPlugin` is a :class:`~lightning_loco.plugins.DriverPlugin` over an
:class:`~lightning_loco.elastic.transport.ElasticTransport`. The driver stays the ordinary
:class:`~lightning_loco.driver.OuterStepDriver` (synchronous rounds, one optimizer); the plug-in:

* before training, takes up the first membership (:meth:`before_training`: waits for the quorum, heals
  if the others are ahead);
* before each round, checks that the round has a membership and tags the exchange with the outer step;
* after each round lands, records it (its group as replica ids, whether it was taken alone or dropped)
  and lets the membership switch, which may heal this replica from a live one or send this replica's
  state to joiners;
* at the end, leaves the membership (the heartbeats stop).

DiLoCo's rounds are one all-reduce over the membership, and every member must keep the same anchor. A
round whose all-reduce fails is *dropped* by the driver (:class:`~lightning_loco.plugins.Outcome`), as
torchft drops a step that cannot commit: the outer state stays as it was and training goes on from the
live weights (the next round's pseudo-gradient covers both stretches of inner steps). A member whose
all-reduce completed while another's failed has one round more: DiLoCo's quorums are asked for at the
switch itself and carry how many rounds of the membership each member committed, and those with fewer
heal from one with the most (:func:`~lightning_loco.elastic.membership.make_plan`).
"""

from __future__ import annotations

import time
from typing import Any

from lightning_loco.elastic.transport import ElasticTransport
from lightning_loco.plugins import DriverPlugin, Landing, Outcome


class ElasticPlugin(DriverPlugin):
    """The elastic replica's side of the driver; see the module docstring. Built from its transport."""

    ends_by_driver_steps = True  # a healed replica took a donor's step count: the run's, not this process's

    def __init__(self, transport: Any) -> None:
        if not isinstance(transport, ElasticTransport):
            raise TypeError(f"ElasticPlugin needs an ElasticTransport, got {type(transport).__name__}")
        self.transport = transport
        self.rounds: list[dict[str, Any]] = []  # per round: its outer step, group (replica ids), alone or not
        self.healed_from: list[dict[str, Any]] = []  # the states this replica took from a live one
        self.exported: list[dict[str, Any]] = []  # the states joiners took from this replica
        self.committed = 0  # rounds of the current membership that completed (compared by DiLoCo's members)
        self.collective = False

    @property
    def membership(self) -> Any:
        return self.transport.membership

    def attach(self, driver: Any) -> None:
        super().attach(driver)
        driver.label = f"Replica {self.transport.config.replica_id!r}"
        self.collective = driver.algorithm.schedule(0, 2).collective
        self.membership.sync = self.collective

    def before_training(self) -> None:
        """Takes up the first membership (waits for the Lighthouse's quorum; heals if the others are ahead)."""
        slots = self.driver.slots
        if len(slots) != 1:
            raise ValueError(
                f"Elastic replicas support one optimizer for now; this model has {len(slots)}. Return one "
                "optimizer from configure_optimizers, or use lighthouse=None."
            )
        self._switch(slots[0].outer_steps)

    def before_round(self, optimizer_index: int, outer_step: int) -> None:
        view = self.membership.view
        if view is None or outer_step < view.first_round:
            raise RuntimeError(f"outer step {outer_step} has no membership (the current one starts at "
                               f"{None if view is None else view.first_round})")
        self.transport.outer_step = outer_step
        group = self.driver.algorithm.schedule(outer_step, self.transport.num_replicas).group_of(self.transport.replica)
        self.rounds.append({"outer_step": outer_step, "quorum_id": view.quorum_id, "time": time.time(),
                            "group": list(self.transport.member_ids(group))})

    def after_landing(self, landing: Landing) -> None:
        self.rounds[-1].update(alone=landing.outcome is not Outcome.EXCHANGED, dropped=landing.outcome is Outcome.DROPPED)
        self.committed += landing.outcome is Outcome.EXCHANGED
        if not landing.final:
            self._switch(self.driver.slots[0].outer_steps)

    def close(self) -> None:
        self.transport.close()  # stops the heartbeats: the Lighthouse counts this replica as gone

    def _switch(self, next_round: int) -> None:
        view = self.membership.view
        if self.membership.due(next_round):
            self.membership.at_switch(next_round, self.export_state, self.load_state,
                                      committed=self.committed if self.collective else None)
        if self.membership.view is not view:
            self.committed = 0

    def export_state(self) -> dict[str, Any]:
        """What a joiner takes from this replica: the driver's state (anchor, outer state, counters) and the
        live weights, between rounds."""
        slots = self.driver.slots
        weights = [slot.flat.gather() for slot in slots]
        self.exported.append({"outer_step": slots[0].outer_steps, "checksum": checksum(weights)})
        return {"driver": self.driver.state_dict(), "weights": weights}

    def load_state(self, state: dict[str, Any], heal: bool) -> int:
        """Takes a donor's state (``heal``) or only its counters; returns the round this replica now stands at."""
        slots = self.driver.slots
        saved = state["driver"]
        if heal:
            self.driver.load_state_dict(saved)
            for slot, weights in zip(slots, state["weights"]):
                slot.flat.scatter(weights.to(slot.state.anchor.device))
        else:
            for slot, entry in zip(slots, saved):
                slot.inner_steps, slot.outer_steps = entry["inner_steps"], entry["outer_steps"]
        self.healed_from.append({"donor": state.get("donor"), "outer_step": slots[0].outer_steps,
                                 "weights": heal, "checksum": checksum([s.flat.gather() for s in slots])})
        return slots[0].outer_steps


def checksum(weights: list[Any]) -> list[float]:
    """Sum and sum of squares of flat weights, in float64: equal for equal weights (a test's fingerprint)."""
    return [float(sum(w.double().sum() for w in weights)), float(sum(w.double().square().sum() for w in weights))]


__all__ = ["ElasticPlugin", "checksum"]
