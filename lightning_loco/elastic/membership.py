"""The agreed live members of an elastic run, from torchft's Lighthouse.

Time is cut into *memberships*: stretches of outer steps with a fixed, agreed list of members. Every
member of a membership holds the same sorted list of replica ids and its own rank in it, so each round's
groups, drawn from (seed, t) over that list, are the same on every member with no message.

How a membership is agreed, with K = ``membership_every``:

* at each switch (between two rounds: after round s − 1 lands, before the inner steps of round s) a
  member asks the Lighthouse for a quorum in the background, with ``step`` = s and ``current=True``;
* torchft's Lighthouse answers every participant with the same quorum once all live replicas have asked
  (a replica whose heartbeats stopped counts as dead after the Lighthouse's heartbeat timeout);
* the quorum is used at the next switch, K outer steps later, at round s + K: the members wait there
  for it only if it has not come yet. The healthy path adds no wait of its own: the quorum forms while
  the K rounds train;
* DiLoCo's memberships are *synchronous*: the quorum is asked for at the switch and waited for there,
  carrying how many rounds of the membership each member committed (see ``make_plan``);
* a replica that asks with ``current=False`` (it is starting) or with a step below the others' (it fell
  behind) is a *joiner*: at the switch it takes the weights, anchor, outer state and counters of the
  *donor* (the first member, by id, that is not a joiner) through the rendezvous store, and takes part
  from round s + K. With ``heal=False`` it takes only the counters and keeps its own weights (a replica
  resumed from its own checkpoint).

Each membership has its own process group (torchft's reconfigurable ``ProcessGroupGloo``, configured in
the background as soon as the quorum is known, with ``outer_step_timeout`` as its timeout); an
unchanged membership whose members saw no failure keeps its group. A group that cannot be set up (a
member died during the rendezvous) leaves every member of that membership training alone until the next.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_loco.elastic.config import ElasticConfig, require_torchft

log = logging.getLogger("lightning_loco.elastic")
HEARTBEAT_EVERY_S = 0.2


@dataclass(frozen=True)
class Plan:
    """What a quorum means for the next membership (computed alike by every participant)."""

    quorum_id: int
    members: tuple[str, ...]  # sorted replica ids
    switch: int  # the first outer step of the membership
    joiners: tuple[str, ...]
    donor: Optional[str]
    reuse: bool  # same members as their common previous membership, no failure seen: keep its group
    store_address: str  # HOST:PORT/prefix of this membership's rendezvous
    fresh: bool = False  # nobody held a membership before: the run starts
    behind: tuple[str, ...] = ()  # sync only: members that heal to the leader's state (always with weights)


def make_plan(quorum: Any, every: int, previous: Optional["View"], sync: bool = False) -> Plan:
    """The plan every participant of ``quorum`` derives alike (see the module docstring).

    ``sync`` (DiLoCo, whose members must hold the same anchor): the quorum was asked for at the switch
    itself and applies at once; members that committed fewer rounds of their membership than the most are
    *behind* and heal from the first member with the most; at the start of a run all members but the first
    heal from it."""
    parts = sorted(quorum.participants, key=lambda p: p.replica_id)
    data = {p.replica_id: (p.data or {}) for p in parts}
    current = [p for p in parts if data[p.replica_id].get("current")]
    if current:
        base = max(p.step for p in current)
        switch = base if sync else base + every
    else:
        base = max(p.step for p in parts)
        switch = base
    joiners = tuple(
        p.replica_id for p in parts if p.step < base or (current and not data[p.replica_id].get("current"))
    )
    up = [p.replica_id for p in parts if p.replica_id not in joiners]
    behind: tuple[str, ...] = ()
    if sync and up:
        if not current:
            behind = tuple(up[1:])
        else:
            committed = {r: int(data[r].get("committed", 0)) for r in up}
            best = max(committed.values())
            up.sort(key=lambda r: committed[r] < best)  # stable: the first with the most leads
            behind = tuple(r for r in up if committed[r] < best)
        joiners = tuple(sorted(joiners + behind))
    members = tuple(p.replica_id for p in parts)
    views = {data[p.replica_id].get("view", -1) for p in parts}
    reuse = (
        previous is not None and previous.pg is not None and not joiners and views == {previous.quorum_id}
        and members == previous.members and all(data[m].get("ok", False) for m in members)
    )
    store = parts[0].store_address
    return Plan(
        quorum_id=int(quorum.quorum_id), members=members, switch=switch, joiners=joiners,
        donor=up[0] if joiners and up else None, reuse=reuse,
        store_address=f"{store}/lightning_loco/elastic/q{quorum.quorum_id}", fresh=not current, behind=behind,
    )


@dataclass
class View:
    """One membership as this replica holds it."""

    quorum_id: int
    members: tuple[str, ...]
    rank: int
    first_round: int
    pg: Optional[Any]  # torchft ProcessGroupGloo; None: it could not be set up, every round alone
    ok: bool = True  # no exchange failed on its process group so far


@dataclass
class _Request:
    step: int
    current: bool
    thread: threading.Thread
    asked: float = field(default_factory=time.perf_counter)
    result: Optional[tuple[Plan, Optional[Any]]] = None
    error: Optional[BaseException] = None
    ended: Optional[float] = None  # when the request answered or failed


def local_host_for(url: str) -> str:
    """The address of this machine's interface that reaches the Lighthouse (what peers should dial)."""
    host, _, port = url.split("://", 1)[-1].rstrip("/").rpartition(":")
    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class Membership:
    """This replica's side of the agreement: heartbeats, quorum requests, memberships and healing.

    The main thread calls :meth:`at_switch` between rounds; everything that talks to the Lighthouse runs in
    background threads.
    """

    def __init__(self, config: ElasticConfig) -> None:
        require_torchft()
        from torchft.coordination import LighthouseClient

        self.config = config
        self.replica_id = config.replica_id
        connect = timedelta(seconds=min(30.0, config.join_timeout))
        try:
            self._client = LighthouseClient(config.url, connect_timeout=connect)
            self._beat_client = LighthouseClient(config.url, connect_timeout=connect)
        except Exception as err:  # torchft raises its own connection errors
            raise RuntimeError(
                f"Replica {self.replica_id!r} could not reach the Lighthouse at {config.url}: {err}. Start one with "
                "`lightning-loco lighthouse --min-replicas N` and pass the address it prints as lighthouse=HOST:PORT."
            ) from err
        host = local_host_for(config.url)
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=config.join_timeout))
        self.store_address = f"{host}:{self._store.port}"
        self.view: Optional[View] = None
        # DiLoCo: the quorum is asked for at each switch and waited for there (its rounds are global anyway),
        # so that it carries how many rounds each member committed; see make_plan.
        self.sync = False
        self.history: list[dict[str, Any]] = []  # one entry per membership taken up
        self.waits: list[float] = []  # seconds the main thread waited for a quorum, one per switch
        self._request: Optional[_Request] = None
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._heartbeat, name="lightning_loco-heartbeat", daemon=True)
        self._beats.start()

    # ------------------------------------------------------------------ background

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY_S):
            try:
                self._beat_client.heartbeat(self.replica_id, timeout=timedelta(seconds=2))
            except Exception as err:  # a missed beat is retried; the Lighthouse decides who is dead
                log.debug("heartbeat failed: %s", err)

    def _ask(self, step: int, current: bool, committed: Optional[int] = None) -> None:
        request = _Request(step=step, current=current, thread=threading.Thread())
        view = self.view
        data = {"current": current, "view": view.quorum_id if view else -1, "ok": bool(view and view.ok),
                "committed": committed or 0}

        def run() -> None:
            try:
                quorum = self._client.quorum(
                    replica_id=self.replica_id, timeout=timedelta(seconds=self.config.join_timeout),
                    address=self.store_address, store_address=self.store_address, step=step, world_size=1,
                    shrink_only=False, data=data,
                )
                plan = make_plan(quorum, self.config.membership_every, view, self.sync)
                pg = view.pg if plan.reuse and view is not None else self._configure(plan)
                request.result = (plan, pg)
            except BaseException as err:  # handed to the main thread at the switch
                request.error = err
            request.ended = time.perf_counter()

        request.thread = threading.Thread(target=run, name="lightning_loco-quorum", daemon=True)
        self._request = request
        request.thread.start()

    def _configure(self, plan: Plan) -> Optional[Any]:
        """A new process group over the plan's members (a rendezvous in its store); None if it fails."""
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=timedelta(seconds=self.config.outer_step_timeout))
        try:
            pg.configure(f"{plan.store_address}/pg", self.replica_id, plan.members.index(self.replica_id),
                         len(plan.members))
            return pg
        except Exception as err:
            log.warning("Replica %r: the process group of membership %d could not be set up (%s); this membership's "
                        "rounds are taken alone.", self.replica_id, plan.quorum_id, err)
            return None

    # ------------------------------------------------------------------ the main thread, between rounds

    def due(self, next_round: int) -> bool:
        """Whether the switch before round ``next_round`` must take up a new membership."""
        request = self._request
        if self.view is None:
            return True
        if self.sync:
            return next_round >= self.view.first_round + self.config.membership_every
        return request is None or next_round >= request.step + self.config.membership_every

    def at_switch(self, next_round: int, export: Callable[[], dict[str, Any]],
                  load: Callable[[dict[str, Any], bool], int], committed: Optional[int] = None) -> int:
        """Between rounds (before the inner steps of round ``next_round``): takes up the next membership when
        it is due, healing this replica (``load(state, heal)``, which returns the round it now stands at) or
        healing joiners from it (``export()``), and asks for the one after. Returns the next round.

        ``committed`` (DiLoCo, whose members must hold the same anchor): the rounds of the current membership
        this replica committed; members with fewer than the most heal from one with the most, and at the
        start of a run every member heals from the first."""
        if not self.due(next_round):
            return next_round
        if self._request is None:  # the first switch, or every switch of a synchronous membership (DiLoCo)
            self._ask(next_round, current=self.view is not None, committed=committed)
        request = self._request
        assert request is not None
        waited = time.perf_counter()
        request.thread.join(self.config.join_timeout)
        self.waits.append(time.perf_counter() - waited)
        if request.thread.is_alive():
            raise RuntimeError(
                f"Replica {self.replica_id!r} got no membership from the Lighthouse at {self.config.url} within "
                f"join_timeout={self.config.join_timeout:g} s: no answer. Fewer than its --min-replicas replicas are "
                "alive, or the Lighthouse hangs."
            )
        if request.error is not None or request.result is None:
            took = (request.ended or time.perf_counter()) - request.asked
            raise RuntimeError(
                f"Replica {self.replica_id!r} asked the Lighthouse at {self.config.url} for a membership and the "
                f"request failed after {took:.1f} s: {request.error or 'no result'}. The Lighthouse stopped or cannot "
                "be reached; restart it, then this replica."
            ) from request.error
        self._request = None
        plan, pg = request.result
        joiners, donor = plan.joiners, plan.donor
        key = f"heal/{','.join(joiners)}"
        if self.replica_id in joiners:
            state = self._receive_heal(plan, key)
            next_round = load(state, self.config.heal or self.replica_id in plan.behind)
            if next_round != plan.switch:
                raise RuntimeError(f"healed to round {next_round}, expected {plan.switch}")
        elif donor == self.replica_id and joiners:
            self._send_heal(plan, key, export())
        old, self.view = self.view, View(plan.quorum_id, plan.members, plan.members.index(self.replica_id),
                                         plan.switch, pg)
        if old is not None and pg is old.pg:
            self.view.ok = old.ok  # a group a failure broke stays broken
        if old is not None and old.pg is not None and old.pg is not pg:
            old.pg.shutdown()
        self.history.append({
            "time": time.time(), "quorum_id": plan.quorum_id, "members": list(plan.members), "first_round": plan.switch,
            "joiners": list(joiners), "donor": donor, "reused_group": plan.reuse, "group_ok": pg is not None,
        })
        log.info("Replica %r: membership %d from outer step %d: %s", self.replica_id, plan.quorum_id, plan.switch,
                 list(plan.members))
        if not self.sync:
            self._ask(plan.switch, current=True)  # in the background, for the next switch
        return next_round

    def _store_client(self, plan: Plan) -> Any:
        from torchft.process_group import create_store_client

        return create_store_client(plan.store_address, timedelta(seconds=self.config.join_timeout))

    def _send_heal(self, plan: Plan, key: str, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save({**state, "donor": self.replica_id}, buffer)
        self._store_client(plan).set(key, buffer.getvalue())

    def _receive_heal(self, plan: Plan, key: str) -> dict[str, Any]:
        try:
            raw = self._store_client(plan).get(key)
        except Exception as err:
            raise RuntimeError(
                f"Replica {self.replica_id!r} joined membership {plan.quorum_id} but got no state from replica "
                f"{plan.donor!r} within join_timeout={self.config.join_timeout:g} s ({err}); restart it to try again."
            ) from err
        return torch.load(io.BytesIO(raw), weights_only=True)

    def failed(self) -> None:
        """An exchange of the current membership failed: its process group is aborted, which closes this
        replica's connections, so that a member still waiting on one fails at once instead of at its
        timeout (gloo does not always tell every member that a peer died); the rest of the membership's
        rounds are taken alone, and the next membership gets a fresh group."""
        view = self.view
        if view is not None and view.ok:
            view.ok = False
            if view.pg is not None:
                try:
                    view.pg.abort()
                except Exception as err:  # already broken: nothing more to close
                    log.debug("abort failed: %s", err)

    def close(self) -> None:
        """Stops the heartbeats (the Lighthouse then counts this replica as gone) and drops the group."""
        self._stop.set()
        if self.view is not None and self.view.pg is not None:
            self.view.pg.shutdown()
        self.view = None
