"""Every key an elastic run writes in a store, in one place.

* **a membership's prefix**: ``HOST:PORT/lightning_loco/elastic/q<quorum id>/s<first round>`` on the store of
  its first participant (:func:`membership_prefix`). The quorum id alone does not name a membership: torchft's
  Lighthouse keeps the id while the participants stay the same (DiLoCo's memberships at every switch; a
  replica restarted under its old id before the Lighthouse counted it as dead) and counts from 1 again when
  it restarts, so two memberships could share a prefix and a joiner would read a state written for an
  earlier one. The first round of a replica's memberships only grows, so the pair is new for every
  membership a store's owner takes part in;
* **one rank's part of it**: ``…/r<rank>`` (:func:`rank_prefix`): rank i of every member forms its own
  process group there (``…/r<i>/pg``, :func:`group_prefix`) and heals under it;
* **a heal's header**: ``heal/<joiners>`` under the rank's prefix (:func:`heal_key`), with a counter of the
  joiners that took it (:func:`taken_key`);
* **a plan handed on inside a replica of several ranks**: ``lightning_loco/elastic/replica/plan/<n>`` on rank 0's
  own store (:func:`plan_key`), with a counter of the ranks that read it (:func:`read_key`).
"""

from __future__ import annotations

from collections.abc import Sequence

PREFIX = "lightning_loco/elastic"
PLAN = f"{PREFIX}/replica/plan/"


def membership_prefix(store_address: str, quorum_id: int, first_round: int) -> str:
    """``HOST:PORT/lightning_loco/elastic/q<quorum id>/s<first round>``: the store address of one membership."""
    return f"{store_address}/{PREFIX}/q{quorum_id}/s{first_round}"


def rank_prefix(store_address: str, rank: int) -> str:
    """``HOST:PORT/…/q<id>/s<round>/r<rank>``: the store prefix of one rank's process group and heal keys
    in one membership."""
    return f"{store_address}/r{rank}"


def group_prefix(store_address: str, rank: int) -> str:
    """Where rank ``rank``'s process group of a membership meets."""
    return f"{rank_prefix(store_address, rank)}/pg"


def heal_key(joiners: Sequence[str]) -> str:
    """The key of the header the joiners of a membership take (under the rank's prefix)."""
    return "heal/" + ",".join(joiners)


def taken_key(key: str) -> str:
    """Counts the joiners that took the header under ``key`` (the last one deletes both)."""
    return f"{key}/taken"


def plan_key(number: int) -> str:
    """The plan of rank 0's ``number``-th quorum request, for the other ranks of its replica."""
    return f"{PLAN}{number}"


def read_key(key: str) -> str:
    """Counts the ranks that read the plan under ``key`` (the last one deletes both)."""
    return f"{key}/read"
