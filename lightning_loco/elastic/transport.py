"""A ``Transport`` over the members of the current membership (:mod:`~lightning_loco.elastic.membership`).

Replica indices are ranks in the current membership's sorted list of replica ids, so the algorithms'
schedules draw each round's groups over the live members. Exchanges are point-to-point sends and receives
on the membership's torchft process group, tagged with the outer step.

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
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_loco.codecs import ring_all_reduce_bytes
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.membership import Membership, show_info_lines
from lightning_loco.elastic.waiting import no_stop
from lightning_loco.transport.base import Pending, Transport, TransportStats, sum_in_group_order


class ElasticPending(Pending):
    """An exchange on the membership's process group; a failure makes it a round taken alone (``alone``:
    ``wait()`` gives ``group_size × own payload``, and nothing is counted in the stats)."""

    def __init__(self, transport: "ElasticTransport", works: list[tuple[int, list[Any]]], payload: Tensor,
                 finish: Callable[[], Tensor],
                 group_size: int, nbytes: int, peers: tuple[int, ...], alone: bool = False) -> None:
        super().__init__(transport, nbytes, peers)
        self.works, self.payload, self.finish, self.group_size = works, payload, finish, group_size
        self.alone = alone
        self.error: Optional[BaseException] = None

    def _complete(self) -> bool:
        return all(w.is_completed() for _, works in self.works for w in works)

    def _alone(self) -> Tensor:
        return self.payload.clone() if self.group_size == 1 else self.payload * self.group_size

    def _receive(self) -> Tensor:
        if self.alone:
            result = self._alone()
        else:
            failed: list[int] = []
            for peer, works in self.works:
                try:
                    for work in works:
                        work.wait()
                except RuntimeError as err:  # this partner failed; the others' transfers still complete
                    self.error = err
                    failed.append(peer)
            if failed:
                self.alone = True
                self.transport.partner_failed(self.peers if -1 in failed else failed, self.error)
                result = self._alone()
            else:
                result = self.finish()
        self.works = []
        return result

    def abandon(self, timeout: float) -> bool:
        finished = self.done()
        self.works = []
        return finished


class ElasticTransport(Transport):
    """``Transport`` of one elastic replica (one process). ``replica`` and ``num_replicas`` describe the
    current membership; :class:`~lightning_loco.elastic.plugin.ElasticPlugin` switches memberships.

    ``membership``: the agreement this transport follows (default: a :class:`Membership` over the
    Lighthouse of ``config``). Anything with its ``view``, ``due``, ``at_switch``, ``failed`` and
    ``close`` serves: tests pass an in-process one, whose views carry an in-process process group.
    ``check_stop`` goes to the default membership (see :class:`Membership`)."""

    def __init__(self, config: ElasticConfig, device: Optional[torch.device] = None,
                 membership: Optional[Any] = None, check_stop: Callable[[str], None] = no_stop) -> None:
        self.config = config
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.membership = Membership(config, check_stop) if membership is None else membership
        self.stats = TransportStats()
        self.outer_step = 0  # the round being posted: the exchanges' tag
        self.failures: list[dict[str, Any]] = []  # rounds finished alone because a partner failed

    @property
    def replica(self) -> int:
        view = self.membership.view
        return view.rank if view is not None else 0

    @property
    def num_replicas(self) -> int:
        view = self.membership.view
        return len(view.members) if view is not None else 1

    def member_ids(self, ranks: Sequence[int]) -> tuple[str, ...]:
        view = self.membership.view
        return tuple(view.members[j] for j in ranks) if view is not None else (self.config.replica_id,)

    def partner_failed(self, peers: Sequence[int], err: Optional[BaseException]) -> None:
        ids = self.member_ids(peers)
        self.failures.append({"outer_step": self.outer_step, "peers": list(ids), "error": str(err)[:200],
                              "time": time.time()})
        self.membership.failed()
        warnings.warn(
            f"Replica {self.config.replica_id!r}: outer step {self.outer_step} could not complete with {list(ids)} "
            f"({str(err).splitlines()[0][:160]}); this replica finished the round alone, and the next membership "
            "leaves out a replica that died.",
            stacklevel=3,
        )

    def resolved(self, total: Tensor, peers: tuple[int, ...] = ()) -> ElasticPending:
        return ElasticPending(self, [], total, lambda: total, 1, 0, peers).completed_with(total)

    def start_group_sum(self, payload: Tensor, group: Sequence[int]) -> ElasticPending:
        if self.replica not in group:
            raise ValueError(f"replica {self.replica} is not in the group {tuple(group)}")
        others = tuple(j for j in group if j != self.replica)
        view = self.membership.view
        if not others:
            return ElasticPending(self, [], payload, payload.clone, 1, 0, ())
        pg = view.pg if view is not None and view.ok else None
        if pg is None:  # no process group, or one a failure broke: every round alone until the next membership
            return ElasticPending(self, [], payload, payload.clone, len(group), 0, others, alone=True)
        send = payload.detach().to(self.device).contiguous()
        received = {j: torch.empty_like(send) for j in others}
        tag = self.outer_step % (1 << 30)
        pending = ElasticPending(self, [], payload, lambda: payload, len(group),
                                 send.numel() * send.element_size() * len(others), others)
        try:
            recvs = {j: pg.recv([received[j]], j, tag) for j in others}
            works = [(j, [recvs[j], pg.send([send], j, tag)]) for j in others]
        except RuntimeError as err:  # gloo may fail at once when a peer is already gone
            pending.alone, pending.error = True, err
            self.partner_failed(others, err)
            return pending

        def finish() -> Tensor:
            received[self.replica] = send
            return sum_in_group_order(received, group).to(payload.device)

        pending.works, pending.finish = works, finish
        return pending

    def start_all_reduce_sum(self, payload: Tensor) -> ElasticPending:
        """One all-reduce over the current membership (DiLoCo); the sum lands in ``payload``. If it fails the
        pending is ``alone`` and the driver drops the round (see
        :class:`~lightning_loco.plugins.Outcome`)."""
        n = self.num_replicas
        others = tuple(j for j in range(n) if j != self.replica)
        if not others:
            return ElasticPending(self, [], payload, lambda: payload, 1, 0, ())
        view = self.membership.view
        pg = view.pg if view is not None and view.ok else None
        if pg is None:
            return ElasticPending(self, [], payload, lambda: payload, n, 0, others, alone=True)
        buf = payload.detach().to(self.device)
        pending = ElasticPending(self, [], payload, lambda: payload, n,
                                 ring_all_reduce_bytes(buf.numel() * buf.element_size(), n), others)
        try:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            work = pg.allreduce([buf], options)
        except RuntimeError as err:
            pending.alone, pending.error = True, err
            self.partner_failed(others, err)
            return pending

        def finish() -> Tensor:
            if buf.data_ptr() != payload.data_ptr():
                payload.copy_(buf)
            return payload

        pending.works, pending.finish = [(-1, [work])], finish
        return pending

    def close(self) -> None:
        self.membership.close()


class ElasticTransportFactory:
    """The strategies' ``transport_factory`` in elastic mode: takes ``TorchDistributedTransport``'s keyword
    arguments (only ``device`` matters) and ``check_stop``, and builds an :class:`ElasticTransport`.
    ``membership`` (tests): builds the membership in place of a :class:`Membership` over the Lighthouse."""

    def __init__(self, config: ElasticConfig, membership: Optional[Callable[[], Any]] = None) -> None:
        self.config = config
        self.membership = membership

    def __call__(self, device: Optional[torch.device] = None, check_stop: Callable[[str], None] = no_stop,
                 **_: Any) -> ElasticTransport:
        show_info_lines()  # what happens to the replica (joins, heals, memberships) is said at INFO level
        membership = self.membership() if self.membership is not None else None
        return ElasticTransport(self.config, device, membership, check_stop)
