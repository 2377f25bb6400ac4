"""Watching low-communication training in TensorBoard (or any Lightning logger).

``OuterStepMonitor`` logs, at each outer step's own global step (nothing is re-emitted between outer
steps):

* ``outer/step``, the index t of the outer step (0, 1, 2, ...), ``outer/seconds`` (the whole outer
  step), ``outer/comm_seconds`` (its communication), ``outer/bytes_sent``,
  ``outer/bytes_received``, ``outer/pseudo_gradient_norm`` (‖θ − anchor‖ before the step),
  ``outer/update_norm`` (how far the anchor moved). Loggers write on rank 0, so these describe rank
  0's replica; bytes and times are alike on every replica. The bytes are those on the wire: with a
  lossy wire format (``wire_dtype``, ``compression``) the encoded size.
* the replicas each outer step met, as text, not as a number a chart would average: with a
  ``TensorBoardLogger``, ``outer/peer`` in TensorBoard's Text tab ("outer step 3: replica 0 met
  replica 2"), and on every rank the same line for its own replica in the ``lightning_loco``
  Python log (level INFO).
* with a lossy wire format, ``outer/compression_error_norm``: ‖D(Q(x)) − x‖, what the codec lost of
  the payload x this replica sent at that outer step (x includes the error-feedback residual where
  there is one). Computed locally from the payload: no message.
* ``outer/peer_distance``: ‖own payload − mean payload of the replica's group‖ over the optimizer's
  parameters, the local signal of how far the replicas are apart. The strategy computes it from
  what the outer step exchanges anyway: it costs no message (logged when the strategy provides it).
* ``outer/phase_steps`` (H_i: the inner steps this replica took before the round, H unless
  ``sync_seconds`` paces the rounds), ``outer/compute_seconds`` (that inner phase's compute on the
  replica's own clock, the rounds' time left out) and ``outer/compute_share`` (compute over compute
  plus the round's time: 1 when the replica never waits for its partners; the wait itself is
  ``outer/comm_seconds``). Local clocks only: no message.
* with ``overlap_steps``, at each landing: ``outer/overlap_steps`` (τ used), ``outer/comm_seconds``
  is then the time the landing waited for the exchange (the exposed communication),
  ``outer/exchange_seconds`` how long the exchange took from posting to completion (to within one
  inner step), and ``outer/correction_norm`` the norm of the change applied at the landing.
* only when asked for (``spread_every`` > 0), ``outer/replica_spread`` every ``spread_every`` outer
  steps: the RMS distance of all replicas from their mean, the papers' weight-spread diagnostic,
  measured where a round starts (the same step on every replica, whatever τ). It is a **global
  collective**: two all-reduces over all replicas, a global synchronisation each time it runs,
  which is what NoLoCo and GASLoC exist to avoid.
* ``val/loss_local``: this replica's own validation loss on its share of the validation set (reduced within the
  replica's ranks; with one rank per replica, no message at all). Loggers write on rank 0: replica 0's.
  With ``mean_over_replicas=True`` instead ``val/loss_replicas``: the mean over replicas of each replica's
  loss (the papers' metric), a **global collective** per validation run (torchmetrics all-gathers two
  numbers over all ranks, with barriers). With ``consensus_validation`` also ``val/loss_consensus``: the
  loss of the replicas' average, swapped in for that pass and swapped out again before any
  checkpoint can see it. The swap is a **global collective** (an all-reduce of the weights) once
  per validation run. ``perplexity=True`` adds ``exp(loss)`` for language models. These read the
  loss that ``validation_step`` returns (a tensor, or a dict with ``"loss"``); torchmetrics averages
  them over samples (batches weighted by size, as Lightning does), and over replicas where asked.

The progress bar shows ``outer_steps``, the number of outer steps completed so far (the latest
``outer/step`` plus one), and ``sync_s``, the latest outer step's wall time.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.loggers import TensorBoardLogger
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics import Metric
from torchmetrics.aggregation import MeanMetric

from lightning_loco.trainer.base import OuterStepReport, OuterStepStrategy
from lightning_loco.trainer.validation import scope_metrics

log = logging.getLogger("lightning_loco")


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


class _Agreed(Metric):
    """A value that is already the same on every rank, logged as a torchmetrics ``Metric``.

    For a plain tensor logged once per epoch in a distributed run, Lightning advises
    ``sync_dist=True``, which would add a barrier and two all-reduces per value to average what is
    equal everywhere. A ``Metric`` is computed by torchmetrics instead, and this one has nothing to
    synchronise (``sync_on_compute=False``): no message, no advice, and the value still reaches
    ``trainer.callback_metrics`` (for ``ModelCheckpoint(monitor=...)``) on every rank.
    """

    full_state_update = False

    def __init__(self, value: float) -> None:
        super().__init__(sync_on_compute=False)
        self.add_state("value", default=torch.tensor(0.0), dist_reduce_fx=None)
        self.update(value)

    value: torch.Tensor  # a metric state (add_state)

    def update(self, value: float) -> None:
        self.value = torch.tensor(value, device=self.value.device)

    def compute(self) -> torch.Tensor:
        return self.value


class OuterStepMonitor(L.Callback):
    """Logs outer steps, a local spread signal, and validation of the replicas and of their consensus.

    The defaults add no message between replicas: ``outer/peer_distance`` comes from what the outer
    step exchanges anyway, and validation logs each replica's own ``val/loss_local``. The replicas' mean
    (``mean_over_replicas``) and the two global diagnostics that move weights are opt-in. At setup it turns on
    the replica's norm tracking (:meth:`~lightning_loco.replica.replica.Replica.track_norms`): the norms and
    peer distance it logs cost one copy of the anchor per outer step, and no message.

    Args:
        spread_every: log ``outer/replica_spread`` every this many outer steps; 0 (the default)
            turns it off. A global collective: two all-reduces over all replicas each time, a
            global synchronisation that NoLoCo and GASLoC otherwise never make.
        consensus_validation: after each validation pass, validate the replicas' average too
            (``val/loss_consensus``). A global collective: an all-reduce of the weights once per
            validation run. Off by default.
        perplexity: also log ``exp(loss)`` of the validation losses (for language models).
        mean_over_replicas: log ``val/loss_replicas``, the replicas' mean validation loss, instead of this
            replica's own ``val/loss_local``. A global collective: torchmetrics all-gathers over all replicas
            once per validation run. Off by default.
    """

    def __init__(self, spread_every: int = 0, consensus_validation: bool = False, perplexity: bool = False,
                 mean_over_replicas: bool = False) -> None:
        if isinstance(spread_every, bool) or not isinstance(spread_every, int) or spread_every < 0:
            raise ValueError(f"spread_every must be an integer >= 0 (0 turns it off), got {spread_every!r}")
        self.spread_every = spread_every
        self.consensus_validation = consensus_validation
        self.perplexity = perplexity
        self.mean_over_replicas = mean_over_replicas
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
            strategy.replica.track_norms()
        if strategy is not None and not self.mean_over_replicas:  # this replica's own: within its ranks, or none
            scope_metrics(self._replica_loss, strategy.replica_group())
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
        optimizers = len(strategy.outer_slots) // strategy.fragments  # a slot per optimizer and fragment
        for report in reports:
            metrics = self._metrics(report, optimizers, strategy.fragments)
            if report.optimizer_index == 0:
                metrics.update(spread)  # with τ = 0 the spread belongs to this report's round
                spread = {}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            name = strategy.elastic.replica_id if strategy.elastic is not None else strategy.replica_index
            self._log_peers(trainer, report, name, optimizers)
        if spread:
            for logger in trainer.loggers:
                logger.log_metrics(spread, step=trainer.global_step)
        last = strategy.last_outer_step
        if last is not None:  # progress bar only, local values, no synchronisation
            # a count (outer steps completed), where outer/step is the index t of the latest one
            pl_module.log("outer_steps", float(last.outer_step + 1), prog_bar=True, logger=False)
            pl_module.log("sync_s", last.seconds, prog_bar=True, logger=False)

    @staticmethod
    def _metrics(report: OuterStepReport, num_optimizers: int, fragments: int = 1) -> dict[str, float]:
        suffix = f"_opt{report.optimizer_index}" if num_optimizers > 1 else ""
        values = {
            "step": report.outer_step,
            "fragment": report.fragment if fragments > 1 else None,  # which fragment this round moved
            "seconds": report.seconds,
            "comm_seconds": report.comm_seconds,
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "pseudo_gradient_norm": report.pseudo_gradient_norm,
            "update_norm": report.update_norm,
            "peer_distance": report.peer_distance,
            "compression_error_norm": report.compression_error_norm,
            "phase_steps": report.phase_steps,
            "compute_seconds": report.compute_seconds,
            "compute_share": report.compute_share,
            "membership_errors": report.membership_errors,  # elastic: groups that could not be set up, so far
        }
        if report.overlap_steps:
            values.update(overlap_steps=report.overlap_steps, exchange_seconds=report.exchange_seconds,
                          correction_norm=report.correction_norm)
        return {f"outer/{k}{suffix}": float(v) for k, v in values.items() if v is not None}

    @staticmethod
    def _peer_text(report: OuterStepReport, replica: object) -> str:
        """Whom the replica met at this outer step, in words (a replica's name, not a quantity): the peers'
        replica ids where the report has them (elastic replicas: indices change with the membership), else
        their indices."""
        names = report.peer_ids or tuple(str(p) for p in report.peers)
        if not names:
            met = "nobody"
        elif report.alone:  # the elastic replica's own line says why
            met = f"nobody (taken alone, without {', '.join(names)})"
        else:
            met = ("replica " if len(names) == 1 else "replicas ") + ", ".join(names)
        return f"outer step {report.outer_step}: replica {replica} met {met}"

    def _log_peers(self, trainer: L.Trainer, report: OuterStepReport, replica: object, num_optimizers: int) -> None:
        """The peers as text: a line in the Python log of every rank, and TensorBoard's Text tab on rank 0.
        Local: no message."""
        text = self._peer_text(report, replica)
        suffix = f"_opt{report.optimizer_index}" if num_optimizers > 1 else ""
        log.info("%s%s (global step %d)", text, f" (optimizer {report.optimizer_index})" if suffix else "",
                 trainer.global_step)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text(f"outer/peer{suffix}", text, global_step=trainer.global_step)

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
        which = "replicas" if self.mean_over_replicas else "local"
        self._log_loss(pl_module, which, self._replica_loss.compute())  # over replicas, or this replica's own
        strategy = self._strategy(trainer)
        if self.consensus_validation and strategy is not None and strategy.num_replicas > 1:
            with strategy.consensus_weights():
                loss = self._validate_again(trainer, pl_module)
            self._log_loss(pl_module, "consensus", loss)

    def _log_loss(self, pl_module: L.LightningModule, which: Optional[str], loss: torch.Tensor) -> None:
        value = float(loss)  # equal on the ranks that log it together already: torchmetrics reduced it
        suffix = f"_{which}" if which else ""
        values = {f"val/loss{suffix}": value}
        if self.perplexity:
            values[f"val/ppl{suffix}"] = math.exp(min(value, 50.0))
        for name, v in values.items():
            pl_module.log(name, _Agreed(v).to(pl_module.device), metric_attribute=name)

    def _validate_again(self, trainer: L.Trainer, pl_module: L.LightningModule) -> torch.Tensor:
        """One more pass over this replica's validation batches with the weights now in the model."""
        metric = MeanMetric().to(pl_module.device)
        loaders = trainer.val_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        limits = trainer.num_val_batches
        pl_module.__dict__["log"] = lambda *args, **kwargs: None  # the step's own self.log calls must not count twice
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
