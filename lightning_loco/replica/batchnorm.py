"""BatchNorm's running statistics for the consensus model, re-estimated instead of averaged.

The consensus a run ends with (``average_at_end``, the checkpoint's main file) averages the replicas'
floating-point buffers with their weights. For BatchNorm that is the mean of each replica's running mean
and variance, taken under each replica's own weights: not the statistics of the consensus weights. This
module re-estimates them as ``torch.optim.swa_utils.update_bn`` does for an averaged model: the running
statistics reset, then a cumulative average over a number of training batches in training mode, without
gradients. :class:`BatchNormUpdate` does it after ``fit`` on every replica, on its own data, and then
averages the statistics over the replicas (one all-reduce): opt-in, a global collective once, at the end.

:func:`reestimate` is the part without Lightning (the simulator's benchmark uses it too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch import nn

_NORMS = (nn.modules.batchnorm._BatchNorm,)


def first_input(module: nn.Module, batch: Any) -> Any:
    """What ``update_bn`` feeds the model: a batch's first element when it is a list or tuple, else the batch."""
    return module(batch[0] if isinstance(batch, (list, tuple)) else batch)


@torch.no_grad()
def reestimate(module: nn.Module, batches: Iterable[Any], forward: Callable[[nn.Module, Any], Any] = first_input,
               device: Optional[torch.device] = None) -> int:
    """Resets every BatchNorm layer's running statistics of ``module`` and sets them to their cumulative average
    over ``batches`` (forward passes in training mode, no gradients). Returns the batches used; with none, or
    no BatchNorm layer, nothing changes."""
    norms = [m for m in module.modules() if isinstance(m, _NORMS) and m.track_running_stats]
    batches = list(batches)
    if not norms or not batches:
        return 0
    momenta = {m: m.momentum for m in norms}
    was_training = module.training
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches
    module.train()
    try:
        for batch in batches:
            forward(module, _to(batch, device))
    finally:
        for m, momentum in momenta.items():
            m.momentum = momentum
        module.train(was_training)
    return len(batches)


def _to(batch: Any, device: Optional[torch.device]) -> Any:
    if device is None:
        return batch
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch
