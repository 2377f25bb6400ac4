"""What a quorum means for the next membership: the plan every participant derives alike, and the
membership as one replica holds it. See :mod:`~lightning_loco.elastic.membership` for how memberships are
agreed and switched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_loco.elastic.keys import membership_prefix


@dataclass(frozen=True)
class Plan:
    """What a quorum means for the next membership (computed alike by every participant)."""

    quorum_id: int
    members: tuple[str, ...]  # sorted replica ids
    switch: int  # the first outer step of the membership
    joiners: tuple[str, ...]
    donor: Optional[str]
    reuse: bool  # same members as their common previous membership, no failure seen: keep its group
    store_address: str  # HOST:PORT/prefix of this membership's rendezvous (new for every membership)
    fresh: bool = False  # nobody held a membership before: the run starts
    behind: tuple[str, ...] = ()  # sync only: members that heal to the leader's state (always with weights)


def make_plan(quorum: Any, every: int, previous: Optional["View"], sync: bool = False) -> Plan:
    """The plan every participant of ``quorum`` derives alike (see :mod:`~lightning_loco.elastic.membership`).

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
        store_address=membership_prefix(store, quorum.quorum_id, switch), fresh=not current, behind=behind,
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
