"""The callback that re-estimates the consensus model's BatchNorm statistics after ``fit``
(:mod:`lightning_loco.replica.batchnorm`)."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch import nn

from lightning_loco.replica.batchnorm import first_input, reestimate


class BatchNormUpdate(pl.Callback):
    """After ``fit`` ends with the replicas averaged (``average_at_end``), every replica runs ``batches`` of its
    own training batches through the consensus model in training mode, without gradients, to re-estimate
    BatchNorm's running statistics (as ``torch.optim.swa_utils.update_bn``); the statistics are then averaged
    over the replicas. The model every rank holds after ``fit`` then has statistics of its own weights,
    instead of the average of the replicas' statistics under their own weights.

    A **global collective**, once, after training (one all-reduce of the weights and buffers, as the end of
    fit's average); elastic replicas, which have no collective over each other, are refused when fit starts.

    Args:
        batches: training batches per replica (default 32). Fewer are used if an epoch holds fewer.
        forward: how to run the module on a batch (default: ``module(batch[0])`` for a list or tuple,
            ``module(batch)`` otherwise, as ``update_bn`` does).
    """

    def __init__(self, batches: int = 32, forward: Optional[Callable[[nn.Module, Any], Any]] = None) -> None:
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"batches must be an integer >= 1, got {batches!r} (default 32).")
        self.batches, self.forward = batches, forward or first_input
        self.used: Optional[int] = None  # batches this rank ran, after fit

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        strategy: Any = trainer.strategy
        if stage != "fit" or not hasattr(strategy, "average_replicas"):
            return
        if strategy.elastic is not None or not strategy.options.averages_at_end:
            raise ValueError(
                "BatchNormUpdate re-estimates the statistics of the replicas' consensus, which fit ends with only "
                "with average_at_end (the default, except for elastic replicas, which have no collective over each "
                "other). Leave average_at_end=None in a static launch, or remove the callback."
            )

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy: Any = trainer.strategy
        if not hasattr(strategy, "average_replicas") or trainer.interrupted:
            return
        loaders = trainer.train_dataloader
        flat = loaders.flattened if isinstance(loaders, CombinedLoader) else [loaders]
        loader = next((x for x in flat if x is not None), None)
        batches = list(itertools.islice(iter(loader), self.batches)) if loader is not None else []
        device = next((p.device for p in pl_module.parameters()), None)
        self.used = reestimate(pl_module, batches, self.forward, device)
        strategy.average_replicas()  # the statistics, averaged over the replicas (the weights are equal already)
