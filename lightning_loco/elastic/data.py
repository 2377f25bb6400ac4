"""Which data an elastic replica reads: its own, without extra code.

An elastic replica is a job of its own, so Lightning's distributed sampler sees a world of the replica's
own ranks and would give every replica the same batches. The strategy hands Lightning the sampler
arguments from here instead (``distributed_sampler_kwargs``), in one of two ways:

* **Data slots** (``ElasticConfig(data_slots=N)``): the dataset is cut into N parts, as a static launch of
  N replicas cuts it, and a replica reads part ``data_slot`` (by default the number its ``replica_id``
  ends with: ``site-2`` reads part 2). The permutation of an epoch is the same everywhere (the run's
  seed), so the parts are disjoint. A replica that restarts or heals under the same id reads its own part
  again, in the epoch it takes from its donor (its loop counters); its loader starts that epoch's part from
  the beginning, as any Lightning run resumed mid-epoch does. A slot without a live replica is not read while
  it is empty; a joiner with a new slot adds its part.
* **Without slots** (the default): every replica reads the whole dataset, in an order of its own (the
  run's seed mixed with a hash of the replica id), so the replicas' batches differ, as independent
  samples of the data; a replica that restarts under the same id reads its own order again.
  ``data_slots=1`` says that every replica reads the same data in the same order (a datamodule that
  shards by itself, or a test).

No Lightning here; nothing here communicates.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from typing import Optional

_TRAILING_NUMBER = re.compile(r"(\d+)$")


def slot_of(replica_id: str) -> Optional[int]:
    """The number ``replica_id`` ends with (``site-2`` → 2), or None."""
    found = _TRAILING_NUMBER.search(replica_id)
    return int(found.group(1)) if found else None


def order_seed(seed: int, replica_id: str) -> int:
    """The seed of a replica's own order without data slots: the run's seed and a stable hash of its id."""
    return (seed + zlib.crc32(replica_id.encode())) % 2**31


def sampler_kwargs(replica_id: str, data_slots: Optional[int], data_slot: Optional[int], ranks_per_replica: int,
                   rank_in_replica: int, seed: int) -> dict[str, int]:
    """Lightning's ``distributed_sampler_kwargs`` of one rank of an elastic replica (see the module's
    docstring): with slots, rank ``rank_in_replica`` of slot s reads part ``s·k + rank_in_replica`` of
    ``N·k``; without, the replica's ranks cut the whole dataset among them, in the replica's own order."""
    k = ranks_per_replica
    if data_slots is None:
        return {"num_replicas": k, "rank": rank_in_replica, "seed": order_seed(seed, replica_id)}
    slot = data_slot if data_slot is not None else slot_of(replica_id)
    assert slot is not None, "checked when the config is built"
    return {"num_replicas": data_slots * k, "rank": slot * k + rank_in_replica, "seed": seed}


def shared_slots(members: Iterable[str], data_slots: Optional[int], data_slot: Optional[int],
                 me: str) -> list[tuple[str, str, int]]:
    """Pairs of live members whose ids give them the same data slot, ``(a, b, slot)``: they read the same
    part. Only slots read from ids can be compared (a ``data_slot`` given to another replica is not known
    here); this replica's own slot is its ``data_slot`` when given."""
    if data_slots is None or data_slots == 1:
        return []
    slots: dict[int, str] = {}
    found = []
    for member in sorted(members):
        slot = data_slot if member == me and data_slot is not None else slot_of(member)
        if slot is None:
            continue
        if slot in slots:
            found.append((slots[slot], member, slot))
        else:
            slots[slot] = member
    return found
