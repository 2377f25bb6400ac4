"""An elastic replica of several ranks (``ranks_per_replica`` = k > 1): one member, k processes.

The replica is one Lightning Trainer of k ranks (DDP inside, over the replica's own process group). It is
one member of the elastic run, and is organised per rank, as torchft organises a replica group per group
rank:

* **rank 0 alone talks to the Lighthouse**: it sends the heartbeats, asks for the quorums and hosts the
  replica's store (the ``TCPStore`` whose address it gives the Lighthouse). The other ranks never connect
  to it;
* **the quorum reaches the replica's other ranks through rank 0's store**: rank 0 writes the plan it
  derived from each quorum there (:func:`publish`), and rank i reads it (:func:`read`) in the background,
  as rank 0 waits for the quorum in the background. This is local to the replica: it involves no other
  replica and no collective of the run. The store's address reaches the ranks once, at start-up, by a
  broadcast over the replica's process group (:meth:`ReplicaRanks.share`);
* **rank i of every member forms its own process group with rank i of the others**, configured under a
  store prefix per (membership, rank i): ``…/q<quorum id>/s<first outer step>/r<i>``
  (:func:`~lightning_loco.elastic.keys.rank_prefix`);
  each rank moves its own 1/k slice of the payload on it and the replica's ranks all-gather the result,
  as the static launch does (:meth:`ReplicaRanks.gather`);
* **a round is the replica's on all its ranks or on none**: after its exchange each rank says whether
  its own slice crossed (2), a partner was late (1) or an exchange failed (0), and the replica takes the
  least of its ranks' answers (:meth:`ReplicaRanks.agree`, one small all-reduce inside the replica), so
  that the ranks apply the same outcome and keep one model and one outer state;
* **healing goes rank by rank**: rank i of a joiner takes the state of the donor's rank i, under rank
  i's prefix.

A replica any of whose ranks dies leaves the membership as a whole: its other ranks fail at their next
operation inside the replica (a step's gradient all-reduce, the agreement or gather of a round, the read
of rank 0's plan), at once when the dead rank's connections close and at the latest after the replica
group's timeout, ``outer_step_timeout``; rank 0's heartbeats stop with it. Each of them ends with an
error that says so (a :class:`ReplicaRankError` from the operations here; the strategy adds the same
advice to an error of DDP's: :func:`restart_advice`), and the replica is restarted as a whole.

At each switch the ranks also agree that each of them set up its process group (or the replica takes the
membership's rounds alone on all of them).
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_loco.elastic.keys import plan_key, read_key
from lightning_loco.transport.slices import all_gather_slices


class ReplicaRankError(RuntimeError):
    """A rank of this replica stopped or cannot be reached (or rank 0 got no membership): the replica
    leaves the membership as a whole."""


def restart_advice(replica_id: str, rank: int, size: int) -> str:
    """The sentence every error of a replica of several ranks ends with."""
    return (f"Replica {replica_id!r} (rank {rank} of {size}) stops: the replica leaves the membership as a whole "
            f"(rank 0's heartbeats stop) and the other replicas go on. Restart all {size} of its processes "
            "(torchrun restarts them together).")


class ReplicaRanks:
    """This rank's place in its replica, and the replica's own operations (never involving another replica).

    Args:
        replica_id: the replica's id (for messages).
        group: the replica's process group (its k ranks), whose timeout bounds every operation here.
        device: where that group's tensors must be (CUDA for NCCL, CPU for gloo).

    The three operations among the ranks are :meth:`_broadcast`, :meth:`_min` and :meth:`_all_gather`
    (tests run a replica's ranks as threads with their own).
    """

    def __init__(self, replica_id: str, group: Any, device: Optional[torch.device] = None) -> None:
        self.replica_id, self.group = replica_id, group
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def _broadcast(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _min(self, value: int) -> int:
        agreed = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return int(agreed.item())

    def _all_gather(self, part: Tensor, like: Tensor) -> Tensor:
        return all_gather_slices(part.to(self.device), like, self.size, self.group)

    def error(self, doing: str, err: BaseException) -> ReplicaRankError:
        """The error of a failed operation inside the replica, naming what this rank was ``doing``."""
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        return ReplicaRankError(f"A rank of replica {self.replica_id!r} stopped or cannot be reached while rank "
                                f"{self.rank} was {doing} ({first}). "
                                + restart_advice(self.replica_id, self.rank, self.size))

    def share(self, value: Any, doing: str) -> Any:
        """Rank 0's ``value`` on every rank of the replica (a broadcast over the replica's group)."""
        try:
            return self._broadcast(value if self.rank == 0 else None)
        except RuntimeError as err:
            raise self.error(doing, err) from err

    def share_store(self, store: Optional[Any], timeout: float) -> tuple[str, Any]:
        """Rank 0's store (``store`` on rank 0, None elsewhere) as its address and, on the other ranks, a
        client of it whose calls wait at most ``timeout`` seconds."""
        address = self.share(f"{store.host}:{store.port}" if store is not None else None, "starting")
        if self.rank == 0:
            return address, store
        host, _, port = address.rpartition(":")
        return address, dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=timeout))

    def agree(self, value: int, doing: str = "agreeing on a round's outcome with its replica") -> int:
        """The least ``value`` among the replica's ranks (one all-reduce of one number inside the replica)."""
        try:
            return self._min(value)
        except RuntimeError as err:
            raise self.error(doing, err) from err

    def slice(self, buf: Tensor) -> Tensor:
        """This rank's slice of a flat buffer (k equal slices, the last ones shorter if need be)."""
        return torch.tensor_split(buf, self.size)[self.rank]

    def gather(self, part: Tensor, like: Tensor) -> Tensor:
        """The whole buffer from every rank's slice (an all-gather inside the replica)."""
        try:
            return self._all_gather(part, like)
        except RuntimeError as err:
            raise self.error("gathering a round's slices", err) from err


def publish(store: Any, number: int, plan: Any = None, error: Optional[str] = None) -> None:
    """Rank 0's side: the plan of its ``number``-th quorum request (or why it has none) for the other ranks."""
    store.set(plan_key(number), pickle.dumps({"plan": plan, "error": error}))


def read(store: Any, number: int, ranks: ReplicaRanks) -> Any:
    """Rank i's side: waits for the plan of rank 0's ``number``-th request (the store's timeout bounds the
    wait; a rank 0 that died fails it at once). Raises :class:`ReplicaRankError` without one."""
    key = plan_key(number)
    try:
        raw = store.get(key)
    except RuntimeError as err:
        raise ranks.error("waiting for rank 0's membership", err) from err
    entry = pickle.loads(raw)  # written by this replica's own rank 0
    if store.add(read_key(key), 1) >= ranks.size - 1:  # the last of the other ranks to read it clears it
        store.delete_key(key)
        store.delete_key(read_key(key))
    if entry["error"] is not None:
        raise ReplicaRankError(f"Rank 0 of replica {ranks.replica_id!r} got no membership: {entry['error']} "
                               + restart_advice(ranks.replica_id, ranks.rank, ranks.size))
    return entry["plan"]
