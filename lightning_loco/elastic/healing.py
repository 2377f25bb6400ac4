"""A switch's healing, as the membership carries it out: the donor hands its state to the joiners, a joiner
takes it and loads it. Each side runs in a background thread that the main thread waits for in slices
(signals stop it), with bounds from the membership's timeouts and errors that name them; the wire
protocol (the header through the store, the tensors over the membership's process group) is
:mod:`~lightning_loco.elastic.state_transfer`. ``side`` is what this rank's membership lends a heal
(:class:`Side`): its config, a client of the membership's store, ``check_stop`` and its log lines.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from lightning_loco.elastic import state_transfer
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.keys import heal_key
from lightning_loco.elastic.plan import Plan
from lightning_loco.elastic.waiting import GRACE_S, in_thread, wait_in_slices
from lightning_loco.replica.state_digest import StateMismatchError

log = logging.getLogger("lightning_loco")


@dataclass(frozen=True)
class Side:
    """What one rank's membership lends a heal."""

    replica_id: str
    config: ElasticConfig
    store_client: Callable[[Plan], Any]  # a client of the membership's store, under this rank's prefix
    check_stop: Callable[[str], None]  # called between the slices of a wait (may raise to stop it)
    info: Callable[..., None]  # logs what happened (INFO on the replica's rank 0)


def size(nbytes: int) -> str:
    """``12.3 MB``, ``4.5 kB``: a state's size for a log line."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:.1f} kB"


def taken(state: dict[str, Any], everything: bool) -> str:
    """What a joiner took of ``state``, for its log line."""
    extra = state.get("extra")
    if not everything:
        return "its step counts (heal=False: own weights and outer state kept)"
    if isinstance(extra, dict) and extra.get("optimizers", ()) is None:
        return "its state except its inner optimizer's (heal_optimizer=False: own kept, none after a restart)"
    return "its state"


def _receive(member: Side, plan: Plan, pg: Optional[Any], incoming: Any, everything: bool,
             receive_into: Optional[Callable[[Any], Any]]) -> tuple[dict[str, Any], Optional[dict[int, Any]]]:
    """The donor's tensors over ``pg`` (interruptibly), in place where ``receive_into`` offers tensors of this
    replica's own."""
    config = member.config
    into = None
    if everything and receive_into is not None and incoming.skeleton is not None:
        into = state_transfer.in_place(incoming.skeleton, receive_into(incoming.skeleton), incoming.metas)
    src, timeout = plan.members.index(plan.donor or ""), config.outer_step_timeout
    thread, box = in_thread(lambda: incoming.receive(pg, src, timeout, into), "lightning_loco-heal")
    ended = wait_in_slices(thread, incoming.bound(timeout) + GRACE_S, member.check_stop,
                           f"the state of replica {plan.donor!r}")
    if isinstance(box.get("error"), StateMismatchError):  # every tensor arrived, but not as the donor sent it
        raise box["error"]
    if "result" not in box:
        raise RuntimeError(
            f"Replica {member.replica_id!r} joined membership {plan.quorum_id} but the transfer of replica "
            f"{plan.donor!r}'s state broke off ({box.get('error') if ended else 'no answer'}; "
            f"outer_step_timeout={timeout:g} s bounds each message). Nothing was loaded{_partly(into)}; restart it to "
            "try again."
        ) from box.get("error")
    return box["result"], into


def _partly(into: Optional[dict[int, Any]]) -> str:
    return (" (its outer state, received in place, may be partly written: it is not saved in a checkpoint)"
            if into else "")


def _header(plan: Plan) -> dict[str, Any]:
    return state_transfer.header(plan.quorum_id, plan.switch, plan.joiners, plan.donor or "")


def hand_state(member: Side, plan: Plan, pg: Optional[Any], state: dict[str, Any]) -> None:
    """Hands this replica's state to the plan's joiners: a header through the store, the tensors over the
    membership's process group (see :mod:`~lightning_loco.elastic.state_transfer`); waits until they are sent, as
    they are views of the live state."""
    started, timeout = time.perf_counter(), member.config.outer_step_timeout
    outgoing = state_transfer.prepare(state, _header(plan), over_group=pg is not None,
                                      verify=member.config.verify_heal)
    key, ranks = heal_key(plan.joiners), [plan.members.index(j) for j in plan.joiners]
    thread, box = in_thread(lambda: outgoing.send(pg, member.store_client(plan), key, ranks, timeout),
                            "lightning_loco-heal")
    wait_in_slices(thread, member.config.join_timeout + outgoing.bound(timeout) + GRACE_S, member.check_stop,
                   "the joiners to take this replica's state")
    if "error" in box or thread.is_alive():
        log.warning("Replica %r could not hand its state to %s for membership %d (%s); they stop with an error.",
                    member.replica_id, list(plan.joiners), plan.quorum_id, box.get("error", "no answer"))
        return
    member.info("Replica %r sent its state to %s for membership %d at outer step %d: %s in %.2f s.",
               member.replica_id, list(plan.joiners), plan.quorum_id, plan.switch, size(outgoing.nbytes),
               time.perf_counter() - started)


def take_state(member: Side, plan: Plan, pg: Optional[Any], load: Callable[[dict[str, Any], bool], int],
               receive_into: Optional[Callable[[Any], Any]] = None) -> int:
    """Takes the donor's state for ``plan`` (interruptibly: its header from the store, its tensors over the
    membership's process group ``pg``) and loads it; returns the round it stands at. ``receive_into(skeleton)``,
    for a joiner that takes the whole state: checks the donor's state before any tensor crosses (raising if this
    replica cannot take it) and returns tensors of this replica's own that the donor's may be received into
    in place (see :func:`~lightning_loco.elastic.state_transfer.in_place`)."""
    config, started = member.config, time.perf_counter()
    key = heal_key(plan.joiners)
    thread, box = in_thread(lambda: state_transfer.take(member.store_client(plan), key, len(plan.joiners)),
                            "lightning_loco-heal")
    ended = wait_in_slices(thread, config.join_timeout + GRACE_S, member.check_stop,
                           f"the state of replica {plan.donor!r}")
    if "result" not in box:
        raise RuntimeError(
            f"Replica {member.replica_id!r} joined membership {plan.quorum_id} but got no state from replica "
            f"{plan.donor!r} within join_timeout={config.join_timeout:g} s "
            f"({box.get('error') if ended else 'no answer'}); restart it to try again."
        ) from box.get("error")
    incoming = state_transfer.Incoming(box["result"], _header(plan), member.replica_id)
    everything = config.heal or member.replica_id in plan.behind
    try:
        state, into = _receive(member, plan, pg, incoming, everything, receive_into)
        next_round = load(state, everything)
    except BaseException:
        # A refusal, a broken transfer or SIGTERM: abort the group, so that a receive still running stops
        # writing into this replica's own tensors and the donor's sends fail at once instead of waiting.
        if pg is not None:
            pg.abort()
        raise
    if next_round != plan.switch:
        raise RuntimeError(
            f"Replica {member.replica_id!r} healed from {plan.donor!r} to outer step {next_round}, but membership "
            f"{plan.quorum_id} starts at outer step {plan.switch}; restart this replica to join again."
        )
    what = taken(state, everything)
    member.info("Replica %r joined membership %d at outer step %d and took %s from %r: %s in %.2f s%s.",
               member.replica_id, plan.quorum_id, plan.switch, what, plan.donor, size(incoming.nbytes),
               time.perf_counter() - started, ", checked against the donor's digests" if incoming.verified else "")
    return next_round
