"""The outer-step driver of an elastic replica: memberships change between rounds, never inside one.

:class:`ElasticDriver` is the ordinary :class:`~lightning_loco.driver.OuterStepDriver` (synchronous rounds,
one optimizer) with two additions: before each round it tags the exchange with the outer step, and after
each round lands (and once before training, :meth:`join`) it lets the membership switch, which may heal
this replica from a live one or send this replica's state to joiners.
"""

from __future__ import annotations

from typing import Any

from lightning_loco.driver import OuterSlot, OuterStepDriver
from lightning_loco.elastic.transport import ElasticTransport


class ElasticDriver(OuterStepDriver):
    """``OuterStepDriver`` over an :class:`ElasticTransport`; see the module docstring."""

    transport: ElasticTransport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.transport, ElasticTransport):
            raise TypeError("ElasticDriver needs an ElasticTransport")
        self.rounds: list[dict[str, Any]] = []  # per round: its outer step, group (replica ids), alone or not
        self.healed_from: list[dict[str, Any]] = []  # the states this replica took from a live one
        self.exported: list[dict[str, Any]] = []  # the states joiners took from this replica

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
        self.membership.at_switch(self.slots[0].outer_steps, self.export_state, self.load_state)

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
        self.rounds.append({"outer_step": t, "quorum_id": view.quorum_id,
                            "group": list(self.transport.member_ids(flight.group))})

    def _land(self, index: int, slot: OuterSlot, final: bool = False) -> None:
        flight = slot.in_flight
        assert flight is not None
        pending = flight.pending
        super()._land(index, slot, final)
        self.rounds[-1]["alone"] = bool(getattr(pending, "alone", False))
        if not final:
            self.membership.at_switch(slot.outer_steps, self.export_state, self.load_state)



def checksum(weights: list[Any]) -> list[float]:
    """Sum and sum of squares of flat weights, in float64: equal for equal weights (a test's fingerprint)."""
    return [float(sum(w.double().sum() for w in weights)), float(sum(w.double().square().sum() for w in weights))]


__all__ = ["ElasticDriver", "ElasticTransport"]
