"""The replicas' average and how far they are from it: global collectives, used only where asked.

Every function here is a collective over the default process group: every rank must call it, and
every replica waits for the slowest. The strategies call them at the end of ``fit``
(``average_at_end``), when a checkpoint is written (the consensus model in the main file), and when
``OuterStepMonitor`` is asked for the global spread or consensus validation. The k ranks of a
replica hold the same weights, so averaging over ranks is averaging over replicas.

With FSDP2 inside a replica its ranks hold different shards: each rank's local shards are averaged
over its ``group`` (the slice group: the same shard of every replica), its replicated tensors over
all ranks (``group=None``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_loco.driver.flat import FlatParameters


def _world(group: Optional[Any] = None) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def mean(tensors: Sequence[Tensor], device: torch.device, group: Optional[Any] = None) -> tuple[FlatParameters, Tensor]:
    """The average of ``tensors`` over the ranks of ``group`` (default: all ranks) as one flat
    float32 vector on ``device`` (one all-reduce)."""
    flat = FlatParameters(list(tensors), device)
    total = flat.gather()
    if _world(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        total.div_(_world(group))
    return flat, total


def average_into(tensors: Sequence[Tensor], device: torch.device, group: Optional[Any] = None) -> None:
    """Sets ``tensors`` to their average over ``group`` (one all-reduce)."""
    if tensors:
        flat, avg = mean(tensors, device, group)
        flat.scatter(avg)


@contextmanager
def swapped_in(
    tensors: Sequence[Tensor], device: torch.device, keep_on: torch.device, group: Optional[Any] = None
) -> Iterator[None]:
    """Puts the average over ``group`` into ``tensors`` and this replica's own values back
    afterwards, exactly, whatever the dtype (a copy is kept on ``keep_on``)."""
    own = FlatParameters(list(tensors), keep_on)
    saved = own.gather()
    average_into(tensors, device, group)
    try:
        yield
    finally:
        own.scatter(saved)


def spread(
    params: Sequence[Tensor], device: torch.device, group: Optional[Any] = None, replicas: Optional[int] = None
) -> float:
    """RMS distance of the replicas' parameters from their mean (two all-reduces): the papers'
    weight-spread diagnostic. ``params`` are averaged over ``group``; the squared distances of all
    ranks are summed and divided by ``replicas`` (default: the number of ranks, right when every
    rank holds its replica's whole model)."""
    flat, avg = mean(params, device, group)
    squared = (flat.gather().to(avg.device) - avg).pow(2).sum().reshape(1)
    if _world() > 1:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM)
    return (squared / (replicas or _world())).sqrt().item()


def state_dict(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``state`` with every floating-point tensor replaced by its average over replicas (new tensors;
    the model is not changed)."""
    keys = [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()]
    if not keys:
        return dict(state)
    flat, avg = mean([state[k] for k in keys], device)
    out = dict(state)
    for k, view in zip(keys, flat.views(avg)):
        out[k] = view.to(dtype=state[k].dtype, device=state[k].device).clone()
    return out


def first_error(message: Optional[str]) -> Optional[str]:
    """The lowest rank's error message, if any rank has one (one all-gather): lets every rank raise
    the same error when ranks see different things (e.g. a shared filesystem that lags)."""
    if _world() == 1:
        return message
    messages: list[Optional[str]] = [None] * _world()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m is not None), None)
