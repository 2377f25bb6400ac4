"""The outer-step driver of an elastic replica: memberships change between rounds, never inside one.

:class:`ElasticDriver` is the ordinary :class:`~lightning_loco.driver.OuterStepDriver` (synchronous rounds,
one optimizer) with these additions: before each round it tags the exchange with the outer step, and after
each round lands (and once before training, :meth:`join`) it lets the membership switch, which may heal
this replica from a live one or send this replica's state to joiners.

DiLoCo's rounds are one all-reduce over the membership, and every member must keep the same anchor. A
round whose all-reduce fails is *dropped*, as torchft drops a step that cannot commit: the outer state
stays as it was and training goes on from the live weights (the next round's pseudo-gradient covers both
stretches of inner steps). A member whose all-reduce completed while another's failed has one round more:
DiLoCo's quorums are asked for at the switch itself and carry how many rounds of the membership each
member committed, and those with fewer heal from one with the most
(:func:`~lightning_loco.elastic.membership.make_plan`).
"""

from __future__ import annotations

import time
from typing import Any

from lightning_loco.driver import OuterSlot, OuterStepDriver
from lightning_loco.elastic.transport import ElasticTransport, ElasticTransportFactory


class ElasticDriver(OuterStepDriver):
    """``OuterStepDriver`` over an :class:`ElasticTransport`; see the module docstring."""

    transport: ElasticTransport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.transport, ElasticTransport):
            raise TypeError("ElasticDriver needs an ElasticTransport")
        self.label = f"Replica {self.transport.config.replica_id!r}"
        self.rounds: list[dict[str, Any]] = []  # per round: its outer step, group (replica ids), alone or not
        self.healed_from: list[dict[str, Any]] = []  # the states this replica took from a live one
        self.exported: list[dict[str, Any]] = []  # the states joiners took from this replica
        self.committed = 0  # rounds of the current membership that completed (compared by DiLoCo's members)
        self.collective = self.algorithm.schedule(0, 2).collective
        self.transport.membership.sync = self.collective

    @property
    def membership(self) -> Any:
        return self.transport.membership

    def join(self) -> None:
        """Takes up the first membership (waits for the Lighthouse's quorum; heals if the others are ahead)."""
        if len(self.slots) != 1:
            raise ValueError(
                f"Elastic replicas support one optimizer for now; this model has {len(self.slots)}. Return one "
                "optimizer from configure_optimizers, or use lighthouse=None."
            )
        self._switch(self.slots[0].outer_steps)

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
        weights = [slot.flat.gather() for slot in self.slots]
        self.exported.append({"outer_step": self.slots[0].outer_steps, "checksum": checksum(weights)})
        return {"driver": self.state_dict(), "weights": weights}

    def load_state(self, state: dict[str, Any], heal: bool) -> int:
        """Takes a donor's state (``heal``) or only its counters; returns the round this replica now stands at."""
        saved = state["driver"]
        if heal:
            self.load_state_dict(saved)
            for slot, weights in zip(self.slots, state["weights"]):
                slot.flat.scatter(weights.to(slot.state.anchor.device))
        else:
            for slot, entry in zip(self.slots, saved):
                slot.inner_steps, slot.outer_steps = entry["inner_steps"], entry["outer_steps"]
        self.healed_from.append({"donor": state.get("donor"), "outer_step": self.slots[0].outer_steps,
                                 "weights": heal, "checksum": checksum([s.flat.gather() for s in self.slots])})
        return self.slots[0].outer_steps

    def _start(self, index: int, slot: OuterSlot, tau: int) -> None:
        view = self.membership.view
        t = slot.outer_steps
        if view is None or t < view.first_round:
            raise RuntimeError(f"outer step {t} has no membership (the current one starts at "
                               f"{None if view is None else view.first_round})")
        self.transport.outer_step = t
        super()._start(index, slot, tau)
        flight = slot.in_flight
        assert flight is not None
        self.rounds.append({"outer_step": t, "quorum_id": view.quorum_id, "time": time.time(),
                            "group": list(self.transport.member_ids(flight.group))})

    def _land(self, index: int, slot: OuterSlot, final: bool = False) -> None:
        flight = slot.in_flight
        assert flight is not None
        pending = flight.pending
        if self.collective and len(flight.group) > 1:
            pending.wait()  # a failed all-reduce shows here
        alone = pending.alone
        if alone and self.collective and len(flight.group) > 1:
            slot.in_flight = None  # dropped: outer state unchanged, training goes on from the live weights
            self.rounds[-1].update(alone=True, dropped=True)
        else:
            super()._land(index, slot, final)
            alone = pending.alone  # known once waited for
            self.rounds[-1].update(alone=alone, dropped=False)
            self.committed += not alone
        if not final:
            self._switch(slot.outer_steps)



def checksum(weights: list[Any]) -> list[float]:
    """Sum and sum of squares of flat weights, in float64: equal for equal weights (a test's fingerprint)."""
    return [float(sum(w.double().sum() for w in weights)), float(sum(w.double().square().sum() for w in weights))]


__all__ = ["ElasticDriver", "ElasticTransport", "ElasticTransportFactory"]
