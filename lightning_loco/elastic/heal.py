"""How a joiner takes a live replica's state: through the rendezvous store of the membership that admits it.

**Keys.** Every membership has its own prefix on the store of its first participant,
``HOST:PORT/lightning_loco/elastic/q<quorum id>/s<first round>`` (:func:`membership_prefix`): the
process group's rendezvous and the healing state live under it. The quorum id alone does not name a
membership. torchft's Lighthouse keeps the id while the participants stay the same (DiLoCo's memberships
at every switch; a replica restarted under its old id before the Lighthouse counted it as dead) and
counts from 1 again when it restarts, so two memberships could share a prefix and a joiner would read a
state written for an earlier one. The first round of a replica's memberships only grows, so the pair is
new for every membership a store's owner takes part in.

**Protocol.** The donor writes the state once, under ``heal/<joiners>`` of that prefix
(:func:`heal_key`), with a header naming the membership (:func:`encode`). A joiner's ``get`` waits until
the key is written; the joiner checks the header (:func:`decode`: a state for another membership is an
error, never loaded), and the last joiner to take it deletes it (:func:`take`), so the store holds a model
copy only while someone still needs it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

PREFIX = "lightning_loco/elastic"


def membership_prefix(store_address: str, quorum_id: int, first_round: int) -> str:
    """``HOST:PORT/lightning_loco/elastic/q<quorum id>/s<first round>``: the store address of one membership."""
    return f"{store_address}/{PREFIX}/q{quorum_id}/s{first_round}"


def heal_key(joiners: Sequence[str]) -> str:
    """The key of the state the joiners of a membership take (under the membership's prefix)."""
    return "heal/" + ",".join(joiners)


def header(quorum_id: int, first_round: int, joiners: Sequence[str], donor: str) -> dict[str, Any]:
    """What a state says of the membership it was written for."""
    return {"quorum_id": int(quorum_id), "first_round": int(first_round), "joiners": list(joiners), "donor": donor}


def encode(state: dict[str, Any], head: dict[str, Any]) -> bytes:
    """The state and its header as bytes for the store (``torch.save``)."""
    buffer = io.BytesIO()
    torch.save({**state, "donor": head["donor"], "membership": head}, buffer)
    return buffer.getvalue()


def decode(raw: bytes, expected: dict[str, Any]) -> dict[str, Any]:
    """The state in ``raw`` (tensors and plain values only: ``weights_only``); ``RuntimeError`` if it was
    written for another membership than ``expected``."""
    state = torch.load(io.BytesIO(raw), weights_only=True)
    if state.get("membership") != expected:
        raise RuntimeError(
            f"The state under this membership's key was written for {state.get('membership')}, not for {expected}: "
            "two memberships shared a store key. Nothing was loaded; restart this replica to join again."
        )
    return state


def put(store: Any, key: str, payload: bytes) -> None:
    """The donor's side: writes the state once."""
    store.set(key, payload)


def take(store: Any, key: str, joiners: int) -> bytes:
    """A joiner's side: waits for the state (the store's timeout bounds the wait), and the last of the
    ``joiners`` to take it deletes it."""
    raw = store.get(key)
    if store.add(f"{key}/taken", 1) >= joiners:
        store.delete_key(key)
        store.delete_key(f"{key}/taken")
    return raw
