"""In-process stand-ins for what an elastic replica gets from torchft: a membership and its process group.

:class:`FakeMembership` follows a fixed script of memberships (who, from which round, who joins and who
donates) instead of asking a Lighthouse; its views carry a :class:`FakeGroup`, a process group with the
``send`` / ``recv`` / ``allreduce`` / ``abort`` calls the elastic transport makes, over a shared
:class:`Hub` in this process. Joiners heal as real ones do (:mod:`~lightning_loco.elastic.state_transfer`): a
header through a :class:`FakeStore`, the tensors over a fake group, every heal checked against the donor's
digests (``verify_heal``). ``Hub.kill(replica_id)`` stands
for a replica that died: exchanges with it fail, as gloo's do when a peer's connection breaks.
Replicas run in threads of their own.

The real :class:`~lightning_loco.elastic.transport.ElasticTransport` and
:class:`~lightning_loco.elastic.plugin.ElasticPlugin` run on top unchanged. :class:`Runner` is one
replica of a tiny problem with its driver (:func:`elastic_runner` builds an elastic one), and
:func:`in_threads` runs replicas in threads of their own.

A replica of several ranks runs its ranks as threads too: :class:`ThreadRanks` is the real
:class:`~lightning_loco.elastic.ranks.ReplicaRanks` with its three operations among the ranks (broadcast,
minimum, all-gather) over a :class:`Room` shared by the replica's threads instead of a process group;
``Room.kill()`` stands for a rank that died (the others' next operation fails, as gloo's does).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_loco.algorithms import NoLoCo
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.elastic import keys
from lightning_loco.elastic import state_transfer as heal
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.membership import View
from lightning_loco.elastic.plugin import ElasticPlugin
from lightning_loco.elastic.ranks import ReplicaRanks
from lightning_loco.elastic.transport import ElasticTransport


class Hub:
    """The wire shared by every fake process group of a run, and the store joiners take headers from."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.cond = threading.Condition()
        self.timeout = timeout
        self.mail: dict[tuple[Any, ...], Tensor] = {}
        self.reduces: dict[tuple[Any, ...], dict[int, Tensor]] = {}
        self.dead: set[str] = set()
        self.aborted: set[int] = set()  # quorum ids whose group a member aborted
        self.store: dict[str, Any] = {}  # what the FakeStores of a run hold

    def kill(self, replica_id: str) -> None:
        with self.cond:
            self.dead.add(replica_id)
            self.cond.notify_all()

    def wait_for(self, ready: Callable[[], bool], broken: Callable[[], Optional[str]]) -> None:
        """Blocks (holding ``cond``) until ``ready()``; raises ``RuntimeError`` when ``broken()`` says why not."""
        remaining = self.timeout
        while not ready():
            why = broken()
            if why:
                raise RuntimeError(why)
            if remaining <= 0:
                raise RuntimeError("timed out")
            self.cond.wait(0.05)
            remaining -= 0.05


class FakeStore:
    """The calls a heal makes on a membership's rendezvous store (``set``, a ``get`` that waits for its key,
    ``add``, ``delete_key``), over a :class:`Hub`, under ``prefix``."""

    def __init__(self, hub: Hub, prefix: str) -> None:
        self.hub, self.prefix = hub, prefix

    def set(self, key: str, value: bytes) -> None:
        with self.hub.cond:
            self.hub.store[self.prefix + key] = value
            self.hub.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.hub.cond:
            self.hub.wait_for(lambda: self.prefix + key in self.hub.store, lambda: None)
            return self.hub.store[self.prefix + key]

    def add(self, key: str, amount: int) -> int:
        with self.hub.cond:
            value = self.hub.store.get(self.prefix + key, 0) + amount
            self.hub.store[self.prefix + key] = value
            return value

    def delete_key(self, key: str) -> bool:
        with self.hub.cond:
            return self.hub.store.pop(self.prefix + key, None) is not None


class FakeWork:
    def __init__(self, hub: Hub, ready: Callable[[], bool], broken: Callable[[], Optional[str]],
                 finish: Callable[[], None] = lambda: None) -> None:
        self.hub, self.ready, self.broken, self.finish = hub, ready, broken, finish
        self._done = False

    def is_completed(self) -> bool:
        """Done, or failed (as gloo's works complete with an error when a peer's connection breaks)."""
        with self.hub.cond:
            return self._done or self.ready() or bool(self.broken())

    def wait(self, timeout: Any = None) -> bool:
        with self.hub.cond:
            if not self._done:
                self.hub.wait_for(self.ready, self.broken)
                self.finish()
                self._done = True
        return True


class FakeGroup:
    """One membership's process group over a :class:`Hub`: ranks are indices into ``members``."""

    def __init__(self, hub: Hub, quorum_id: int, members: Sequence[str], me: str) -> None:
        self.hub, self.quorum_id, self.members, self.me = hub, quorum_id, tuple(members), me
        self.rank = self.members.index(me)
        self.reduce_count = 0

    def _broken(self, peers: Sequence[int]) -> Callable[[], Optional[str]]:
        def why() -> Optional[str]:
            if self.quorum_id in self.hub.aborted:
                return "the process group was aborted"
            gone = [self.members[j] for j in peers if self.members[j] in self.hub.dead]
            return f"connection to {gone} closed" if gone else None
        return why

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> FakeWork:
        with self.hub.cond:
            self.hub.mail[(self.quorum_id, self.rank, dst, tag)] = tensors[0].detach().clone()
            self.hub.cond.notify_all()
        return FakeWork(self.hub, lambda: True, self._broken([dst]))

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> FakeWork:
        key = (self.quorum_id, src, self.rank, tag)

        def finish() -> None:
            tensors[0].copy_(self.hub.mail.pop(key))

        return FakeWork(self.hub, lambda: key in self.hub.mail, self._broken([src]), finish)

    def allreduce(self, tensors: list[Tensor], options: Any = None) -> FakeWork:
        key = (self.quorum_id, self.reduce_count)
        self.reduce_count += 1
        n = len(self.members)
        with self.hub.cond:
            self.hub.reduces.setdefault(key, {})[self.rank] = tensors[0].detach().clone()
            self.hub.cond.notify_all()

        def finish() -> None:
            posted = self.hub.reduces[key]
            total = posted[0].clone()
            for j in range(1, n):
                total.add_(posted[j])
            tensors[0].copy_(total)

        return FakeWork(self.hub, lambda: len(self.hub.reduces[key]) == n,
                        self._broken([j for j in range(n) if j != self.rank]), finish)

    def abort(self) -> None:
        with self.hub.cond:
            self.hub.aborted.add(self.quorum_id)
            self.hub.cond.notify_all()

    def shutdown(self) -> None:
        pass


@dataclass(frozen=True)
class Script:
    """One membership of the script: its members from round ``switch``, who joins and who donates."""

    quorum_id: int
    switch: int
    members: tuple[str, ...]
    joiners: tuple[str, ...] = ()
    donor: Optional[str] = None


class FakeMembership:
    """A membership that follows ``script`` (memberships in order) instead of a Lighthouse."""

    def __init__(self, hub: Hub, replica_id: str, script: Sequence[Script], heal: bool = True,
                 chunk_bytes: int = heal.CHUNK_BYTES) -> None:
        self.hub, self.replica_id, self.heal, self.chunk_bytes = hub, replica_id, heal, chunk_bytes
        self.script = [s for s in script if replica_id in s.members]
        self.view: Optional[View] = None
        self.sync = False
        self.history: list[dict[str, Any]] = []
        self.failures = 0
        self.closed = False
        self.group_errors: list[dict[str, Any]] = []  # as Membership's: groups that could not be set up
        self.landed = 0  # tensors the last heal received in place

    def _next(self) -> Optional[Script]:
        taken = len(self.history)
        return self.script[taken] if taken < len(self.script) else None

    def due(self, next_round: int) -> bool:
        plan = self._next()
        return self.view is None or (plan is not None and next_round >= plan.switch)

    def at_switch(self, next_round: int, export: Callable[[], dict[str, Any]],
                  load: Callable[[dict[str, Any], bool], int], committed: Optional[int] = None,
                  receive_into: Optional[Callable[[Any], Any]] = None) -> int:
        plan = self._next()
        if plan is None:
            return next_round
        head = heal.header(plan.quorum_id, plan.switch, plan.joiners, plan.donor or "")
        store, key = FakeStore(self.hub, f"q{plan.quorum_id}/s{plan.switch}/"), keys.heal_key(plan.joiners)
        # the heal travels on a group of its own, donor first: a script may let a donor train on alone (or
        # finish) before its joiner starts; the fake wire keeps what was sent until it is received
        roster = (plan.donor or "", *plan.joiners)
        if self.replica_id in plan.joiners:
            via = FakeGroup(self.hub, ("heal", plan.quorum_id), roster, self.replica_id)
            incoming = heal.Incoming(heal.take(store, key, len(plan.joiners)), head, self.replica_id)
            into = None  # as a membership does: a whole-state heal lands in the joiner's own outer state
            if self.heal and receive_into is not None and incoming.skeleton is not None:
                into = heal.in_place(incoming.skeleton, receive_into(incoming.skeleton), incoming.metas)
            self.landed = len(into or ())
            next_round = load(incoming.receive(via, 0, self.hub.timeout, into), self.heal)
        elif plan.donor == self.replica_id:
            via = FakeGroup(self.hub, ("heal", plan.quorum_id), roster, self.replica_id)
            outgoing = heal.prepare(export(), head, chunk_bytes=self.chunk_bytes, verify=True)  # checked
            outgoing.send(via, store, key, range(1, len(roster)), self.hub.timeout)
        group = FakeGroup(self.hub, plan.quorum_id, plan.members, self.replica_id)
        self.view = View(plan.quorum_id, plan.members, plan.members.index(self.replica_id), plan.switch, group)
        self.history.append({"quorum_id": plan.quorum_id, "first_round": plan.switch, "members": list(plan.members)})
        return next_round

    def failed(self) -> None:
        self.failures += 1
        if self.view is not None and self.view.ok:
            self.view.ok = False
            self.view.pg.abort()

    def close(self) -> None:
        self.closed = True


def flat_of(values: Sequence[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(list(values), dtype=torch.float32))


# ---------------------------------------------------------------- replicas of a tiny problem, driven in threads


CPU = torch.device("cpu")
H = 3


class Runner:
    """One replica: a parameter pulled towards its own target by plain steps, and its driver. ``size``: a
    parameter of that many values and its target drawn from a generator seeded by ``index`` (default: three
    fixed values)."""

    def __init__(self, index: int, transport, plugin=None, algorithm=None, wire=None, size: int = 0) -> None:
        self.param = flat_of([float(index), 1.0 - index, 0.5 * index])
        self.target = torch.tensor([2.0 + index, -1.0, 3.0 * index])
        if size:
            g = torch.Generator().manual_seed(index)
            self.param = torch.nn.Parameter(torch.randn(size, generator=g))
            self.target = torch.randn(size, generator=g)
        algorithm = algorithm if algorithm is not None else NoLoCo()
        self.driver = OuterStepDriver.of(algorithm, transport, H, plugin=plugin, final_outer_step="outer",
                                         wire=wire)
        self.driver.add(FlatParameters([self.param], CPU))
        self.driver.before_training()

    def inner_step(self) -> None:
        with torch.no_grad():
            self.param.sub_(0.25 * (self.param - self.target))

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.inner_step()
            self.driver.after_inner_step(0)


def elastic_runner(hub: Hub, replica_id: str, index: int, script, algorithm=None, wire=None,
                   straggler_timeout=None, size: int = 0) -> Runner:
    config = ElasticConfig(lighthouse="127.0.0.1:1", replica_id=replica_id, straggler_timeout=straggler_timeout)
    transport = ElasticTransport(config, membership=FakeMembership(hub, replica_id, script))
    return Runner(index, transport, ElasticPlugin(transport), algorithm, wire, size)


def in_threads(*jobs) -> None:
    errors: list[BaseException] = []

    def guard(job):
        try:
            job()
        except BaseException as err:  # noqa: BLE001  (handed to the test)
            errors.append(err)

    threads = [threading.Thread(target=guard, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a replica thread hung"
    if errors:
        raise errors[0]


def build_in_threads(*builders):
    """Builds runners in threads (a joiner's ``before_training`` waits for its donor)."""
    built: dict[int, Runner] = {}
    in_threads(*[lambda i=i, b=b: built.__setitem__(i, b()) for i, b in enumerate(builders)])
    return [built[i] for i in range(len(builders))]


class Room:
    """The ranks of one replica as threads: what each put in, and a barrier to meet at."""

    def __init__(self, size: int, timeout: float = 30.0) -> None:
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, once every rank gave its own (``RuntimeError`` when a rank died)."""
        try:
            self.slots[rank] = value
            self.barrier.wait()
            values = list(self.slots)
            self.barrier.wait()
        except threading.BrokenBarrierError as err:
            raise RuntimeError("Connection closed by peer: a rank of the replica died") from err
        return values

    def kill(self) -> None:
        self.barrier.abort()


class ThreadRanks(ReplicaRanks):
    """:class:`ReplicaRanks` for one of a replica's threads (see the module docstring)."""

    def __init__(self, replica_id: str, rank: int, room: Room) -> None:
        self.replica_id, self.group, self.room, self.device = replica_id, None, room, torch.device("cpu")
        self.rank, self.size = rank, len(room.slots)

    def _broadcast(self, value: Any) -> Any:
        return self.room.exchange(self.rank, value)[0]

    def _min(self, value: int) -> int:
        return min(self.room.exchange(self.rank, int(value)))

    def _all_gather(self, part: Tensor, like: Tensor) -> Tensor:
        return torch.cat(self.room.exchange(self.rank, part.clone()))
