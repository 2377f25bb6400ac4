"""The strategies' elastic arguments: checked when the strategy is built, before any process starts.

Nothing here imports torchft at module level, so ``import lightning_loco`` works without it; asking for
elastic mode without torchft installed fails at once, naming the extra to install.
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

EXTRA = "pip install 'lightning-loco[elastic]'"
TORCHFT_VERSION = "0.2.0"  # the version the extra pins and the tests run


def require_torchft() -> Any:
    """Returns the ``torchft`` module, or raises ``ImportError`` naming the extra to install."""
    try:
        return importlib.import_module("torchft")
    except ImportError as err:
        raise ImportError(
            f"Elastic replicas (lighthouse=...) need torchft, which is not installed: {err}. Install the extra "
            f"with `{EXTRA}` (torchft=={TORCHFT_VERSION}), or leave lighthouse=None for the static launch."
        ) from err


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
            "by `lightning-loco lighthouse --min-replicas N`; None (the default) keeps the static launch."
        )


def _check_seconds(name: str, value: Any, default: Optional[float], advice: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r} (default {default}). {advice}")


@dataclass(frozen=True)
class ElasticConfig:
    """What a replica needs to take part in an elastic run.

    Args:
        lighthouse: the Lighthouse's ``HOST:PORT``.
        replica_id: this replica's name, unique among the live replicas. Members are ordered by it.
        outer_step_timeout: seconds an exchange waits for a partner before this replica finishes the
            round alone; also the limit of a process group's rendezvous.
        join_timeout: seconds a replica waits for a membership to include it (at start, or after it fell
            behind) and for the state it heals from.
        membership_every: K, outer steps between membership refreshes. A refresh is requested in the
            background at one switch and used at the next, K outer steps later.
        heal: a joining replica takes the weights and outer state of a live one (True) or keeps its own,
            taking only the counters (False: a replica resumed from its own checkpoint).
        heal_optimizer: with ``heal``, whether the state this replica hands joiners includes its inner
            optimizer's per-parameter state (True, default: AdamW's moments, twice the weights' bytes). False
            halves a heal with AdamW: a joiner's inner optimizer then starts afresh from the healed weights
            (its learning rate still the schedule's), so it is no longer a copy of its donor.
        straggler_timeout: seconds an exchange waits for a live partner that is late before it takes the
            round without it (the late one takes it alone too, and both take part in the next round); None
            (off): a live partner is waited for up to ``outer_step_timeout``. See
            :mod:`~lightning_loco.elastic.straggler`.
    """

    lighthouse: str
    replica_id: str
    outer_step_timeout: float = 120.0
    join_timeout: float = 600.0
    membership_every: int = 1
    heal: bool = True
    straggler_timeout: Optional[float] = None
    heal_optimizer: bool = True

    @property
    def url(self) -> str:
        return lighthouse_url(self.lighthouse)


def default_replica_id() -> str:
    """``HOST-PID``: unique among live processes, new for a restarted one."""
    return f"{socket.gethostname()}-{os.getpid()}"


def elastic_config(
    lighthouse: Optional[str],
    replica_id: Optional[str],
    outer_step_timeout: float,
    join_timeout: float,
    membership_every: int,
    heal: bool = True,
    straggler_timeout: Optional[float] = None,
    heal_optimizer: bool = True,
    *,
    algorithm_name: str,
    overlap_steps: Any,
    ranks_per_replica: int,
    topology: Optional[str] = None,
    lossy_wire: bool = False,
) -> Optional[ElasticConfig]:
    """Checks the elastic arguments of a strategy (``ValueError`` naming the argument, the value and what to
    do; ``ImportError`` naming the extra without torchft). ``None`` when ``lighthouse`` is ``None``."""
    if lighthouse is None:
        return None
    _check_address(lighthouse)
    if replica_id is not None and (not isinstance(replica_id, str) or not replica_id or "/" in replica_id):
        raise ValueError(
            f"replica_id={replica_id!r} must be a non-empty string without '/', unique among the live replicas "
            "(e.g. 'site-a'); None (the default) uses HOST-PID."
        )
    _check_seconds("outer_step_timeout", outer_step_timeout, 120.0,
                   "It bounds how long an exchange waits for a partner that died or hangs; make it longer than "
                   "the slowest exchange of one model copy between your sites.")
    _check_seconds("join_timeout", join_timeout, 600.0,
                   "It bounds how long a replica waits to be admitted and healed; make it longer than a few "
                   "outer steps.")
    if straggler_timeout is not None:
        _check_seconds("straggler_timeout", straggler_timeout, None,  # type: ignore[arg-type]
                       "It bounds how long an exchange waits for a live partner that is late; None (the default) "
                       "waits up to outer_step_timeout.")
        if not straggler_timeout < outer_step_timeout:
            raise ValueError(
                f"straggler_timeout={straggler_timeout} must be below outer_step_timeout={outer_step_timeout}: past "
                "outer_step_timeout a partner counts as failed (its membership's group is closed). Lower "
                "straggler_timeout, or leave it None."
            )
    for name, flag in (("heal", heal), ("heal_optimizer", heal_optimizer)):
        if not isinstance(flag, bool):
            raise ValueError(
                f"{name} must be True or False, got {flag!r} (default True: a joiner takes a live replica's whole "
                "training state; heal_optimizer=False leaves its inner optimizer's state out, halving a heal with "
                "AdamW)."
            )
    if isinstance(membership_every, bool) or not isinstance(membership_every, int) or membership_every < 1:
        raise ValueError(
            f"membership_every must be an integer >= 1, got {membership_every!r} (default 1: a membership refresh "
            "requested in the background at every outer step and used at the next). Larger values ask the "
            "Lighthouse less often and take longer to drop a dead replica."
        )
    if overlap_steps != 0:
        raise ValueError(
            f"overlap_steps={overlap_steps!r} with lighthouse=...: elastic mode switches memberships and heals "
            "joiners between rounds, where an overlapped round would still be in flight (with partners that may "
            "have left, and a state no joiner can take half-sent). Use overlap_steps=0 (the default)."
        )
    if ranks_per_replica != 1 and lossy_wire and algorithm_name == "diloco":
        raise ValueError(
            f"ranks_per_replica={ranks_per_replica} with lighthouse=... and a lossy wire format (wire_dtype or "
            "compression): DiLoCo's lossy all-reduce takes a second exchange after its ranks agreed on the round, "
            "which a replica of several ranks cannot yet undo on one rank alone. Use the float32 wire format, or "
            "one rank per replica."
        )
    if topology == "exponential":
        raise ValueError(
            "topology='exponential' with lighthouse=...: it needs a power-of-two number of replicas, and the "
            "number of live replicas changes. Use topology='random_pairs' (the default) or 'ring'."
        )
    require_torchft()
    return ElasticConfig(
        lighthouse=lighthouse, replica_id=replica_id or default_replica_id(),
        outer_step_timeout=float(outer_step_timeout),
        join_timeout=float(join_timeout), membership_every=membership_every, heal=heal,
        straggler_timeout=None if straggler_timeout is None else float(straggler_timeout),
        heal_optimizer=heal_optimizer,
    )


def elastic_seams(config: ElasticConfig, transport_factory: Any, sync_seconds: Any = None) -> tuple[Any, Any]:
    """The strategies' transport factory and driver plug-in factory for elastic replicas, after checking
    what elastic mode cannot combine with (raises ``ValueError`` saying what to pass instead). Every wire
    format works: the elastic transport encodes as the static one does
    (:mod:`~lightning_loco.transport.coded`)."""
    if sync_seconds is not None:
        raise ValueError(
            f"sync_seconds={sync_seconds} and lighthouse=... cannot be combined yet: a replica that heals takes a "
            "donor's step counts. Use sync_seconds=None with a lighthouse, or the static launch."
        )
    if transport_factory is not None:
        raise ValueError(
            "transport_factory and lighthouse=... are exclusive: elastic replicas bring their own transport "
            "(over the live members). Pass one of them."
        )
    from lightning_loco.elastic.plugin import ElasticPlugin
    from lightning_loco.elastic.transport import ElasticTransportFactory

    return ElasticTransportFactory(config), ElasticPlugin
