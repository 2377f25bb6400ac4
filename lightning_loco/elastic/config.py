"""The strategies' ``elastic=`` option: :class:`ElasticConfig`, checked when it is built, before any process
starts (how its fields meet each other and the other options is for the rules of :mod:`lightning_loco.rules`).

Nothing here imports torchft at module level, so ``import lightning_loco`` works without it; asking for
elastic mode without torchft installed fails when the strategy is built, naming the extra to install
(:func:`require_torchft`).
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

from lightning_loco.elastic.torchft_version import TORCHFT_VERSION, check_torchft_version

EXTRA = "pip install 'lightning-loco[elastic]'"


def require_torchft() -> Any:
    """Returns the ``torchft`` module, or raises ``ImportError`` naming the extra to install (or the supported
    version, when another one is installed)."""
    try:
        module = importlib.import_module("torchft")
    except ImportError as err:
        raise ImportError(
            f"Elastic replicas (elastic=ElasticConfig(...)) need torchft, which is not installed: {err}. Install the "
            f"extra with `{EXTRA}` (torchft=={TORCHFT_VERSION}), or leave elastic=None for the static launch."
        ) from err
    return check_torchft_version(module)


def lighthouse_url(address: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT`` → the URL torchft's client takes."""
    return address if "://" in address else f"http://{address}"


def _check_address(address: Any) -> None:
    ok = isinstance(address, str) and address.strip() == address and address != ""
    if ok:
        host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
        ok = bool(host) and port.isdigit() and 0 < int(port) < 65536
    if not ok:
        raise ValueError(
            f"lighthouse={address!r} is not a Lighthouse address. Give HOST:PORT (or http://HOST:PORT) as printed "
            "by `lightning-loco lighthouse --min-replicas N`; elastic=None (the default) keeps the static launch."
        )


def _check_seconds(name: str, value: Any, default: Optional[float], advice: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r} (default {default}). {advice}")


def default_replica_id() -> str:
    """``HOST-PID``: unique among live processes, new for a restarted one."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic replicas (docs/elastic.md): this Trainer is one replica, its own job, and replicas that
    die or join do not stop the others. torchft's Lighthouse agrees on the live replicas (needs
    ``pip install 'lightning-loco[elastic]'``).

    Args:
        lighthouse: ``HOST:PORT`` of a Lighthouse (``lightning-loco lighthouse --min-replicas N`` prints it).
        replica_id: this replica's name, unique among the live replicas; members are ordered by it
            (None: HOST-PID, new for every restart).
        outer_step_timeout: seconds an exchange waits for a partner before this replica finishes the
            round alone; also the limit of a process group's rendezvous and of the replica's own
            collectives (default 120: longer than the slowest exchange of one model copy between sites).
        join_timeout: seconds a replica waits to be admitted to a membership and for the state it heals
            from (default 600: longer than a few outer steps).
        membership_every: K, outer steps between membership refreshes (default 1). A refresh is asked
            for in the background at one switch and used at the next, K outer steps later; larger
            values ask the Lighthouse less often and take longer to drop a dead replica.
        heal: a joiner takes a live replica's whole training state (True, default) or only its step
            counts (False: a replica resumed from its own checkpoint).
        heal_optimizer: with ``heal``, whether the state this replica hands joiners includes its inner
            optimizer's (True, default: AdamW's moments, twice the weights' bytes). False halves a heal
            with AdamW: the joiner's inner optimizer starts afresh (at the schedule's learning rate), so
            it is no longer a copy of its donor.
        verify_heal: whether the state this replica hands joiners carries the digests of its tensors (two int64
            numbers each, in the header it writes anyway), which a joiner checks what it received against before
            it loads anything (``StateMismatchError`` naming the tensor otherwise). Default False: the digests on
            both sides cost about as much as the transfer on loopback (docs/elastic.md, Healing).
        straggler_timeout: seconds an exchange waits for a live partner that is late before both take
            that round alone (DiLoCo: drop it) and meet again next round (default None: a live partner
            is waited for up to ``outer_step_timeout``). See :mod:`~lightning_loco.elastic.straggler`.
        data_slots: N, the parts the training data is cut into, one per replica slot, as a static launch of N
            replicas cuts it (default None: every replica reads all of it, in an order of its own; 1: all
            read the same data in the same order). See :mod:`~lightning_loco.elastic.data`.
        data_slot: this replica's part, 0 to N − 1 (default None: the number ``replica_id`` ends with,
            ``site-2`` → 2).
    """

    lighthouse: str
    replica_id: Optional[str] = None
    outer_step_timeout: float = 120.0
    join_timeout: float = 600.0
    membership_every: int = 1
    heal: bool = True
    heal_optimizer: bool = True
    verify_heal: bool = False
    straggler_timeout: Optional[float] = None
    data_slots: Optional[int] = None
    data_slot: Optional[int] = None

    def __post_init__(self) -> None:
        if self.replica_id is None:  # resolved once, where the config is built
            object.__setattr__(self, "replica_id", default_replica_id())

    def check(self) -> None:
        """Raises ``ValueError`` naming a field that holds no value it can take (checked with the options); how
        the fields meet each other (``straggler_timeout`` below ``outer_step_timeout``, ``data_slot`` within
        ``data_slots``, a ``replica_id`` that names its slot) is for the rules of :mod:`lightning_loco.rules`."""
        _check_address(self.lighthouse)
        replica_id = self.replica_id
        if replica_id is not None and (not isinstance(replica_id, str) or not replica_id or "/" in replica_id):
            raise ValueError(
                f"replica_id={replica_id!r} must be a non-empty string without '/', unique among the live replicas "
                "(e.g. 'site-a'); None (the default) uses HOST-PID."
            )
        _check_seconds("outer_step_timeout", self.outer_step_timeout, 120.0,
                       "It bounds how long an exchange waits for a partner that died or hangs; make it longer than "
                       "the slowest exchange of one model copy between your sites.")
        _check_seconds("join_timeout", self.join_timeout, 600.0,
                       "It bounds how long a replica waits to be admitted and healed; make it longer than a few "
                       "outer steps.")
        if self.straggler_timeout is not None:
            _check_seconds("straggler_timeout", self.straggler_timeout, None,
                           "It bounds how long an exchange waits for a live partner that is late; None (the default) "
                           "waits up to outer_step_timeout.")
        for name, flag in (("heal", self.heal), ("heal_optimizer", self.heal_optimizer)):
            if not isinstance(flag, bool):
                raise ValueError(
                    f"{name} must be True or False, got {flag!r} (default True: a joiner takes a live replica's "
                    "whole training state; heal_optimizer=False leaves its inner optimizer's state out, halving a "
                    "heal with AdamW)."
                )
        if not isinstance(self.verify_heal, bool):
            raise ValueError(
                f"verify_heal must be True or False, got {self.verify_heal!r} (default False; True: a joiner checks "
                "the state it received against the digests its donor sent with it)."
            )
        every = self.membership_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"membership_every must be an integer >= 1, got {every!r} (default 1: a membership refresh requested "
                "in the background at every outer step and used at the next). Larger values ask the Lighthouse "
                "less often and take longer to drop a dead replica."
            )

        self._check_data()

    def _check_data(self) -> None:
        slots, slot = self.data_slots, self.data_slot
        for name, value in (("data_slots", slots), ("data_slot", slot)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= {1 if name == 'data_slots' else 0}, got {value!r}.")
        if slots is not None and slots < 1:
            raise ValueError(f"data_slots must be an integer >= 1, got {slots!r}.")

    @property
    def url(self) -> str:
        return lighthouse_url(self.lighthouse)

    @property
    def name(self) -> str:
        """The replica id, resolved (never None once built)."""
        assert self.replica_id is not None
        return self.replica_id
