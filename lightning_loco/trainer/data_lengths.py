"""The replicas' training data lengths, read from Lightning's Trainer, for :mod:`lightning_loco.replica.data_plan`:
when fit starts, every rank's planned optimizer steps are compared (through the process group's store), and the
strategies' transport learns which peers' fits ended, so that a replica whose data ran out is named within seconds.

Static runs only: an elastic replica may leave the run, and its peers go on without it.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_loco.replica.data_plan import UNKNOWN, PeerStops, check_plans, fits, publish_failure
from lightning_loco.transport.torch_dist import TorchDistributedTransport


def planned_steps(trainer: "pl.Trainer") -> int:
    """The optimizer steps this rank's fit will take if nothing stops it early (Lightning's estimate, from the
    loader's length, ``limit_train_batches``, ``accumulate_grad_batches``, ``max_epochs`` and ``max_steps``), or
    ``UNKNOWN`` (an iterable dataset without ``max_steps``, or endless training)."""
    steps = trainer.estimated_stepping_batches
    if math.isinf(steps) or steps < 0:
        return UNKNOWN
    return int(steps)


def watch_peers(strategy: Any, trainer: "pl.Trainer") -> None:
    """When training starts (every rank): refuses plans that differ, then gives the replica's transport a
    :class:`~lightning_loco.replica.data_plan.PeerStops`."""
    if strategy.elastic is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    k, rank, prefix = strategy.ranks_per_replica, dist.get_rank(), fits.prefix()
    store = dist.distributed_c10d._get_default_store()
    timeout = strategy._timeout.total_seconds() if strategy._timeout is not None else 1800.0
    check_plans(store, prefix, rank, dist.get_world_size(), planned_steps(trainer), k, timeout)
    transport = strategy.run.driver.transport if strategy.run is not None else None
    if isinstance(transport, TorchDistributedTransport):
        stops = PeerStops(store, prefix, rank, k)
        stops.current_step = lambda: trainer.global_step
        transport.peer_stops = stops  # type: ignore[attr-defined]


def say_fit_ended(strategy: Any, trainer: "pl.Trainer") -> None:
    """When training ends (before the rounds in flight land): this rank posts no more exchanges; why."""
    transport = strategy.run.driver.transport if strategy.run is not None else None
    stops = getattr(transport, "peer_stops", None)
    fits.end()
    if not isinstance(stops, PeerStops):
        return
    if 0 <= trainer.max_steps <= trainer.global_step:
        reason = f"reached max_steps={trainer.max_steps}"
    elif trainer.should_stop:
        reason = "stopped early (trainer.should_stop: a callback, max_time or a signal)"
    else:
        reason = f"ran out of training data (its loader ended in its last epoch, max_epochs={trainer.max_epochs})"
    stops.publish(trainer.global_step, reason)


def say_fit_failed(strategy: Any, error: BaseException) -> None:
    """When fit fails on this rank (every static run): its peers waiting to compare plans stop at once."""
    if strategy.elastic is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        publish_failure(dist.distributed_c10d._get_default_store(), fits.prefix(), dist.get_rank(), error)
    except Exception:  # noqa: BLE001  # the store may be gone with the failure: nothing more to tell
        pass
    fits.end()
