"""The process groups our strategies create beyond Lightning's default one, created and destroyed here.

* **replica groups** (``ranks_per_replica`` = k > 1): the k consecutive ranks of each replica; DDP
  inside the replica and the all-gather of exchanged slices run on it;
* **slice groups** (k > 1): rank j of every replica, for all-reduces of the j-th slice;
* **the overlap group** (``overlap_steps`` ≠ 0): background exchanges get a group of their own, so
  that collectives on the default group (logging, checkpoints, validation) never interleave with them;
* **stream groups** (``WireConfig(streams=s)``, s > 1): s − 1 more groups of the same ranks as the
  exchanges' own, each piece of an exchange on one of them (one more connection per pair).

torch.distributed requires every rank to create every group, in the same order. A group is never
destroyed while a thread still waits on it (the watcher of an abandoned round): it is then left to
the process exit.

NCCL creates a group's communicator at the group's first operation unless it is bound to a device,
and when that first operation is a batched point-to-point call, every rank of the group must take
part in it. A NoLoCo pair or a GASLoC round with odd N (one replica sits out) breaks that rule. So on
NCCL every new group runs one warm-up all-reduce of a single element among all its ranks when it is
created, once, before any exchange: the communicator then exists whatever comes first. (The world
group needs none: Lightning binds it to the device, and the strategies broadcast the initial weights
on it before training.)
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("lightning_loco")


class ProcessGroups:
    """The extra groups of one rank.

    Args:
        ranks_per_replica: k.
        backend: "gloo" or "nccl".
        timeout: how long a peer is awaited on these groups.
    """

    def __init__(self, ranks_per_replica: int, backend: str, timeout: Optional[timedelta]) -> None:
        self.ranks_per_replica, self.backend, self.timeout = ranks_per_replica, backend, timeout
        self.warm_up_groups = backend == "nccl"  # see the module docstring
        self.replica: Optional[Any] = None
        self.slice: Optional[Any] = None
        self.overlap: Optional[Any] = None
        self.streams: list[Any] = []

    def create_replica_groups(self) -> None:
        """With k > 1: this rank's replica group and slice group (every rank creates all of them)."""
        k = self.ranks_per_replica
        if k == 1:
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        for i in range(world // k):
            group = dist.new_group(list(range(i * k, (i + 1) * k)), backend=self.backend, timeout=self.timeout)
            if i == rank // k:
                self.replica = group
        for j in range(k):
            group = dist.new_group(list(range(j, world, k)), backend=self.backend, timeout=self.timeout)
            if j == rank % k:
                self.slice = group
        self._warm_up(self.replica)  # after every rank created every group: each rank its own two
        self._warm_up(self.slice)

    def overlap_group(self) -> Optional[Any]:
        """The group of background exchanges (created once, on every rank)."""
        if self.overlap is None and dist.get_world_size() > 1:
            self.overlap = dist.new_group(backend=self.backend, timeout=self.timeout)
            self._warm_up(self.overlap)
        return self.overlap

    def stream_groups(self, streams: int, base: Optional[Any]) -> list[Any]:
        """``streams`` − 1 groups of ``base``'s ranks (None: all ranks), created once on every rank, with the
        run's backend and timeout (and NCCL's warm-up)."""
        if len(self.streams) < streams - 1:
            ranks = None if base is None else dist.get_process_group_ranks(base)
            for _ in range(streams - 1 - len(self.streams)):
                group = dist.new_group(ranks=ranks, backend=self.backend, timeout=self.timeout)
                self._warm_up(group)
                self.streams.append(group)
        return self.streams[:streams - 1]

    def _warm_up(self, group: Any) -> None:
        """One single-element all-reduce among all ranks of ``group`` (NCCL: creates its communicator
        before any point-to-point call can be its first operation). Every rank of the group calls it."""
        if not self.warm_up_groups or group is None:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        dist.all_reduce(torch.zeros(1, device=device), group=group)

    def replica_max(self, value: float, device: "torch.device") -> float:
        """The largest ``value`` among the ranks of this replica (one small all-reduce on its group, in
        float64: seconds on a clock as well as counts)."""
        agreed = torch.tensor([float(value)], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.replica)
        return agreed.item()

    def destroy(self, lingering: list[threading.Thread]) -> None:
        """Destroys the groups; the overlap group is left to the process exit while one of
        ``lingering`` (threads waiting on it) is alive."""
        alive = any(thread.is_alive() for thread in lingering)
        streams, self.streams = self.streams, []
        for name, group in [("overlap", self.overlap), ("replica", self.replica), ("slice", self.slice),
                            *(("stream", g) for g in streams)]:
            if name != "stream":
                setattr(self, name, None)
            if group is None:
                continue
            if name in ("overlap", "stream") and alive:
                log.warning(
                    "An abandoned outer-step exchange is still waiting on its process group; the group is left "
                    "to the process exit instead of being destroyed under it."
                )
                continue
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                pass  # the default group is already gone, and this one with it
