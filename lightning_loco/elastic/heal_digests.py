"""A heal's check: the donor's digests of the tensors it hands a joiner, in the header it writes anyway, and the
joiner's comparison of what it received with them, before the state is assembled (so before anything is loaded).

The digests are :mod:`lightning_loco.replica.state_digest`'s (two int64 numbers per tensor, computed where the
tensor lives, one tensor at a time): no message of their own and no collective, only the digests on each side.
:mod:`~lightning_loco.elastic.state_transfer` calls both where a state leaves and arrives, on the point-to-point
path and the store's alike; the donor's ``ElasticConfig(verify_heal=True)`` asks for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from torch import Tensor

from lightning_loco.replica.state_digest import Scratch, StateMismatchError, digest, digests, first_difference

__all__ = ["check", "sign"]


def sign(tensors: Sequence[Tensor]) -> list[tuple[int, int]]:
    """The digests of ``tensors``, in order (their temporaries reused from one tensor to the next)."""
    scratch: Scratch = {}
    return [digest(t, scratch) for t in tensors]


def check(names: Sequence[str], tensors: Sequence[Tensor], signed: Sequence[Sequence[int]],
          membership: dict[str, Any], me: Optional[str] = None) -> None:
    """Raises :class:`~lightning_loco.replica.state_digest.StateMismatchError` if the ``tensors`` received (named by
    their paths in the state, ``names``) are not those the donor digested (``signed``, from its header): it names
    the first that differs, the donor, the joiner (``me``; the header's joiners without it) and the membership
    (``membership``, the header's: see :func:`~lightning_loco.elastic.state_transfer.header`)."""
    if len(signed) != len(names):
        what = f"the donor's header digests {len(signed)} tensors and {len(names)} arrived"
    else:
        want = {name: (int(pair[0]), int(pair[1])) for name, pair in zip(names, signed)}
        got = digests(zip(names, tensors))
        name = first_difference(want, got)
        if name is None:
            return
        what = (f"its tensor {name!r} is not the one the donor sent (digests {got.get(name)} against "
                f"{want.get(name)} in the donor's header)")
    who = f"Replica {me!r}" if me else f"A joiner of {list(membership['joiners'])}"
    raise StateMismatchError(
        f"{who} received replica {membership['donor']!r}'s state for membership {membership['quorum_id']} (from outer "
        f"step {membership['first_round']}), but {what}: the state was corrupted or changed in transit. The heal is "
        "not loaded; restart this replica to heal again."
    )
