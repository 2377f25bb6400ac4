"""What a membership does when its process group cannot be set up.

A membership's group is set up by a rendezvous of its members (:mod:`~lightning_loco.elastic.membership`).
Two kinds of failure, told apart by the error's type:

* *transient*: the network or a member failed during the rendezvous (a timeout, a refused or reset
  connection, gloo's ``RuntimeError`` when a peer left): that membership's rounds are taken alone, the next
  membership gets a fresh group, and the failure is counted (``Membership.group_errors``, each round's
  ``OuterStepReport.membership_errors`` and ``outer/membership_errors`` in the logger) so that a run never
  trains alone unseen;
* anything else (an ``AttributeError``, a ``TypeError``, an ``ImportError``: the installed torchft is not
  the one these calls are written for, or a bug): no membership would ever get a group, so the run stops
  with that error (:class:`GroupSetupError`) instead of training every replica alone.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lightning_loco.elastic.torchft_version import TORCHFT_VERSION

log = logging.getLogger("lightning_loco")

_NOT_TRANSIENT = (NotImplementedError, RecursionError)  # RuntimeErrors that a new rendezvous does not cure


class GroupSetupError(RuntimeError):
    """A membership's process group could not be set up for a reason another membership would meet too."""


def transient(err: BaseException) -> bool:
    """Whether a failed rendezvous may succeed at the next membership: the network or a member failed
    (``OSError``, which covers timeouts and refused or reset connections, or ``RuntimeError``, which gloo and
    torch's stores raise)."""
    return isinstance(err, (OSError, RuntimeError)) and not isinstance(err, _NOT_TRANSIENT)


def group_setup_failed(replica_id: str, quorum_id: int, err: Exception, errors: list[dict[str, Any]]) -> None:
    """Records a transient failure to set up membership ``quorum_id``'s group in ``errors`` (its rounds are
    then taken alone), or raises :class:`GroupSetupError` for any other."""
    if not transient(err):
        raise GroupSetupError(
            f"Replica {replica_id!r}: the process group of membership {quorum_id} could not be set up: "
            f"{type(err).__name__}: {err}. This is no network failure: every membership would meet it and every "
            f"replica would train alone, so the run stops. Check that torchft {TORCHFT_VERSION} is installed (`pip "
            f"install torchft=={TORCHFT_VERSION}`), then restart this replica."
        ) from err
    errors.append({"quorum_id": quorum_id, "error": f"{type(err).__name__}: {err}"[:200], "time": time.time()})
    log.warning("Replica %r: the process group of membership %d could not be set up (%s); this membership's rounds "
                "are taken alone (%d such membership(s) so far, logged as outer/membership_errors).", replica_id,
                quorum_id, err, len(errors))
