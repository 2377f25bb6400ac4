"""The transport over ``torch.distributed`` (gloo or NCCL): what the strategies use.

* ``start_group_sum``: each member sends its one flat buffer to every other member with one
  ``batch_isend_irecv`` and sums what it has in ascending replica order. Receives are posted before
  sends: gloo otherwise runs the two directions of a pair one after the other, twice as slow on a
  slow link.
* ``start_all_reduce_sum``: one asynchronous all-reduce. With two replicas on gloo it is the pair
  exchange instead (each sends its buffer to the other and adds what it receives): the same sum, bitwise
  (a + b = b + a), and the same bytes, in one message each way where gloo's all-reduce pipelines its
  chunks a round trip at a time, several times slower on a long fat pipe (``benchmarks/link_efficiency.py``).
  With three replicas or more on gloo, payloads of 64 KiB or more take a reduce-scatter and an all-gather of
  our own point-to-point exchanges instead (:mod:`~lightning_loco.transport.chunked`: every chunk summed by its
  owner in ascending replica order, bitwise the same on every replica). Which of ours and gloo's own (cut over the
  stream groups, or whole on one connection) a payload takes is chosen from its first rounds' measured times, every
  replica alike (``all_reduce="auto"``, the default: :mod:`~lightning_loco.transport.choice`), or fixed (``"p2p"``,
  ``"backend"``, ``"backend_whole"``). NCCL's all-reduce stays NCCL's.

The transfer progresses in the background (gloo's own threads on CPU, NCCL's stream on GPU) while
training goes on, and ``PendingSum.wait()`` returns the sum (:mod:`~lightning_loco.transport.pending_sum`:
the works and how to wait for them).

A replica may span several ranks (``ranks_per_replica``): then each rank moves one slice of the
buffer and the replica's ranks all-gather the result; the algorithms do not see the difference.
With ``sharded`` (FSDP2 inside the replica) each rank's buffer is already its own part of the model:
it moves the whole of it and nothing is gathered.

CUDA payloads on gloo (several processes sharing a GPU, or gloo chosen on GPUs) cross to the host
through pinned buffers of a :class:`~lightning_loco.transport.staging.StagingPool`, reused from one
outer step to the next, with ``non_blocking`` copies. On NCCL, an overlapped exchange is followed by
a CUDA event on a stream of the transport's own: ``done()`` queries the event, ``wait()`` makes the
training stream wait for it; no thread and no host synchronisation.

With a lossy ``codec`` (:mod:`lightning_loco.wire.codecs`) the exchanges are those of
:mod:`~lightning_loco.wire.coded`; this module holds the float32 paths.

``streams`` = s > 1 cuts every message and every all-reduce into s pieces, each over a process group of its own
(:mod:`~lightning_loco.transport.streams`: the groups, and how a buffer is cut into pieces); ``streams="auto"`` cuts
each message by its size, over at most the groups there are, and a pair exchange's message into one piece where both
sides of the pair measured one connection faster (:mod:`~lightning_loco.transport.pair_streams`). On gloo, the first
large exchange on a host with small TCP send buffers warns once (:mod:`~lightning_loco.transport.sockets`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_loco.transport.base import (
    FIRST_ROUND,
    PeerError,
    Pending,
    RoundId,
    Transport,
    TransportStats,
    peer_error,
    sum_in_group_order,
)
from lightning_loco.transport.choice import (
    BACKEND,
    BACKEND_WHOLE,
    P2P,
    AllReduceChoice,
    check_all_reduce,
    post_times,
    trials_for,
)
from lightning_loco.transport.chunked import MIN_BYTES, start_chunked_all_reduce
from lightning_loco.transport.pair_streams import PairStreams, post_proposals
from lightning_loco.transport.pending_sum import PendingSum
from lightning_loco.transport.slices import all_gather_slices
from lightning_loco.transport.sockets import check_send_buffer
from lightning_loco.transport.staging import StagingPool
from lightning_loco.transport.streams import AUTO, AUTO_MAX_STREAMS, auto_streams, make_stream_groups, piece
from lightning_loco.wire import coded
from lightning_loco.wire.codecs import Codec, ring_all_reduce_bytes

__all__ = ["PendingSum", "TorchDistributedTransport", "PeerError", "TransportStats", "all_gather_slices",
           "sum_in_group_order"]


class TorchDistributedTransport(Transport):
    """``Transport`` over an initialised ``torch.distributed`` process group.

    A replica is ``ranks_per_replica`` = k consecutive global ranks that hold the same weights
    (replica ``i`` is ranks ``i·k … i·k + k − 1``). With k > 1 every rank moves only its own slice
    of the buffer: rank j of a replica exchanges the j-th of k slices with rank j of each peer
    replica (or all-reduces it over the ``slice_group`` of the j-th ranks), and the replica's ranks
    then all-gather the summed slices over ``replica_group``, their fast link. Each rank sends 1/k
    of a model on the slow link and no rank is a bottleneck; the result is bitwise the same sum as a
    whole-buffer exchange for point-to-point groups (elementwise sums in the same order).

    Args:
        device: where buffers must be to cross the network (CUDA for NCCL, CPU for gloo). Payloads
            elsewhere are copied there and the result is copied back.
        process_group: the group for point-to-point exchanges and, with k = 1, the all-reduce
            (default: the world). Peers are addressed by global rank.
        ranks_per_replica: k (default 1: every rank is a replica).
        replica_group: with k > 1, the process group of this rank's replica.
        slice_group: with k > 1, the process group of the ranks holding the same slice as this one
            (local rank j of every replica), for all-reduces.
        sharded: the k ranks of a replica hold different buffers, each its own shards of the model
            (FSDP2 inside the replica): each rank is its own slice, exchanged whole with its
            counterparts, and the replica's ranks gather nothing.
        streams: s, the connections per pair one exchange is spread over (see the module docstring;
            default 1). With s > 1, every rank of the world must build the transport (the s − 1 extra
            groups are made then, with the exchanges' group's backend), unless ``stream_groups`` gives
            them; replicas of one rank only. ``"auto"``: each message cut by its size
            (:func:`~lightning_loco.transport.streams.auto_streams`) over the groups ``stream_groups`` gives, or
            else over ``AUTO_MAX_STREAMS`` made here on gloo; one stream on NCCL and with replicas of several ranks.
        stream_groups: the s − 1 extra groups, made by the caller (the strategies': with the run's
            backend and timeout, and NCCL's warm-up, :class:`~lightning_loco.replica.process_groups.ProcessGroups`).
        all_reduce: on gloo, which float32 all-reduce a payload takes where ours applies (two replicas, or three or
            more with payloads of 64 KiB or more; see the module docstring): ``"auto"`` (default) chooses among
            ours and the backend's (cut over the stream groups, or whole) from the first rounds' measured times,
            every replica alike (:mod:`~lightning_loco.transport.choice`); ``"p2p"``: ours always (with two replicas
            one pair exchange, with more our reduce-scatter and all-gather); ``"backend"``: the backend's own always
            (gloo's ring, cut over the stream groups); ``"backend_whole"``: the backend's own on one connection.
            A fixed choice keeps the summed bits the same from run to run. Lossy wire formats take the coded
            exchange (:mod:`~lightning_loco.wire.coded`) whatever the choice, since no backend sums encoded bytes,
            and NCCL's all-reduce is always NCCL's. Through the strategies:
            ``transport_factory=functools.partial(TorchDistributedTransport, all_reduce="backend")``.
    """

    def __init__(
        self,
        device: torch.device,
        process_group: Optional[Any] = None,
        ranks_per_replica: int = 1,
        replica_group: Optional[Any] = None,
        slice_group: Optional[Any] = None,
        sharded: bool = False,
        streams: Union[int, str] = 1,
        stream_groups: Optional[Sequence[Any]] = None,
        all_reduce: str = "auto",
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedTransport needs an initialised torch.distributed process group")
        check_all_reduce(all_reduce, dist.get_backend(process_group))
        world = dist.get_world_size()
        if ranks_per_replica < 1 or world % ranks_per_replica:
            raise ValueError(f"ranks_per_replica={ranks_per_replica} must divide the world size {world}")
        if ranks_per_replica > 1 and (replica_group is None or slice_group is None):
            raise ValueError("ranks_per_replica > 1 needs replica_group and slice_group")
        self.auto_streams = streams == AUTO  # each message cut by its size (see the module docstring)
        if self.auto_streams:
            gloo_p2p = ranks_per_replica == 1 and dist.get_backend(process_group) == "gloo"
            streams = len(stream_groups) + 1 if stream_groups is not None else AUTO_MAX_STREAMS if gloo_p2p else 1
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be an integer >= 1 (connections per pair) or 'auto', got {streams!r}")
        if streams > 1 and ranks_per_replica > 1:
            raise ValueError(f"streams={streams} needs replicas of one rank (ranks_per_replica=1): a replica of "
                             f"{ranks_per_replica} ranks already spreads its exchange over {ranks_per_replica} "
                             "connections per pair, one per rank")
        self.device = torch.device(device)
        self.process_group = process_group
        self.ranks_per_replica = k = ranks_per_replica
        self.replica_group, self.slice_group = replica_group, slice_group
        self.sharded = bool(sharded)
        rank = dist.get_rank()
        self.replica, self.local_rank = divmod(rank, k)
        self.num_replicas = world // k
        self.replica_ranks = [i * k + self.local_rank for i in range(self.num_replicas)]  # my counterparts
        self.stats = TransportStats()
        self.staging = StagingPool()  # host buffers for CUDA payloads crossing gloo (pinned with CUDA)
        self._side_stream: Any | None = None  # CUDA transports: where completion events are recorded
        self.streams = streams  # the groups there are (with "auto", the most pieces a message is cut into)
        # two replicas on gloo: an all-reduce is one pair exchange (see the module docstring)
        ours = dist.get_backend(process_group) == "gloo" and all_reduce not in (BACKEND, BACKEND_WHOLE)
        self.all_reduce = all_reduce
        self.choices: dict[tuple[int, int, int], AllReduceChoice] = {}  # "auto": per payload (see choice)
        self.pair_streams: dict[tuple[int, int, int], PairStreams] = {}  # streams="auto": per payload (pair_streams)
        self.pairwise_all_reduce = self.num_replicas == 2 and ours
        # three replicas or more on gloo: large payloads take the chunked all-reduce (see the module docstring)
        self.chunked_all_reduce = self.num_replicas >= 3 and ours
        # the strategies' (made by ProcessGroups with the run's backend and timeout), or made here: collective
        self.stream_groups: list[Any] = make_stream_groups(process_group, streams, stream_groups)

    # Tests set this to route CPU payloads through the staging buffers too (the path CUDA payloads take
    # on gloo), since a machine without CUDA has no other way to run it.
    stage_cpu_payloads = False
    # The smallest payload slice (bytes) that takes the chunked all-reduce; tests lower it to run it on small buffers.
    chunked_min_bytes = MIN_BYTES

    @property
    def slices_per_replica(self) -> int:
        """How many slices a replica's buffer is cut into, one per rank (1: each rank moves it whole)."""
        return 1 if self.sharded else self.ranks_per_replica

    def _staged(self, payload: Tensor) -> bool:
        """Whether ``payload`` crosses to the host through staging buffers: it lives on an accelerator
        and this transport moves host tensors (gloo)."""
        return self.device.type == "cpu" and (payload.device.type != "cpu" or self.stage_cpu_payloads)

    def completion_event(self, works: list[Any]) -> Any:
        """A CUDA event that completes after ``works`` (NCCL operations): the works are waited for on
        a side stream of this transport's own, which makes only that stream wait (unless
        ``TORCH_NCCL_BLOCKING_WAIT=1``, which makes ``wait`` block the host), and the event is
        recorded there."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        event = torch.cuda.Event()
        with torch.cuda.stream(self._side_stream):
            for work in works:
                work.wait()
            event.record(self._side_stream)
        return event

    def peer_error(self, peers: Sequence[int], err: BaseException) -> PeerError:
        return peer_error(self.replica, peers, [self.replica_ranks[j] for j in peers], err)

    def exchange(self, sends: dict[int, Tensor], receives: dict[int, Tensor], round_id: RoundId = FIRST_ROUND,
                 counts: Optional[dict[int, int]] = None) -> list[Any]:
        """Posts point-to-point receives, then sends, with this rank's counterparts in replicas j, in one
        ``batch_isend_irecv``; returns its works. Each message is cut into :meth:`pieces`, or into ``counts[j]``
        pieces where given (the peer cuts its side alike). (Messages are matched in posting order: ``round_id``
        tags nothing here.)"""
        if self.device.type == "cpu":  # gloo: a large exchange on small send buffers warns once (transport.sockets)
            check_send_buffer(sum(buf.numel() * buf.element_size() for buf in sends.values()))
        works = []

        def cut(j: int, buf: Tensor) -> int:
            return counts[j] if counts is not None and j in counts else self.pieces(buf)

        recv_cuts = [(j, buf, cut(j, buf)) for j, buf in receives.items()]
        send_cuts = [(j, buf, cut(j, buf)) for j, buf in sends.items()]
        for c, group in enumerate(self.stream_groups):  # piece c of each message cut in more than c, on group c
            ops = [dist.P2POp(dist.irecv, piece(buf, c, s), self.replica_ranks[j], group)
                   for j, buf, s in recv_cuts if c < s]
            ops += [dist.P2POp(dist.isend, piece(buf, c, s), self.replica_ranks[j], group)
                    for j, buf, s in send_cuts if c < s]
            try:
                works += dist.batch_isend_irecv(ops) if ops else []
            except RuntimeError as err:  # gloo may fail at once when a peer is already gone
                raise self.peer_error(sorted(set(sends) | set(receives)), err) from err
        return works

    def pieces(self, buf: Tensor) -> int:
        """Into how many pieces a message (or an all-reduce's buffer) is cut: ``streams``, or with ``"auto"``
        by its size, each side of a message alike."""
        if not self.auto_streams:
            return self.streams
        return auto_streams(buf.numel() * buf.element_size(), self.streams)

    def resolved(self, total: Tensor, peers: tuple[int, ...] = ()) -> PendingSum:
        return PendingSum(self, [], lambda: total, 0, peers).completed_with(total)

    def pending(
        self, works: list[Any], finish: Callable[[], Tensor], nbytes: int, peers: tuple[int, ...]
    ) -> PendingSum:
        """Wraps posted works (a subclass may return its own kind of ``PendingSum``)."""
        return PendingSum(self, works, finish, nbytes, peers)

    def slice(self, buf: Tensor) -> Tensor:
        """This rank's slice of a flat buffer (k equal slices, the last ones shorter if need be)."""
        if self.slices_per_replica == 1:
            return buf
        return torch.tensor_split(buf, self.ranks_per_replica)[self.local_rank]

    def gather_slices(self, part: Tensor, like: Tensor) -> Tensor:
        """The whole buffer from every rank's slice (an all-gather inside the replica)."""
        if self.slices_per_replica == 1:
            return part
        return all_gather_slices(part, like, self.ranks_per_replica, self.replica_group)

    def start_group_sum(self, payload: Tensor, group: Sequence[int], codec: Optional[Codec] = None,
                        round_id: RoundId = FIRST_ROUND) -> Pending:
        """Posts the group's exchange (receives first) and returns at once. ``payload`` must not
        change until the pending sum has been waited for. A lossy ``codec`` sets the wire format."""
        if self.replica not in group:
            raise ValueError(f"replica {self.replica} is not in the group {tuple(group)}")
        others = [j for j in group if j != self.replica]
        if not others:
            # always a new tensor, as for a real group: callers may update it in place
            return self.pending([], payload.clone, 0, ())
        if codec is not None and codec.lossy:
            return coded.start_group_sum(self, payload, group, others, codec, round_id)
        return self._post_group_sum(payload, group, others, round_id)

    def _post_group_sum(self, payload: Tensor, group: Sequence[int], others: list[int], round_id: RoundId
                        ) -> PendingSum:
        """The float32 group sum, posted: its works, its ``finish`` (the sum, a new tensor), bytes and peers."""
        staged = self._staged(payload)
        if staged:  # pinned host buffers, reused across outer steps; given back in finish()
            send = self.staging.to_host(self.slice(payload))
            received = {j: self.staging.take(send.numel(), send.dtype) for j in others}
        else:
            send = self.slice(payload.to(self.device)).contiguous()
            received = {j: torch.empty_like(send) for j in others}
        counts, learning = post_proposals(self, send, others, round_id)
        works = self.exchange(dict.fromkeys(others, send), received, round_id, counts)

        def finish() -> Tensor:
            received[self.replica] = send
            if not staged:
                return self.gather_slices(sum_in_group_order(received, group), payload).to(payload.device)
            order = sorted(group)  # the sum of sum_in_group_order, into a staging buffer
            total = self.staging.take(send.numel(), send.dtype)
            total.copy_(received[order[0]])
            for j in order[1:]:
                total.add_(received[j])
            result = self.staging.to_device(self.gather_slices(total, payload), payload.device)
            self.staging.give_back(total, *received.values())
            return result

        nbytes = send.numel() * send.element_size() * len(others)
        pending = self.pending(works, finish, nbytes, tuple(others))
        return pending if learning is None else learning(pending)

    def start_all_reduce_sum(self, payload: Tensor, codec: Optional[Codec] = None,
                             round_id: RoundId = FIRST_ROUND) -> Pending:
        """Posts the all-reduce and returns at once; the sum lands in ``payload``. A lossy ``codec``
        sets the wire format (see the module docstring)."""
        if codec is not None and codec.lossy and self.num_replicas > 1:
            return coded.start_all_reduce_sum(self, payload, codec, round_id)
        part_numel = self.slice(payload).numel()
        ours = self.pairwise_all_reduce or (
            self.chunked_all_reduce and part_numel * payload.element_size() >= self.chunked_min_bytes)
        if not ours:
            return self._post_backend_all_reduce(payload, whole=self.all_reduce == BACKEND_WHOLE)
        if self.all_reduce == P2P or part_numel * payload.element_size() < self.chunked_min_bytes:
            return self._post_p2p_all_reduce(payload, round_id)  # small, with two replicas: the pair exchange
        cut = self.pieces(self.slice(payload)) if self.ranks_per_replica == 1 else 1  # as gloo's side cuts it
        choice = self.choices.setdefault((round_id.optimizer, round_id.fragment, part_numel),
                                         AllReduceChoice(trials_for(cut)))
        # a round posted before the one that carried the times landed: decide first
        choice.settle(self.replica, self.peer_error)
        algorithm, share = choice.next_round()
        trial = choice.last_was_trial
        if share:  # before the payload, so that it does not wait behind it
            try:
                mine = choice.mine()
                choice.sharing = (mine, *post_times(mine, self.replica_ranks, self.replica, self.process_group))
            except RuntimeError as err:
                raise self.peer_error([j for j in range(self.num_replicas) if j != self.replica], err) from err
        pending = (self._post_p2p_all_reduce(payload, round_id) if algorithm == P2P
                   else self._post_backend_all_reduce(payload, whole=algorithm == BACKEND_WHOLE))
        started, landed = time.perf_counter(), pending.finish

        def timed() -> Tensor:
            result = landed()
            if trial:
                choice.record(algorithm, time.perf_counter() - started)
            choice.settle(self.replica, self.peer_error)
            return result

        pending.finish = timed
        return pending

    def _post_p2p_all_reduce(self, payload: Tensor, round_id: RoundId) -> PendingSum:
        """Our all-reduce: with two replicas the pair exchange, else the chunked one (see the module docstring)."""
        if self.pairwise_all_reduce:
            pending = self._post_group_sum(payload, (0, 1), [1 - self.replica], round_id)
            total = pending.finish

            def landed() -> Tensor:
                payload.copy_(total().view_as(payload))
                return payload

            pending.finish = landed
            return pending
        return cast(PendingSum, start_chunked_all_reduce(self, payload, round_id))

    def _post_backend_all_reduce(self, payload: Tensor, whole: bool = False) -> PendingSum:
        """The backend's own all-reduce (cut over the stream groups with replicas of one rank, unless ``whole``:
        then on the main group alone)."""
        staged = self._staged(payload)
        buf = self.staging.to_host(payload) if staged else payload.to(self.device)
        part = self.slice(buf)
        group = self.process_group if self.ranks_per_replica == 1 else self.slice_group
        n = self.num_replicas
        peers = tuple(j for j in range(n) if j != self.replica)
        cuts = self.pieces(part) if self.ranks_per_replica == 1 and not whole else 1
        groups = self.stream_groups[:cuts] if self.ranks_per_replica == 1 else [group]
        try:
            works = [dist.all_reduce(piece(part, c, cuts), op=dist.ReduceOp.SUM, group=g, async_op=True)
                     for c, g in enumerate(groups)]
        except RuntimeError as err:
            raise self.peer_error(peers, err) from err

        def finish() -> Tensor:
            whole = self.gather_slices(part, buf)
            if whole.data_ptr() != payload.data_ptr():
                payload.copy_(whole.view_as(payload), non_blocking=staged and self.staging.pinned)
            if staged:
                self.staging.give_back(buf)
            return payload

        nbytes = ring_all_reduce_bytes(part.numel() * part.element_size(), n)
        if self.device.type == "cpu":
            check_send_buffer(nbytes)
        return self.pending([w for w in works if w is not None], finish, nbytes, peers)
