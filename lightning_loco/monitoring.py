"""Watching low-communication training in TensorBoard (or any Lightning logger).

``OuterStepMonitor`` logs, at each outer step's own global step (nothing is re-emitted between outer
steps):

* ``outer/step``, ``outer/seconds`` (the whole outer step), ``outer/comm_seconds`` (its
  communication), ``outer/bytes_sent``, ``outer/bytes_received``, ``outer/pseudo_gradient_norm``
  (‖θ − anchor‖ before the step), ``outer/update_norm`` (how far the anchor moved) and
  ``outer/peer`` (the first peer of the logged replica, −1 when it met nobody). Loggers write on
  rank 0, so these describe rank 0's replica; bytes and times are alike on every replica.
* with ``overlap_steps``, at each landing: ``outer/overlap_steps`` (τ used), ``outer/comm_seconds``
  is then the time the landing waited for the exchange (the exposed communication),
  ``outer/exchange_seconds`` how long the exchange took from posting to completion (to within one
  inner step), and ``outer/correction_norm`` the norm of the change applied at the landing.
* ``outer/replica_spread`` every ``spread_every`` outer steps: the RMS distance of the replicas from
  their mean, the papers' weight-spread diagnostic (two all-reduces, so not every step), measured
  where a round starts (the same step on every replica, whatever τ).
* ``val/loss_replicas``: the mean over replicas of each replica's validation loss on its share of the
  validation set (the papers' metric), and with ``consensus_validation`` ``val/loss_consensus``: the
  loss of the replicas' average, swapped in for that pass and swapped out again before any
  checkpoint can see it. ``perplexity=True`` adds ``exp(loss)`` for language models. These read the
  loss that ``validation_step`` returns (a tensor, or a dict with ``"loss"``); torchmetrics averages
  them over samples (batches weighted by size, as Lightning does) and replicas.

The progress bar shows the outer step and the last outer step's wall time.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torchmetrics.aggregation import MeanMetric

import lightning as L
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_loco.strategies.base import OuterStepReport, OuterStepStrategy


def _batch_size(batch: Any) -> int:
    try:
        return extract_batch_size(batch)
    except Exception:  # a batch Lightning cannot size: count it once
        return 1


def _loss_of(outputs: Any) -> Optional[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"]
    return None


class OuterStepMonitor(L.Callback):
    """Logs outer steps, the replicas' spread, and validation of the replicas and of their consensus.

    Args:
        spread_every: measure the replicas' spread every this many outer steps (an all-reduce of the
            parameters); 0 turns it off.
        consensus_validation: after each validation pass, validate the replicas' average too.
        perplexity: also log ``exp(loss)`` of the validation losses (for language models).
    """

    def __init__(self, spread_every: int = 10, consensus_validation: bool = True, perplexity: bool = False) -> None:
        if isinstance(spread_every, bool) or not isinstance(spread_every, int) or spread_every < 0:
            raise ValueError(f"spread_every must be an integer >= 0 (0 turns it off), got {spread_every!r}")
        self.spread_every = spread_every
        self.consensus_validation = consensus_validation
        self.perplexity = perplexity
        self._seen = 0
        self._seen_starts = 0
        self._replica_loss = MeanMetric()
        self._warned_no_loss = False

    def _strategy(self, trainer: L.Trainer) -> Optional[OuterStepStrategy]:
        strategy = trainer.strategy
        return strategy if isinstance(strategy, OuterStepStrategy) else None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = self._strategy(trainer)
        if strategy is None:
            rank_zero_warn(
                f"OuterStepMonitor: {type(trainer.strategy).__name__} has no outer steps; only validation "
                "of the replicas is logged."
            )
        else:
            strategy.track_norms = True
        self._replica_loss = self._replica_loss.to(pl_module.device)

    # ------------------------------------------------------------------ training

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen = 0
        self._seen_starts = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        strategy = self._strategy(trainer)
        if strategy is None:
            return
        reports = strategy.outer_step_reports[self._seen :]
        self._seen = len(strategy.outer_step_reports)
        starts = strategy.rounds_started[self._seen_starts :]
        self._seen_starts = len(strategy.rounds_started)
        spread: dict[str, float] = {}
        for index, t in starts:  # rounds start at the same step on every replica: all ranks get here together
            if index == 0 and self.spread_every and (t + 1) % self.spread_every == 0:
                spread = {"outer/replica_spread": strategy.replica_spread()}
        for report in reports:
            metrics = self._metrics(report, len(strategy.replicas))
            if report.optimizer_index == 0:
                metrics.update(spread)  # with τ = 0 the spread belongs to this report's round
                spread = {}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if spread:
            for logger in trainer.loggers:
                logger.log_metrics(spread, step=trainer.global_step)
        last = strategy.last_outer_step
        if last is not None:  # progress bar only, local values, no synchronisation
            pl_module.log("outer_step", float(last.outer_step + 1), prog_bar=True, logger=False)
            pl_module.log("sync_s", last.seconds, prog_bar=True, logger=False)

    @staticmethod
    def _metrics(report: OuterStepReport, num_optimizers: int) -> dict[str, float]:
        suffix = f"_opt{report.optimizer_index}" if num_optimizers > 1 else ""
        values = {
            "step": report.outer_step,
            "seconds": report.seconds,
            "comm_seconds": report.comm_seconds,
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "peer": report.peers[0] if report.peers else -1,
            "pseudo_gradient_norm": report.pseudo_gradient_norm,
            "update_norm": report.update_norm,
        }
        if report.overlap_steps:
            values.update(overlap_steps=report.overlap_steps, exchange_seconds=report.exchange_seconds,
                          correction_norm=report.correction_norm)
        return {f"outer/{k}{suffix}": float(v) for k, v in values.items() if v is not None}

    # ------------------------------------------------------------------ validation

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._replica_loss.reset()

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        loss = _loss_of(outputs)
        if loss is not None:
            self._replica_loss.update(loss.detach().float(), weight=_batch_size(batch))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self._replica_loss.update_count == 0:
            if not self._warned_no_loss:
                rank_zero_warn("OuterStepMonitor: validation_step returns no loss; nothing to log for validation.")
                self._warned_no_loss = True
            return
        self._log_loss(pl_module, "replicas", self._replica_loss.compute())  # averaged over replicas
        strategy = self._strategy(trainer)
        if self.consensus_validation and strategy is not None and strategy.num_replicas > 1:
            with strategy.consensus_weights():
                loss = self._validate_again(trainer, pl_module)
            self._log_loss(pl_module, "consensus", loss)

    def _log_loss(self, pl_module: L.LightningModule, which: str, loss: torch.Tensor) -> None:
        value = float(loss)
        pl_module.log(f"val/loss_{which}", value)  # equal on every rank already: no sync_dist
        if self.perplexity:
            pl_module.log(f"val/ppl_{which}", math.exp(min(value, 50.0)))

    def _validate_again(self, trainer: L.Trainer, pl_module: L.LightningModule) -> torch.Tensor:
        """One more pass over this replica's validation batches with the weights now in the model."""
        metric = MeanMetric().to(pl_module.device)
        loaders = trainer.val_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        limits = trainer.num_val_batches
        pl_module.log = lambda *args, **kwargs: None  # the step's own self.log calls must not count twice
        try:
            with torch.no_grad(), trainer.precision_plugin.val_step_context():
                for loader_idx, loader in enumerate(loaders):
                    for batch_idx, batch in enumerate(loader):
                        if batch_idx >= limits[loader_idx]:
                            break
                        batch = trainer.precision_plugin.convert_input(batch)
                        batch = trainer.strategy.batch_to_device(batch, dataloader_idx=loader_idx)
                        kwargs = {"dataloader_idx": loader_idx} if len(loaders) > 1 else {}
                        loss = _loss_of(pl_module.validation_step(batch, batch_idx, **kwargs))
                        if loss is not None:
                            metric.update(loss.detach().float(), weight=_batch_size(batch))
        finally:
            pl_module.__dict__.pop("log", None)  # the class's log again
        return metric.compute()
