"""The driver plug-in of an elastic replica: memberships change between rounds, never inside one.

:class:`ElasticPlugin` is a :class:`~lightning_loco.driver.plugins.DriverPlugin` over an
:class:`~lightning_loco.elastic.transport.ElasticTransport`. The driver stays the ordinary
:class:`~lightning_loco.driver.driver.OuterStepDriver` (synchronous rounds, one optimizer); the plug-in:

* takes up memberships between rounds: the first before the first inner step, the next ones after the
  rounds that end a membership's stretch (a switch may heal this replica from a live one, or send this
  replica's state to joiners);
* before each round, checks that the round has a membership, and records the round's group as replica ids;
* after each round lands, records whether it was taken alone or dropped (the driver itself drops a
  collective round finished alone, and puts its error-feedback residual back as it was), and counts in its
  report the memberships whose process group could not be set up so far (``membership_errors``);
* at the end, leaves the membership (the heartbeats stop).

**What a joiner takes.** The driver's state (anchor, outer state, counters), the live weights, and the
training state outside the driver that the loop owner gives (:class:`~lightning_loco.driver.plugins.TrainingState`:
the Lightning strategy's inner optimizer, LR schedulers, loss scaler and loop counters), so that a healed
replica steps, logs, checkpoints and stops as its donor does. A switch with a training state waits for the
loop owner's next :meth:`between_steps` (Lightning: the start of the next training batch), where both the
donor's and the joiner's states stand at the same point of a step; without one (the driver alone) it
happens at the landing, where the driver's state is whole.

DiLoCo's rounds are one all-reduce over the membership, and every member must keep the same anchor. A
round whose all-reduce fails is *dropped* by the driver (:class:`~lightning_loco.driver.plugins.Outcome`), as
torchft drops a step that cannot commit: the outer state stays as it was and training goes on from the
live weights (the next round's pseudo-gradient covers both stretches of inner steps). A member whose
all-reduce completed while another's failed has one round more: DiLoCo's quorums are asked for at the
switch itself and carry how many rounds of the membership each member committed, and those with fewer
heal from one with the most (:func:`~lightning_loco.elastic.membership.make_plan`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_loco.algorithms.schedules import Round
from lightning_loco.driver.plugins import Driver, DriverPlugin, Landing, Outcome
from lightning_loco.elastic.transport import ElasticTransport

log = logging.getLogger("lightning_loco")


class ElasticPlugin(DriverPlugin):
    """The elastic replica's side of the driver; see the module docstring. Built from its transport.

    A healed replica takes its donor's step counts with the rest of its state, the loop's among them, so the
    run ends where the loop's own ``max_steps`` says: ``ends_by_driver_steps`` stays False."""

    def __init__(self, transport: Any) -> None:
        if not isinstance(transport, ElasticTransport):
            raise TypeError(f"ElasticPlugin needs an ElasticTransport, got {type(transport).__name__}")
        self.transport = transport
        self.rounds: list[dict[str, Any]] = []  # per round: its outer step, group (replica ids), alone or not
        self.healed_from: list[dict[str, Any]] = []  # the states this replica took from a live one
        self.exported: list[dict[str, Any]] = []  # the states joiners took from this replica
        self.committed = 0  # rounds of the current membership that completed (compared by DiLoCo's members)
        self.collective = False
        self._switch_pending = False  # a switch waits for the loop owner's next between_steps
        self._healing = False  # a heal is receiving into this replica's own outer state (see receive_into)
        self.torn: Optional[str] = None  # why the outer state cannot be saved: a heal into it did not complete

    @property
    def membership(self) -> Any:
        return self.transport.membership

    def attach(self, driver: Driver) -> None:
        super().attach(driver)
        driver.label = f"Replica {self.transport.config.replica_id!r}"
        self.collective = driver.algorithm.collective
        self.membership.sync = self.collective

    def before_training(self) -> None:
        """Takes up the first membership (waits for the Lighthouse's quorum; heals if the others are ahead):
        here, or with a training state at the first :meth:`between_steps`. One optimizer (the rule
        ``elastic-one-optimizer`` of :mod:`lightning_loco.replica.options` refuses more when fit starts)."""
        if len(self.driver.slots) != 1:
            raise RuntimeError(f"elastic replicas run one optimizer, this driver has {len(self.driver.slots)}")
        self._switch_soon()

    def between_steps(self) -> None:
        """Takes up the next membership if a switch waits (see the module docstring)."""
        if self._switch_pending:
            self._switch_pending = False
            self._switch(self.driver.slots[0].outer_steps)

    def _switch_soon(self) -> None:
        if self.training_state is None:
            self._switch(self.driver.slots[0].outer_steps)
        else:
            self._switch_pending = True

    def before_round(self, optimizer_index: int, outer_step: int, schedule: Round) -> None:
        if self._switch_pending:
            raise RuntimeError(
                f"outer step {outer_step} starts before the membership switch that precedes it: the loop that gave "
                "this replica's training state must call between_steps() before every inner step (elastic replicas "
                "take one optimizer step per training batch)."
            )
        view = self.membership.view
        if view is None or outer_step < view.first_round:
            raise RuntimeError(f"outer step {outer_step} has no membership (the current one starts at "
                               f"{None if view is None else view.first_round})")
        group = schedule.group_of(self.transport.replica)
        self.rounds.append({"outer_step": outer_step, "quorum_id": view.quorum_id, "time": time.time(),
                            "group": list(self.transport.member_ids(group))})

    def after_landing(self, landing: Landing) -> None:
        if landing.outcome is not Outcome.DROPPED:  # a dropped round leaves no report (the next one counts)
            reports = self.driver.reports  # the landing's report, just left: it counts the groups that failed so far
            errors = len(getattr(self.membership, "group_errors", ()))
            reports[-1] = dataclasses.replace(reports[-1], membership_errors=errors)
        self.rounds[-1].update(alone=landing.outcome is not Outcome.EXCHANGED,
                               dropped=landing.outcome is Outcome.DROPPED)
        self.committed += landing.outcome is Outcome.EXCHANGED
        if landing.outcome is not Outcome.EXCHANGED and len(landing.group) > 1:
            self._say_alone(landing)
        if not landing.final:
            self._switch_soon()

    def _say_alone(self, landing: Landing) -> None:
        """One log line for a round this replica took without the partners the schedule gave it."""
        t, view = landing.outer_step, self.membership.view
        failures = [f for f in self.transport.failures if f["outer_step"] == t]
        late = [x for x in self.transport.late if x["outer_step"] == t]
        timeout = self.transport.config.straggler_timeout
        if late and late[-1]["gave_up"]:
            why = f"{late[-1]['peers']} not at the exchange within straggler_timeout={timeout:g} s (still members)"
        elif late:
            why = f"{late[-1]['peers']} gave up waiting for this replica (straggler_timeout={timeout:g} s)"
        elif failures:
            why = f"the exchange with {failures[-1]['peers']} failed"
        elif view is not None and view.pg is None:
            why = "this membership has no process group (its rendezvous failed)"
        else:
            why = "an exchange of this membership failed earlier, and its process group is closed"
        dropped = landing.outcome is Outcome.DROPPED
        what = "dropped (not applied: the outer state is unchanged)" if dropped else "taken alone"
        log.info("Replica %r: outer step %d %s, without %s: %s.", self.transport.config.replica_id, t, what,
                 list(self.peer_ids(landing.group)), why)

    def close(self) -> None:
        self.transport.close()  # stops the heartbeats: the Lighthouse counts this replica as gone

    def check_savable(self) -> None:
        if self.torn is not None:  # a heal into the outer state stopped part way: nothing of it is written
            raise RuntimeError(self.torn)

    def peer_ids(self, group: Sequence[int]) -> tuple[str, ...]:
        """The replica ids of this replica's peers in ``group`` (indices into the current membership)."""
        own = self.transport.replica
        return self.transport.member_ids([j for j in group if j != own])

    def _switch(self, next_round: int) -> None:
        view = self.membership.view
        if self.membership.due(next_round):
            try:
                self.membership.at_switch(next_round, self.export_state, self.load_state,
                                          committed=self.committed if self.collective else None,
                                          receive_into=self.receive_into)
            except BaseException:
                if self._healing:
                    self.torn = (f"Replica {self.transport.config.replica_id!r}'s outer state was partly overwritten "
                                 "by a heal that did not complete, so it is not saved; restart the replica (it heals "
                                 "again) or resume from an earlier checkpoint.")
                raise
        if self.membership.view is not view:
            self.committed = 0

    def export_state(self) -> dict[str, Any]:
        """What a joiner takes from this replica: the driver's state (anchor, outer state, counters), the live
        weights and the training state outside the driver (``extra``: None without one), between rounds."""
        slots = self.driver.slots
        weights = [slot.flat.gather() for slot in slots]
        heal_optimizer = self.transport.config.heal_optimizer
        extra = self.training_state.export(heal_optimizer) if self.training_state is not None else None
        # Between rounds the live weights are usually the anchor just set (τ = 0: the landing writes it into the
        # parameters), bitwise: then they travel once, as the anchor, and None stands in their place.
        sent = [None if same(w, slot.state.anchor) else w for w, slot in zip(weights, slots)]
        self.exported.append({"outer_step": slots[0].outer_steps, "inner_steps": slots[0].inner_steps,
                              "checksum": checksum(weights), "extra_checksum": checksum(tensors_in(extra)),
                              "weights_sent": [w is not None for w in sent]})
        return {"driver": self.driver.state_dict(), "weights": sent, "extra": extra}

    def receive_into(self, skeleton: dict[str, Any]) -> dict[str, Any]:
        """Before a whole-state heal's tensors cross: checks the donor's training state (its placeholders'
        skeleton, e.g. a donor sharded otherwise is refused here) and returns this replica's driver state,
        whose outer-state tensors the donor's are received into in place (they are overwritten anyway)."""
        self._check_donor(skeleton.get("extra"))
        self._healing = True  # until load_state completes
        return {"driver": self.driver.state_dict()}

    def _check_donor(self, extra: Any, donor: Any = None) -> None:
        """Raises before anything is loaded when this replica cannot take a donor's training state ``extra``
        (or its skeleton): one kind of replica runs under a training loop and the other not, or the training
        state's own check refuses it (e.g. a donor sharded otherwise)."""
        if (extra is None) != (self.training_state is None):
            raise RuntimeError(
                f"Replica {self.transport.config.replica_id!r} and its donor{f' {donor!r}' if donor else ''} do not "
                "hold the same kind of training state (one runs under a training loop that gives one, the other "
                "not); run every replica the same way."
            )
        if extra is not None and self.training_state is not None and self.training_state.check is not None:
            self.training_state.check(extra)

    def load_state(self, state: dict[str, Any], heal: bool) -> int:
        """Takes a donor's state (``heal``) or only its step counts (the driver's, and the training state's:
        see :class:`~lightning_loco.driver.plugins.TrainingState`); returns the round this replica now stands at."""
        slots = self.driver.slots
        saved, extra = state["driver"], state.get("extra")
        self._check_donor(extra, state.get("donor"))
        if heal:
            self.driver.load_state_dict(saved)
            for slot, weights in zip(slots, state["weights"]):  # None: the donor's weights were its anchor
                slot.flat.scatter(slot.state.anchor if weights is None else weights.to(slot.state.anchor.device))
        else:
            for slot, entry in zip(slots, saved):
                slot.inner_steps, slot.outer_steps = entry["inner_steps"], entry["outer_steps"]
        if self.training_state is not None:
            assert extra is not None  # _check_donor: both kinds of replica hold a training state
            self.training_state.load(extra, heal)
        self._healing = False
        self.healed_from.append({"donor": state.get("donor"), "outer_step": slots[0].outer_steps,
                                 "inner_steps": slots[0].inner_steps, "weights": heal,
                                 "checksum": checksum([s.flat.gather() for s in slots]),
                                 "extra_checksum": checksum(tensors_in(extra))})
        return slots[0].outer_steps


def checksum(weights: list[Any]) -> list[float]:
    """Sum and sum of squares of flat weights, in float64: equal for equal weights (a test's fingerprint)."""
    return [float(sum(w.double().sum() for w in weights)), float(sum(w.double().square().sum() for w in weights))]


def same(weights: Any, anchor: Any) -> bool:
    """Whether ``weights`` are bitwise ``anchor``: same dtype, shape and device, equal bytes (so −0.0 is not 0.0
    and a NaN equals itself only with the same payload)."""
    if weights.dtype != anchor.dtype or weights.shape != anchor.shape or weights.device != anchor.device:
        return False
    return bool(torch.equal(weights.contiguous().view(torch.uint8), anchor.contiguous().view(torch.uint8)))


def tensors_in(value: Any) -> list[Any]:
    """The floating-point tensors of a nested dict/list/tuple, in order (for :func:`checksum`)."""
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return [value] if hasattr(value, "is_floating_point") and value.is_floating_point() else []


__all__ = ["ElasticPlugin", "checksum", "tensors_in"]
