"""A ``Transport`` over the members of the current membership (:mod:`~lightning_loco.elastic.membership`).

Replica indices are ranks in the current membership's sorted list of replica ids, so the algorithms'
schedules draw each round's groups over the live members. Exchanges are point-to-point sends and receives
on the membership's torchft process group, tagged with the outer step (DiLoCo's float32 round is one
all-reduce). Lossy wire formats (bf16, fp16, int8 with or without error feedback) travel as on the static
launch, through the same code (:mod:`~lightning_loco.wire.coded`).

A partner that fails (it died, its link broke, or it sent nothing within ``outer_step_timeout``) does not
stop this replica: the round is finished alone. ``wait()`` then returns the sum as if every member of
the group had sent this replica's payload (``group_size × own``), which the algorithms turn into the
outer step of a group of one: this replica's own weights and pseudo-gradient only.

gloo connects every member of a group to every other, and a connection that breaks fails every
operation in flight on the group of that member; but a member may not hear of a peer's death until it
talks to it. So a replica that sees a failure aborts the membership's group, closing its connections:
any member waiting on it fails at once instead of at its timeout, and does the same. The rest of the
membership's rounds are taken alone, and the next membership comes with a new process group; the
Lighthouse drops a dead replica from it.

A partner that is alive but late (``straggler_timeout``) is left out of that round only, and the group
stays open: see :mod:`~lightning_loco.elastic.straggler`. A round taken alone with a lossy codec applies
this replica's payload as the codec delivers it (slice by slice, as it would have been sent), so that an
error-feedback residual stays true.

A replica of several ranks (``ranks``): each rank moves its own slice on its own group (with the same rank
of the other members) and the replica's ranks all-gather the result, as on the static launch. With FSDP2
inside the replica (``sharded``) each rank's buffer is already its own part of the model (its local
shards): it moves the whole of it and nothing is gathered. Either way the ranks agree on each round's
outcome first, so that the round is the replica's on all of them or on none
(:mod:`~lightning_loco.elastic.ranks`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.membership import Membership, show_info_lines
from lightning_loco.elastic.ranks import ReplicaRanks
from lightning_loco.elastic.straggler import settle
from lightning_loco.elastic.waiting import no_stop
from lightning_loco.elastic.works import CollectivePeer, PeerFailed, PeerWork, wait_all
from lightning_loco.transport.base import FIRST_ROUND, Pending, RoundId, Transport, TransportStats, sum_in_group_order
from lightning_loco.wire import coded
from lightning_loco.wire.codecs import Codec, ring_all_reduce_bytes, roundtrip_segments, segments


class RankOutcome(IntEnum):
    """A round's outcome on one rank; a replica of several ranks takes the least of its ranks'."""

    FAILED = 0  # an exchange failed: the round is taken alone
    LATE = 1  # a partner was late (straggler_timeout): the round is taken alone, the group stays
    TOGETHER = 2  # the group's sum came


class ElasticPending(Pending):
    """An exchange on the membership's process group; a failure, or a late partner under
    ``straggler_timeout``, makes it a round taken alone (``alone``: ``wait()`` gives ``group_size × own
    payload``, the payload as the codec delivers it, and nothing is counted in the stats)."""

    def __init__(self, transport: "ElasticTransport", works: list[PeerWork], payload: Optional[Tensor],
                 finish: Callable[[], Tensor], group_size: int, nbytes: int, peers: tuple[int, ...],
                 alone: bool = False, codec: Optional[Codec] = None, round_id: RoundId = FIRST_ROUND) -> None:
        super().__init__(transport, nbytes, peers)
        self.transport: ElasticTransport = transport
        self.works, self.payload, self.finish, self.group_size = works, payload, finish, group_size
        self.alone, self.codec, self.round_id = alone, codec, round_id
        self.parts: list[tuple[int, int]] = []  # the segments the codec encodes one by one (none: the whole)
        self.error: Optional[BaseException] = None
        self.agreed = False  # a replica of several ranks: its ranks agree on this round's outcome (it was posted)

    def _complete(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def _alone(self) -> Tensor:
        assert self.payload is not None
        own = self.payload if self.codec is None else roundtrip_segments(self.payload, self.codec, self.parts)
        return own.clone() if self.group_size == 1 else own * self.group_size

    def _receive(self) -> Tensor:
        result: Optional[Tensor] = None
        if not self.alone or self.agreed:
            transport, t = self.transport, self.round_id.outer_step
            ranks, straggler_timeout = transport.ranks, transport.config.straggler_timeout
            status = RankOutcome.FAILED if self.alone else RankOutcome.TOGETHER
            told = ranks is None or not self.agreed
            try:
                if self.alone:
                    pass  # posting failed on this rank: its replica's other ranks hear of it below
                elif straggler_timeout is not None and self.peers:
                    together, without, gave_up = settle(transport, self.works, self.peers, self.started, self.round_id,
                                                        straggler_timeout)
                    status = RankOutcome.TOGETHER if together else RankOutcome.LATE
                    if not together:
                        transport.partner_late(without, gave_up, t)
                else:
                    wait_all(self.works)
                if ranks is not None and not told:  # the replica's outcome: the worst of its ranks'
                    agreed, told = RankOutcome(ranks.agree(status)), True
                    if agreed < status:
                        self._heard(agreed)
                    status = agreed
                result = self.finish() if status == RankOutcome.TOGETHER else None
            except PeerFailed as failure:  # this partner failed; the others' transfers still complete
                result, self.error, self.works = None, failure.error, []  # no work left to hold the group open
                failure.__traceback__ = None  # nor frames that hold some (the abort below closes the group)
                peers = self.peers if CollectivePeer.ALL in failure.peers else tuple(failure.peers)
                transport.partner_failed(peers, failure.error, t)
                if ranks is not None and not told:  # the replica's other ranks take the round alone too
                    ranks.agree(RankOutcome.FAILED)
        self.alone = result is None  # taken alone from the start, or now
        self.works = []
        return self._alone() if result is None else result

    def _heard(self, agreed: RankOutcome) -> None:
        """Another rank of this replica took the round alone: this rank does the same, as that rank did."""
        t = self.round_id.outer_step
        if agreed == RankOutcome.LATE:
            self.transport.partner_late(self.peers, False, t)
        else:
            why = RuntimeError("an exchange of another rank of this replica failed")
            self.transport.partner_failed(self.peers, why, t)

    def abandon(self, timeout: float) -> bool:
        """Gives the exchange up to ``timeout`` seconds, then drops it; returns whether it finished (every
        operation ended, none failed). A thread waits on each operation still open (a gloo work tells its end
        only to a waiter, and a wait of its own timeout would close the group): each ends with its operation,
        or when the membership's group is closed."""
        works, self.works = self.works, []
        if self._result is not None or not works:
            return True
        deadline = time.perf_counter() + timeout
        for work in works:
            work.watch()
        return all(work.succeeded(deadline - time.perf_counter()) for work in works)


class ElasticTransport(Transport):
    """``Transport`` of one elastic replica (one process, or one rank of a replica of several: ``ranks``).
    ``replica`` and ``num_replicas`` describe the current membership;
    :class:`~lightning_loco.elastic.plugin.ElasticPlugin` switches memberships.

    ``membership``: the agreement this transport follows (default: a :class:`Membership` over the
    Lighthouse of ``config``). Anything with its ``view``, ``due``, ``at_switch``, ``failed`` and
    ``close`` serves: tests pass an in-process one, whose views carry an in-process process group.
    ``check_stop`` goes to the default membership (see :class:`Membership`).

    Lossy wire formats travel as on the static launch (:mod:`~lightning_loco.wire.coded`): this
    transport is a :class:`~lightning_loco.transport.base.PointToPoint` one. Each round's exchanges are
    tagged with the round's outer step, which the caller passes to ``start_*``."""

    may_go_alone = True  # a partner that fails leaves this replica to finish the round alone

    def __init__(self, config: ElasticConfig, device: Optional[torch.device] = None,
                 membership: Optional[Any] = None, check_stop: Callable[[str], None] = no_stop,
                 ranks: Optional[ReplicaRanks] = None, sharded: bool = False) -> None:
        self.config = config
        self.sharded = sharded  # FSDP2 inside the replica: each rank's buffer is its own shards, moved whole
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.ranks = ranks
        self.membership = Membership(config, check_stop, ranks) if membership is None else membership
        self.stats = TransportStats()
        self.failures: list[dict[str, Any]] = []  # rounds finished alone because a partner failed
        self.late: list[dict[str, Any]] = []  # rounds taken alone because a partner was late (straggler_timeout)
        self._posted_in_round = 0  # exchanges posted so far in the round being posted (a codec's all-reduce: two)
        self._lingering: list[tuple[Any, PeerWork]] = []  # left to a late partner, with their process group

    @property
    def slices_per_replica(self) -> int:
        """How many slices a payload is cut into, one per rank of the replica (1: it moves whole)."""
        return 1 if self.ranks is None or self.sharded else self.ranks.size

    @property
    def replica(self) -> int:  # type: ignore[override]  # the Transport protocol's attribute, computed here
        view = self.membership.view
        return view.rank if view is not None else 0

    @property
    def num_replicas(self) -> int:  # type: ignore[override]  # (as replica)
        view = self.membership.view
        return len(view.members) if view is not None else 1

    def member_ids(self, ranks: Sequence[int]) -> tuple[str, ...]:
        view = self.membership.view
        return tuple(view.members[j] for j in ranks) if view is not None else (self.config.name,)

    def partner_failed(self, peers: Sequence[int], err: Optional[BaseException], outer_step: int) -> None:
        """Records outer step ``outer_step`` finished alone because ``peers`` failed, and aborts the group."""
        ids = self.member_ids(peers)
        self.failures.append({"outer_step": outer_step, "peers": list(ids), "error": str(err)[:200],
                              "time": time.time()})
        self._lingering = []  # their works would hold the group's connections open after the abort
        self.membership.failed()
        warnings.warn(
            f"Replica {self.config.replica_id!r}: outer step {outer_step} could not complete with {list(ids)} "
            f"({str(err).splitlines()[0][:160]}); this replica finished the round alone, and the next membership "
            "leaves out a replica that died.",
            stacklevel=3,
        )

    def partner_late(self, peers: Sequence[int], gave_up: bool, outer_step: int) -> None:
        """Records outer step ``outer_step`` taken alone under ``straggler_timeout``: this replica gave up on
        ``peers`` (late), or they gave up on it. The membership's group stays: they meet again next round."""
        self.late.append({"outer_step": outer_step, "peers": list(self.member_ids(peers)), "gave_up": gave_up,
                          "time": time.time()})

    def linger(self, works: Sequence[PeerWork]) -> None:
        """Keeps operations that a late partner completes when it reaches their round (their buffers must live
        until then)."""
        view = self.membership.view
        self._lingering += [(view.pg if view is not None else None, w) for w in works]

    def _group(self) -> Any:
        """The current membership's process group; :class:`PeerFailed` if it has none or a failure broke it."""
        view = self.membership.view
        if view is None or view.pg is None or not view.ok:
            raise PeerFailed([CollectivePeer.ALL], RuntimeError("the membership's process group is closed"))
        return view.pg

    def exchange(self, sends: dict[int, Tensor], receives: dict[int, Tensor], round_id: RoundId = FIRST_ROUND,
                 decision: bool = False) -> list[PeerWork]:
        """Posts point-to-point receives, then sends, with members j of the current membership; each exchange
        of a round has its own tag: the round's outer step, and the exchange's place in the round (the
        straggler decision, ``decision``, the last place of all)."""
        pg = self._group()
        place = 15 if decision else self._posted_in_round
        self._posted_in_round += not decision
        tag = (round_id.outer_step % (1 << 26)) * 16 + place
        try:
            works = [PeerWork(j, pg.recv([buf], j, tag)) for j, buf in receives.items()]
            return works + [PeerWork(j, pg.send([buf], j, tag)) for j, buf in sends.items()]
        except RuntimeError as err:  # gloo may fail at once when a peer is already gone
            # without its frames, which hold the works posted so far (and so the group's connections open)
            raise PeerFailed(sorted(set(sends) | set(receives)), err.with_traceback(None)) from None

    def pending(self, works: list[Any], finish: Callable[[], Tensor], nbytes: int,
                peers: tuple[int, ...]) -> ElasticPending:
        return ElasticPending(self, works, None, finish, len(peers) + 1, nbytes, peers)

    def slice(self, buf: Tensor) -> Tensor:
        return buf if self.ranks is None or self.sharded else self.ranks.slice(buf)

    def gather_slices(self, part: Tensor, like: Tensor) -> Tensor:
        return part if self.ranks is None or self.sharded else self.ranks.gather(part, like)

    def _start(self, payload: Tensor, others: tuple[int, ...], size: int, codec: Optional[Codec],
               post: Callable[[], ElasticPending], round_id: RoundId, chunks: int = 1) -> ElasticPending:
        """Posts a round's exchange with ``post`` on the membership's group, or makes it a round alone: the
        group is closed (until the next membership) or posting failed (gloo may fail at once when a peer is
        already gone). ``chunks``: the parts each slice is encoded in (an all-reduce: one per member), which a
        round alone delivers as the exchange would."""
        view = self.membership.view
        alone = ElasticPending(self, [], payload, payload.clone, size, 0, others, alone=True, codec=codec,
                               round_id=round_id)
        # a lossy round encodes slice by slice (and chunk by chunk in an all-reduce): alone, the same segments
        alone.parts = segments(payload.numel(), self.slices_per_replica, chunks) if codec is not None else []
        if view is None or view.pg is None or not view.ok:
            return alone
        self._lingering = [(pg, w) for pg, w in self._lingering if pg is view.pg and not w.is_completed()]
        self._posted_in_round = 0
        try:
            pending = post()
        except PeerFailed as failure:
            alone.error, alone.agreed = failure.error, True  # the replica's other ranks may have posted
            self.partner_failed(others, failure.error, round_id.outer_step)
            return alone
        pending.payload, pending.group_size, pending.codec, pending.agreed = payload, size, codec, True
        pending.round_id, pending.parts = round_id, alone.parts
        return pending

    def resolved(self, total: Tensor, peers: tuple[int, ...] = ()) -> ElasticPending:
        return ElasticPending(self, [], total, lambda: total, 1, 0, peers).completed_with(total)

    def start_group_sum(self, payload: Tensor, group: Sequence[int], codec: Optional[Codec] = None,
                        round_id: RoundId = FIRST_ROUND) -> ElasticPending:
        if self.replica not in group:
            raise ValueError(f"replica {self.replica} is not in the group {tuple(group)}")
        others = tuple(j for j in group if j != self.replica)
        if not others:
            return ElasticPending(self, [], payload, payload.clone, 1, 0, (), round_id=round_id)
        lossy = codec if codec is not None and codec.lossy else None

        def post() -> ElasticPending:
            if lossy is not None:
                pending = coded.start_group_sum(self, payload, group, list(others), lossy, round_id)
                assert isinstance(pending, ElasticPending)
                return pending
            send = self.slice(payload.detach().to(self.device)).contiguous()
            received = {j: torch.empty_like(send) for j in others}
            works = self.exchange(dict.fromkeys(others, send), received, round_id)

            def finish() -> Tensor:
                received[self.replica] = send
                return self.gather_slices(sum_in_group_order(received, group), payload).to(payload.device)

            return self.pending(works, finish, send.numel() * send.element_size() * len(others), others)

        return self._start(payload, others, len(group), lossy, post, round_id)

    def start_all_reduce_sum(self, payload: Tensor, codec: Optional[Codec] = None,
                             round_id: RoundId = FIRST_ROUND) -> ElasticPending:
        """One all-reduce over the current membership (DiLoCo); the sum lands in ``payload``. If it fails the
        pending is ``alone`` and the driver drops the round (see :class:`~lightning_loco.driver.plugins.Outcome`).
        A lossy ``codec``: the static launch's all-to-all of encoded chunks and all-gather."""
        n = self.num_replicas
        others = tuple(j for j in range(n) if j != self.replica)
        if not others:
            return ElasticPending(self, [], payload, lambda: payload, 1, 0, (), round_id=round_id)
        lossy = codec if codec is not None and codec.lossy else None

        def post() -> ElasticPending:
            if lossy is not None:
                pending = coded.start_all_reduce_sum(self, payload, lossy, round_id)
                assert isinstance(pending, ElasticPending)
                return pending
            buf = payload.detach().to(self.device)
            part = self.slice(buf)  # a view: summed in place
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs: RedOpType
            work = PeerWork(CollectivePeer.ALL, self._group().allreduce([part], options))

            def finish() -> Tensor:
                whole = self.gather_slices(part, buf)
                if whole.data_ptr() != payload.data_ptr():
                    payload.copy_(whole.view_as(payload))
                return payload

            return self.pending([work], finish, ring_all_reduce_bytes(part.numel() * part.element_size(), n), others)

        chunks = 1 if lossy is not None and lossy.gathers else n  # a sparse format is gathered whole
        return self._start(payload, others, n, lossy, post, round_id, chunks=chunks)

    def close(self) -> None:
        self._lingering = []
        self.membership.close()


class ElasticTransportFactory:
    """The strategies' ``transport_factory`` in elastic mode: takes ``TorchDistributedTransport``'s keyword
    arguments (``device``, and ``ranks_per_replica`` with ``replica_group`` for a replica of several ranks,
    ``sharded`` with FSDP2 inside it) and ``check_stop``, and builds an :class:`ElasticTransport`.
    ``membership`` (tests): builds the membership in place of a :class:`Membership` over the Lighthouse."""

    def __init__(self, config: ElasticConfig, membership: Optional[Callable[[], Any]] = None) -> None:
        self.config = config
        self.membership = membership

    def __call__(self, device: Optional[torch.device] = None, check_stop: Callable[[str], None] = no_stop,
                 ranks_per_replica: int = 1, replica_group: Optional[Any] = None, sharded: bool = False,
                 **_: Any) -> ElasticTransport:
        show_info_lines()  # what happens to the replica (joins, heals, memberships) is said at INFO level
        ranks = ReplicaRanks(self.config.name, replica_group, device) if ranks_per_replica > 1 else None
        membership = self.membership() if self.membership is not None else None
        return ElasticTransport(self.config, device, membership, check_stop, ranks, sharded=sharded)
