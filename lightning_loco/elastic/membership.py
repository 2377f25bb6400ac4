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
  behind) is a *joiner*: at the switch it takes the training state of the *donor* (the first member, by
  id, that is not a joiner): a header through the membership's rendezvous store, the tensors over its
  process group (:mod:`~lightning_loco.elastic.state_transfer`),
  and takes part from round s + K. With ``heal=False`` it takes only the step counts and keeps its own
  weights (a replica resumed from its own checkpoint).

Each membership has its own process group (torchft's reconfigurable ``ProcessGroupGloo``, configured in
the background as soon as the quorum is known, with ``outer_step_timeout`` as its timeout); an
unchanged membership whose members saw no failure keeps its group. A group that cannot be set up (a
member died during the rendezvous) leaves every member of that membership training alone until the next,
and is counted; an error that no new rendezvous cures stops the run
(:mod:`~lightning_loco.elastic.group_setup`).

A replica of several ranks is one member: rank 0 alone talks to the Lighthouse; see
:mod:`~lightning_loco.elastic.ranks` for how the other ranks take part.

Every wait of the main thread (the Lighthouse's first answer, a quorum, the state a joiner heals from) is
taken in short slices, calling ``check_stop`` between them: a signal handler runs there (the Lightning
strategy's stops the replica on SIGTERM), where a wait inside torchft's client would hold it until its
own timeout.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_loco.elastic import data, healing
from lightning_loco.elastic.config import ElasticConfig, require_torchft
from lightning_loco.elastic.group_setup import GroupSetupError, group_setup_failed
from lightning_loco.elastic.keys import group_prefix, rank_prefix
from lightning_loco.elastic.plan import Plan, View, make_plan
from lightning_loco.elastic.ranks import ReplicaRankError, ReplicaRanks, publish, read
from lightning_loco.elastic.waiting import GRACE_S, in_thread, no_stop, wait_in_slices

log = logging.getLogger("lightning_loco")
HEARTBEAT_EVERY_S, HEARTBEAT_TIMEOUT_S = 0.2, 2.0
CLOSE_WAIT_S = 10.0  # how long close() waits for a membership request in flight (see close)


@dataclass
class _Request:
    step: int
    current: bool
    thread: threading.Thread
    asked: float = field(default_factory=time.perf_counter)
    result: Optional[tuple[Plan, Optional[Any]]] = None
    error: Optional[BaseException] = None
    ended: Optional[float] = None  # when the request answered or failed
    doing: str = "waiting for the Lighthouse's quorum"  # what the request is doing now (for timeout messages)


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


def show_info_lines() -> None:
    """Makes this package's INFO lines visible when nothing configured logging (as Lightning does for its own
    logger): an elastic replica says when it joins, heals, changes membership or takes a round alone."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    log.propagate = False


class Membership:
    """This replica's side of the agreement: heartbeats, quorum requests, memberships and healing.

    The main thread calls :meth:`at_switch` between rounds; everything that talks to the Lighthouse runs in
    background threads. ``check_stop(waiting_for)`` is called between the slices of every wait of the main
    thread and may raise to stop it (see the module docstring). ``ranks``: this rank's place in a replica
    of several ranks (None: a replica of one process).
    """

    def __init__(self, config: ElasticConfig, check_stop: Callable[[str], None] = no_stop,
                 ranks: Optional[ReplicaRanks] = None) -> None:
        require_torchft()
        self.config = config
        self.replica_id = config.replica_id
        self.check_stop = check_stop
        self.ranks, self.rank = ranks, ranks.rank if ranks is not None else 0
        self.info = log.info if self.rank == 0 else log.debug  # the replica's rank 0 says what happens
        self._shared_slots: set[tuple[str, str]] = set()  # pairs of members warned about: they read the same data
        self._asked = 0  # quorum requests so far (rank 0 numbers the plans it hands to the other ranks)
        if self.rank == 0:
            host = local_host_for(config.url)
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=config.join_timeout))
            self.store_address = f"{host}:{self._store.port}"
        if ranks is not None:  # before rank 0 connects: the other ranks wait for nothing else
            self.store_address, self._store = ranks.share_store(
                getattr(self, "_store", None), config.join_timeout + config.outer_step_timeout + GRACE_S)
        if self.rank == 0:
            self._client, self._beat_client = self._connect()
        self.view: Optional[View] = None
        # DiLoCo: the quorum is asked for at each switch and waited for there (its rounds are global anyway),
        # so that it carries how many rounds each member committed; see make_plan.
        self.sync = False
        self.history: list[dict[str, Any]] = []  # one entry per membership taken up
        self.waits: list[float] = []  # seconds the main thread waited for a quorum, one per switch
        self.group_errors: list[dict[str, Any]] = []  # memberships whose group could not be set up (transient)
        self._request: Optional[_Request] = None
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._heartbeat, name="lightning_loco-heartbeat", daemon=True)
        if self.rank == 0:  # the Lighthouse hears of the replica from its rank 0 only
            self._beats.start()

    def _connect(self) -> tuple[Any, Any]:
        """torchft's two Lighthouse clients (quorums, heartbeats), built in a thread: a Lighthouse that refuses
        connections keeps torchft retrying until its connect timeout, and the main thread keeps its signals."""
        from torchft.coordination import LighthouseClient

        url = self.config.url
        connect = min(30.0, self.config.join_timeout)

        def clients() -> tuple[Any, Any]:
            timeout = timedelta(seconds=connect)
            return LighthouseClient(url, connect_timeout=timeout), LighthouseClient(url, connect_timeout=timeout)

        started = time.perf_counter()
        thread, box = in_thread(clients, "lightning_loco-connect")
        # torchft gives up after its connect timeout, once per client; the grace covers its last retry
        ended = wait_in_slices(thread, 2 * connect + GRACE_S, self.check_stop, f"the Lighthouse at {url} to answer")
        if "result" in box:
            return box["result"]
        took = time.perf_counter() - started
        why = box.get("error") or "no answer"
        raise RuntimeError(
            f"Replica {self.replica_id!r} could not reach the Lighthouse at {url} (gave up after {took:.1f} s; the "
            f"connect timeout is {connect:g} s, join_timeout capped at 30 s): "
            f"{why if ended else 'torchft did not return'}. Start one with `lightning-loco lighthouse "
            "--min-replicas N` and pass the address it prints as lighthouse=HOST:PORT."
        ) from box.get("error")

    # ------------------------------------------------------------------ background

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY_S):
            try:
                self._beat_client.heartbeat(self.replica_id, timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_S))
            except Exception as err:  # a missed beat is retried; the Lighthouse decides who is dead
                log.debug("heartbeat failed: %s", err)

    def _ask(self, step: int, current: bool, committed: Optional[int] = None) -> None:
        request = _Request(step=step, current=current, thread=threading.Thread())
        view = self.view
        data = {"current": current, "view": view.quorum_id if view else -1, "ok": bool(view and view.ok),
                "committed": committed or 0}
        number, self._asked = self._asked, self._asked + 1

        def run() -> None:
            plan = None
            try:
                if self.ranks is not None and self.rank:  # rank 0 asks; this rank takes its plan
                    request.doing = "waiting for rank 0 of this replica to hand on the Lighthouse's quorum"
                    plan = read(self._store, number, self.ranks)
                else:
                    quorum = self._client.quorum(
                        replica_id=self.replica_id, timeout=timedelta(seconds=self.config.join_timeout),
                        address=self.store_address, store_address=self.store_address, step=step, world_size=1,
                        shrink_only=False, data=data,
                    )
                    plan = make_plan(quorum, self.config.membership_every, view, self.sync)
                    if self.ranks is not None:
                        publish(self._store, number, plan)
                request.doing = f"setting up the process group of membership {plan.quorum_id}"
                pg = view.pg if plan.reuse and view is not None else self._configure(plan)
                request.result = (plan, pg)
            except BaseException as err:  # handed to the main thread at the switch
                request.error = err
                if self.ranks is not None and self.rank == 0 and plan is None:  # the other ranks stop with it
                    publish(self._store, number, error=f"{type(err).__name__}: {err}")
            request.ended = time.perf_counter()

        request.thread = threading.Thread(target=run, name="lightning_loco-quorum", daemon=True)
        self._request = request
        request.thread.start()

    def _configure(self, plan: Plan) -> Optional[Any]:
        """A new process group over the plan's members (a rendezvous in its store); None if it fails for a
        transient reason (:mod:`~lightning_loco.elastic.group_setup`)."""
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=timedelta(seconds=self.config.outer_step_timeout))
        try:
            pg.configure(group_prefix(plan.store_address, self.rank), self.replica_id,
                         plan.members.index(self.replica_id), len(plan.members))
            return pg
        except Exception as err:  # transient: counted, and this membership's rounds are taken alone; else raised
            group_setup_failed(self.config.name, plan.quorum_id, err, self.group_errors)
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
                  load: Callable[[dict[str, Any], bool], int], committed: Optional[int] = None,
                  receive_into: Optional[Callable[[Any], Any]] = None) -> int:
        """Between rounds (before the inner steps of round ``next_round``): takes up the next membership when
        it is due, healing this replica (``load(state, heal)``, which returns the round it now stands at) or
        healing joiners from it (``export()``), and asks for the one after. Returns the next round. ``receive_into``:
        see :func:`~lightning_loco.elastic.healing.take_state`.

        ``committed`` (DiLoCo, whose members must hold the same anchor): the rounds of the current membership
        this replica committed; members with fewer than the most heal from one with the most, and at the
        start of a run every member heals from the first."""
        if not self.due(next_round):
            return next_round
        if self._request is None:  # the first switch, or every switch of a synchronous membership (DiLoCo)
            if self.view is None:
                self.info("Replica %r asks the Lighthouse at %s for a membership (and waits at most %g s).",
                          self.replica_id, self.config.url, self.config.join_timeout)
            self._ask(next_round, current=self.view is not None, committed=committed)
        request = self._request
        assert request is not None
        plan, pg = self._answer(request)
        self._request = None
        if self.ranks is not None and not self.ranks.agree(pg is not None, "agreeing on a membership"):
            if pg is not None and not plan.reuse:  # a rank's group failed: the replica's rounds are all alone
                pg.shutdown()
            pg = None
        if self.replica_id in plan.joiners:
            next_round = healing.take_state(self.heal_side(), plan, pg, load, receive_into)
        elif plan.donor == self.replica_id and plan.joiners:
            healing.hand_state(self.heal_side(), plan, pg, export())
        old, self.view = self.view, View(plan.quorum_id, plan.members, plan.members.index(self.replica_id),
                                         plan.switch, pg)
        if old is not None and pg is old.pg:
            self.view.ok = old.ok  # a group a failure broke stays broken
        if old is not None and old.pg is not None and old.pg is not pg:
            old.pg.shutdown()
        self.history.append({
            "time": time.time(), "quorum_id": plan.quorum_id, "members": list(plan.members), "first_round": plan.switch,
            "joiners": list(plan.joiners), "donor": plan.donor, "reused_group": plan.reuse, "group_ok": pg is not None,
        })
        self._say_membership(old, plan)
        if not self.sync:
            self._ask(plan.switch, current=True)  # in the background, for the next switch
        return next_round

    def _answer(self, request: _Request) -> tuple[Plan, Optional[Any]]:
        """Waits for a quorum request (interruptibly); its error, or a wait past its calls' own timeouts, is
        a ``RuntimeError`` that names the timeout that expired or what failed."""
        config = self.config
        waited = time.perf_counter()
        bound = config.join_timeout + config.outer_step_timeout + GRACE_S  # the request's calls time out first
        done = wait_in_slices(request.thread, bound, self.check_stop,
                              f"a membership from the Lighthouse at {config.url}")
        self.waits.append(time.perf_counter() - waited)
        took = (request.ended or time.perf_counter()) - request.asked
        if isinstance(request.error, (ReplicaRankError, GroupSetupError)):
            raise request.error
        if not done:
            raise RuntimeError(
                f"Replica {self.replica_id!r} got no membership within {bound:g} s of the switch (join_timeout="
                f"{config.join_timeout:g} s + outer_step_timeout={config.outer_step_timeout:g} s + {GRACE_S:g} s): it "
                f"was still {request.doing}. The Lighthouse at {config.url} or a member hangs; restart this replica."
            )
        if isinstance(request.error, TimeoutError) and took >= 0.9 * config.join_timeout:
            raise RuntimeError(
                f"Replica {self.replica_id!r} got no membership from the Lighthouse at {config.url} within "
                f"join_timeout={config.join_timeout:g} s: fewer than its --min-replicas replicas are alive, or the "
                "Lighthouse hangs."
            ) from request.error
        if request.error is not None or request.result is None:
            raise RuntimeError(
                f"Replica {self.replica_id!r} asked the Lighthouse at {config.url} for a membership and the "
                f"request failed after {took:.1f} s: {request.error or 'no result'}. The Lighthouse stopped or cannot "
                "be reached; restart it, then this replica."
            ) from request.error
        return request.result

    def store_client(self, plan: Plan) -> Any:
        """A client of the membership's store under this rank's prefix (its heal keys live there)."""
        from torchft.process_group import create_store_client

        return create_store_client(rank_prefix(plan.store_address, self.rank),
                                   timedelta(seconds=self.config.join_timeout))

    def heal_side(self) -> healing.Side:
        """What this rank lends a heal (:mod:`~lightning_loco.elastic.healing`)."""
        return healing.Side(self.config.name, self.config, self.store_client, self.check_stop, self.info)

    def _say_membership(self, old: Optional[View], plan: Plan) -> None:
        """One log line for a membership whose members changed (DEBUG for an unchanged one)."""
        before = set(old.members) if old is not None else set()
        left, came = sorted(before - set(plan.members)), sorted(set(plan.members) - before)
        if old is not None and not left and not came and not plan.joiners:
            log.debug("Replica %r: membership %d from outer step %d, unchanged.", self.replica_id, plan.quorum_id,
                      plan.switch)
            return
        changes = ([f"left: {left}"] if left and old is not None else []) + (
            [f"joined: {came}"] if came and old is not None else []) + (
            [f"healing from {plan.donor!r}: {list(plan.joiners)}"] if plan.joiners else [])
        self.info("Replica %r: membership %d from outer step %d: %s%s", self.replica_id, plan.quorum_id, plan.switch,
                 list(plan.members), f" ({'; '.join(changes)})" if changes else "")
        config = self.config
        for a, b, slot in data.shared_slots(plan.members, config.data_slots, config.data_slot, config.name):
            if self.replica_id in (a, b) and self.rank == 0 and (a, b) not in self._shared_slots:
                self._shared_slots.add((a, b))
                log.warning("Replicas %r and %r both read data slot %d of %d: they train on the same batches. Give "
                            "each live replica a slot of its own (a replica_id ending in its slot number, or "
                            "data_slot=).", a, b, slot, config.data_slots)

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
        """Stops the heartbeats (the Lighthouse then counts this replica as gone) and drops the group.

        A thread that returns from torchft while the interpreter exits aborts the process ('FATAL: exception not
        rethrown'), so close waits for the heartbeat thread (at most its call's timeout) and for a membership
        request still in flight (the one asked for ahead, at the last switch): when every member ends together,
        as at ``max_steps``, its quorum and group come within moments. It waits at most ``CLOSE_WAIT_S`` for
        it, then shuts down the group it set up."""
        self._stop.set()
        if self._beats.is_alive():
            self._beats.join(HEARTBEAT_TIMEOUT_S + 1.0)
        request, self._request = self._request, None
        if request is not None and request.thread.is_alive():
            request.thread.join(CLOSE_WAIT_S)
            if request.thread.is_alive():
                log.debug("Replica %r closes with its membership request still %s.", self.replica_id, request.doing)
        if request is not None and request.result is not None:
            pg = request.result[1]
            if pg is not None and (self.view is None or pg is not self.view.pg):
                pg.shutdown()
        if self.view is not None:
            self.info("Replica %r left membership %d.", self.replica_id, self.view.quorum_id)
            if self.view.pg is not None:
                self.view.pg.shutdown()
        self.view = None
