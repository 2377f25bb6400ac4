"""Replicas whose data ends at different steps, named at once instead of after the process-group timeout.

A static run's replicas meet at every round, so each must take the same number of optimizer steps: a replica
whose loader ends first stops, and its peers wait for it at their next exchange until the timeout (30 min by
default), with an error that blames the network. Two checks find it earlier:

* :func:`check_plans`, when fit starts, where every rank knows how many optimizer steps its fit will take (its
  loader's length, ``limit_train_batches``, ``accumulate_grad_batches``, ``max_epochs``, ``max_steps``): every
  rank writes its number in the process group's store and reads everyone's (a key each, no collective on the
  process group); ranks whose plans differ are refused on every rank at once, with the step each would stop at
  and the fix.
* :class:`PeerStops`, when a length was not known (an iterable dataset): a replica whose fit ends publishes, in the
  process group's store, how many exchanges it posted with each peer; a peer waiting on an exchange that replica
  never posted reads it there (every ``check_every_s`` seconds while it waits) and raises :class:`UnevenDataError`
  naming the replica, the step it stopped at, and why.

Lightning-free: the strategies' glue (:mod:`lightning_loco.trainer.data_lengths`) reads the plans from the Trainer.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable, Optional

from lightning_loco.transport.base import PeerError, Pending

__all__ = [
    "FIX", "FitNumbers", "PeerStops", "UnevenDataError", "check_plans", "fits", "publish_failure", "uneven_plans",
]

UNKNOWN = -1  # a plan that cannot be known when fit starts (an iterable dataset without max_steps)
FIX = ("Set max_steps (with max_epochs=-1 a loader that ends starts its next epoch, so every replica takes "
       "exactly max_steps steps), give every replica a shard of the same length (Lightning's DistributedSampler "
       "pads them to it), or run elastic (ElasticConfig), where a replica may leave the run.")


class UnevenDataError(PeerError):
    """Replicas of a static run would take, or took, different numbers of optimizer steps."""


def uneven_plans(plans: Sequence[int], ranks_per_replica: int = 1) -> Optional[str]:
    """The message refusing ``plans`` (each global rank's planned optimizer steps for the fit, ``UNKNOWN`` where
    not known), or ``None`` when the known ones agree."""
    known = {rank: steps for rank, steps in enumerate(plans) if steps != UNKNOWN}
    if len(set(known.values())) <= 1:
        return None
    longest = max(known.values())
    short = sorted(rank for rank, steps in known.items() if steps < longest)

    def who(rank: int) -> str:
        return f"replica {rank // ranks_per_replica}" + (f" (rank {rank})" if ranks_per_replica > 1 else "")

    stops = "; ".join(f"{who(rank)} would stop at step {known[rank]}" for rank in short)
    full = sorted(rank for rank, steps in known.items() if steps == longest)
    return (
        f"The replicas' training data would end at different steps: {stops}, while "
        f"{', '.join(who(rank) for rank in full)} would go on to step {longest}. A replica that stops leaves its "
        "peers waiting for it at their next exchange until the process-group timeout. Each plan is the fit's "
        "optimizer steps from len(train_dataloader), limit_train_batches, accumulate_grad_batches, max_epochs and "
        f"max_steps. {FIX}"
    )


class FitNumbers:
    """Numbers this process's fits for the store's keys: every rank runs the same fits in the same order, and a
    fit that fails before its number was taken (an error in a callback's ``on_train_start``) takes it then, so
    that the ranks' numbers stay aligned."""

    def __init__(self) -> None:
        self.next, self.current = 0, None  # type: tuple[int, Optional[int]]

    def prefix(self) -> str:
        """This fit's keys' prefix (taking its number if not taken yet)."""
        if self.current is None:
            self.current, self.next = self.next, self.next + 1
        return f"lightning_loco/fit{self.current}/"

    def end(self) -> None:
        """This fit is over: the next ``prefix`` is the next fit's."""
        self.current = None


fits = FitNumbers()


def publish_failure(store: Any, prefix: str, rank: int, error: BaseException) -> None:
    """This rank's fit failed with ``error`` before or while the plans were compared (its peers stop waiting)."""
    store.set(f"{prefix}failed/{rank}", f"{type(error).__name__}: {error}"[:2000])


DONE_WAIT_S = 10.0  # how long rank 0 waits, before it stops, for every rank to have read the plans


def check_plans(store: Any, prefix: str, rank: int, world: int, steps: int, ranks_per_replica: int = 1,
                timeout_s: float = 1800.0) -> None:
    """Shares every rank's planned optimizer steps through the process group's ``store`` (one small key each, no
    collective on the process group) and raises :class:`UnevenDataError` on every rank if the known ones differ.
    A rank whose fit failed first (:func:`publish_failure`) is named at once (:class:`PeerError`); one that never
    comes is waited for ``timeout_s`` seconds. Every rank of the world must call it, with the same ``prefix``."""
    store.set(f"{prefix}plan/{rank}", str(steps))
    deadline = time.monotonic() + timeout_s
    _wait_for_all(store, prefix, "plan", world, ranks_per_replica, deadline)
    message = uneven_plans([int(store.get(f"{prefix}plan/{r}")) for r in range(world)], ranks_per_replica)
    if message is not None:  # everyone has read every plan before anyone stops (rank 0 may hold the store)
        store.set(f"{prefix}read/{rank}", "1")
        _wait_for_all(store, prefix, "read", world, ranks_per_replica, deadline)
        # and rank 0, whose process may serve the store, stops last: a rank still inside its wait for the "read"
        # keys needs the server to answer it (it failed with "Broken pipe" when rank 0 had already exited)
        # (bounded by DONE_WAIT_S: a rank that died after reading leaves only its error to say)
        store.set(f"{prefix}done/{rank}", "1")
        if rank == 0:
            try:
                _wait_for_all(store, prefix, "done", world, ranks_per_replica,
                              min(deadline, time.monotonic() + DONE_WAIT_S))
            except Exception:  # noqa: BLE001  # the uneven data is the error to raise, whoever else stopped
                pass
        raise UnevenDataError(message)


def _wait_for_all(store: Any, prefix: str, name: str, world: int, ranks_per_replica: int, deadline: float) -> None:
    """Waits until every rank has set its ``name`` key, naming at once a rank whose fit failed first."""
    keys = [f"{prefix}{name}/{r}" for r in range(world)]
    while True:
        try:
            store.wait(keys, timedelta(seconds=1))
            return
        except Exception:  # noqa: BLE001  # the store's timeout (DistStoreError, RuntimeError in older torch)
            failed = [r for r in range(world) if store.check([f"{prefix}failed/{r}"])]
            if failed:
                r = failed[0]
                error = store.get(f"{prefix}failed/{r}").decode(errors="replace")
                raise PeerError(f"Replica {r // ranks_per_replica} (rank {r}) failed as fit started ({error}), so "
                                "this replica stops too; look at its log for the cause.") from None
            if time.monotonic() > deadline:
                raise


class PeerStops:
    """One rank's view of which peers stopped, through the process group's store (see the module docstring).

    The transport calls :meth:`posted` for every exchange it posts (numbering this rank's exchanges with each
    peer replica) and :meth:`wait_for` before it blocks on one. :meth:`publish` says this rank's fit ended.

    Args:
        store: the default process group's store (``dist.distributed_c10d._get_default_store()``).
        prefix: this fit's keys' (:data:`fits`).
        rank: this global rank; ``ranks_per_replica``: k (rank j of a replica exchanges with rank j of its peers).
        check_every_s: how often a wait looks in the store.
    """

    def __init__(self, store: Any, prefix: str, rank: int, ranks_per_replica: int = 1, check_every_s: float = 0.5
                 ) -> None:
        self.store, self.rank, self.k = store, rank, ranks_per_replica
        self.replica, self.local_rank = divmod(rank, ranks_per_replica)
        self.check_every_s = check_every_s
        self.prefix = f"{prefix}stopped/"
        self.exchanges: dict[int, int] = defaultdict(int)  # peer replica -> exchanges posted with it
        self.current_step: Optional[Callable[[], int]] = None  # for the message: this rank's optimizer step

    def posted(self, peers: Sequence[int]) -> dict[int, int]:
        """Counts an exchange posted with ``peers``; returns its number with each (1 for the first)."""
        for j in peers:
            self.exchanges[j] += 1
        return {j: self.exchanges[j] for j in peers}

    def publish(self, step: int, reason: str) -> None:
        """This rank's fit ended at optimizer step ``step`` because of ``reason``; it posts no more exchanges."""
        value = {"step": step, "reason": reason, "posted": {str(j): n for j, n in self.exchanges.items()}}
        self.store.set(self.prefix + str(self.rank), json.dumps(value))

    def check(self, numbers: dict[int, int], step: Optional[int] = None) -> None:
        """Raises :class:`UnevenDataError` if a peer replica of ``numbers`` (peer -> this exchange's number with
        it) stopped without posting it."""
        for j, n in numbers.items():
            key = self.prefix + str(j * self.k + self.local_rank)
            if not self.store.check([key]):
                continue
            stopped = json.loads(self.store.get(key))
            if int(stopped["posted"].get(str(self.replica), 0)) >= n:
                continue
            at = "" if step is None else f" at its step {step} (trainer.global_step)"
            raise UnevenDataError(
                f"Replica {j} {stopped['reason']}: its fit ended at step {stopped['step']} without posting "
                f"exchange {n} with replica {self.replica}, which replica {self.replica} waits for{at}. Every "
                f"replica of a static run must take the same number of optimizer steps. {FIX}"
            )

    def wait_for(self, pending: Pending) -> None:
        """Waits for ``pending`` to complete, looking in the store every ``check_every_s`` seconds; returns at once
        where completion cannot be watched by a thread (NCCL's works, an exchange with nobody)."""
        numbers = pending.exchange_numbers
        if not numbers or pending.done():
            return
        watcher = pending.watch().watcher
        if watcher is None:
            return
        while True:
            watcher.join(self.check_every_s)
            if not watcher.is_alive():
                return
            self.check(numbers, None if self.current_step is None else self.current_step())
