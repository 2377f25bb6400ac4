"""Each simulated replica's Lightning context: a real ``lightning.pytorch.Trainer`` attached to its module.

A module's ``training_step`` is written for a Trainer: it calls ``self.log`` and ``self.log_dict``,
updates torchmetrics metrics, may read ``self.global_step``, ``self.current_epoch``,
``self.optimizers()``, ``self.lr_schedulers()`` or ``self.trainer.max_steps``, and runs under the
precision plugin's autocast. Rather than imitate all that, every replica gets a Trainer of its own
(one device, no logger, no checkpointing: built in a few milliseconds and never ``fit``), configured
as the run is (precision, accumulation, clipping, ``max_steps``) and attached to the replica's module
copy. Around each batch the simulator then does what Lightning's training loop does, with the
Trainer's own parts:

- the step runs as the ``"training_step"`` hook between the logger connector's ``on_batch_start`` and
  ``on_batch_end``, so ``self.log`` stores into the Trainer's result collection (metric objects
  included) and ``trainer.callback_metrics`` holds what was logged last;
- the precision plugin's ``train_step_context`` wraps it (``"bf16-mixed"``: autocast to bfloat16);
- each optimizer step counts in the Trainer's progress (``self.global_step``), and the end of the
  replica's epoch ends the logging epoch (``on_epoch=True`` values, metric resets, ``current_epoch``).

No other hook runs (no callbacks, ``on_train_batch_end``, validation).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor, nn
from torch.optim import Optimizer

PRECISIONS = ("32-true", "bf16-mixed")

# The private parts of a Trainer this module drives: Lightning has no public API for running one
# ``training_step`` outside ``fit``. Checked on every Trainer built here, so that a release that renames
# one fails at once, naming it, instead of in the middle of a run.
PRIVATE_TRAINER_PARTS = (
    "_logger_connector.on_batch_start", "_logger_connector.on_batch_end", "_logger_connector.epoch_end_reached",
    "_logger_connector.on_epoch_end", "_logger_connector.reset_results", "fit_loop.epoch_loop._batches_that_stepped",
    "fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step", "fit_loop.epoch_progress",
)
PRIVATE_MODULE_PARTS = ("_current_fx_name",)  # of a LightningModule


def check_precision(precision: Any) -> None:
    """Raises ``ValueError`` naming the precisions the simulator runs."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be '32-true' (default) or 'bf16-mixed' (float32 weights, the forward pass under "
            f"bfloat16 autocast, as Lightning's plugin), got {precision!r}"
        )


def check_private_parts(trainer: Trainer, module: LightningModule | None) -> None:
    """Raises ``ImportError`` naming every private part of Lightning the installed version lacks."""
    missing = []
    module_parts = PRIVATE_MODULE_PARTS if module is not None else ()
    for owner, parts in ((trainer, PRIVATE_TRAINER_PARTS), (module, module_parts)):
        for path in parts:
            obj: Any = owner
            try:
                for name in path.split("."):
                    obj = getattr(obj, name)
            except AttributeError:
                missing.append(f"{type(owner).__name__}.{path}")
    if missing:
        import lightning

        raise ImportError(
            f"the training simulator needs private parts of Lightning that lightning {lightning.__version__} does not "
            f"have: {', '.join(missing)}. Install a supported version: pip install 'lightning>=2.4,<2.7'."
        )


def training_step_loss(module: nn.Module, batch: Any, batch_idx: int = 0) -> Tensor:
    """The default loss: ``module.training_step(batch, batch_idx)`` (its loss, or the ``"loss"`` entry of
    the dict it returns)."""
    out = module.training_step(batch, batch_idx)  # type: ignore[operator]
    loss = out["loss"] if isinstance(out, dict) else out
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"{type(module).__name__}.training_step returned {type(out).__name__}: the simulator needs the loss (a "
            f"tensor, or a dict with a 'loss' entry) at every step"
        )
    return loss


def parse_optimizers(config: Any) -> tuple[Optimizer, Any]:
    """(optimizer, step-interval scheduler or None) from what ``configure_optimizers`` may return."""
    scheduler = None
    if isinstance(config, (list, tuple)) and len(config) == 2 and isinstance(config[0], (list, tuple)):
        optimizers, schedulers = config
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise ValueError("the simulator trains one optimizer (and at most one scheduler) per replica")
        config = {"optimizer": optimizers[0], "lr_scheduler": schedulers[0] if schedulers else None}
    if isinstance(config, (list, tuple)):
        if len(config) != 1:
            raise ValueError("the simulator trains one optimizer per replica")
        config = config[0]
    if isinstance(config, dict):
        optimizer, scheduler = config["optimizer"], config.get("lr_scheduler")
    else:
        optimizer = config
    if isinstance(scheduler, dict):
        if scheduler.get("interval", "epoch") != "step":
            raise ValueError("the simulator steps learning-rate schedulers per optimizer step: use interval='step'")
        scheduler = scheduler["scheduler"]
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"expected a torch optimizer from the optimizers function, got {type(optimizer).__name__}")
    return optimizer, scheduler


@contextlib.contextmanager
def _quiet_trainer_start() -> Iterator[None]:
    """Building a Trainer prints what hardware it found and some tips: once per replica is noise."""
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


class ReplicaContext:
    """One replica's Trainer, attached to its module copy (a ``LightningModule``; a plain module gets
    only the precision plugin's context).

    Args:
        module: the replica's own copy of the module.
        precision: "32-true" or "bf16-mixed".
        accumulate_grad_batches, gradient_clip_val, max_steps: the run's, so that the module reads
            them from ``self.trainer`` as under ``fit``.
    """

    def __init__(
        self, module: nn.Module, precision: str = "32-true", accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None, max_steps: int | None = None,
    ) -> None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        accelerator, devices = ("cuda", [device.index or 0]) if device.type == "cuda" else ("cpu", 1)
        with _quiet_trainer_start():
            self.trainer = Trainer(
                accelerator=accelerator, devices=devices, precision=precision,  # type: ignore[arg-type]
                accumulate_grad_batches=accumulate_grad_batches, gradient_clip_val=gradient_clip_val,
                max_steps=-1 if max_steps is None else max_steps, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            )
        self.trainer.state.fn = TrainerFn.FITTING
        self.trainer.training = True
        self.module: LightningModule | None = module if isinstance(module, LightningModule) else None
        check_private_parts(self.trainer, self.module)
        self.epoch = 0  # the replica's data epoch that logging is in
        self._in_epoch = False  # a batch of ``epoch`` has run
        if self.module is not None:
            if not self.module.automatic_optimization:
                raise ValueError(
                    f"{type(module).__name__} sets automatic_optimization = False: the simulator steps the inner "
                    f"optimizer itself (Lightning's automatic optimization); train it with the strategies instead"
                )
            self.attach(self.module)
            self.trainer.strategy.connect(self.module)

    def attach(self, module: nn.Module) -> None:
        """Gives ``module`` (the replica's, or a copy of it run under ``vmap``) this Trainer."""
        if isinstance(module, LightningModule):
            module.trainer = self.trainer

    def set_optimizer(self, optimizer: Optimizer, scheduler: Any) -> None:
        """What ``self.optimizers()`` and ``self.lr_schedulers()`` return in the module."""
        strategy = self.trainer.strategy
        strategy.optimizers = [optimizer]
        strategy.lr_scheduler_configs = [LRSchedulerConfig(scheduler, interval="step")] if scheduler is not None else []

    def follow_nominal(self, step: float) -> None:
        """What ``self.trainer.strategy.nominal_step`` reads in the module: the run's progress in nominal
        steps under ``sync_seconds``, as on a paced strategy (the example GPT's schedule follows it)."""
        self.trainer.strategy.nominal_step = step  # type: ignore[attr-defined]

    def precision_context(self) -> contextlib.AbstractContextManager[None]:
        """The precision plugin's context for a training step (bfloat16 autocast under "bf16-mixed")."""
        return self.trainer.precision_plugin.train_step_context()

    @contextlib.contextmanager
    def training_step(self, batch: Any, epoch: int, autocast: bool = True) -> Iterator[None]:
        """Runs the body as Lightning runs ``training_step`` on ``batch`` of data epoch ``epoch``: the
        previous epoch ends first if ``epoch`` is a new one; ``self.log`` records into this Trainer.
        ``autocast=False``: without the precision context (replaying values logged under ``vmap``)."""
        precision = self.precision_context() if autocast else contextlib.nullcontext()
        if self.module is None:
            with precision:
                yield
            return
        if epoch != self.epoch:
            self.end_epoch()
            self.epoch = epoch
        connector = self.trainer._logger_connector
        connector.on_batch_start(batch)
        self._in_epoch = True
        previous, self.module._current_fx_name = self.module._current_fx_name, "training_step"
        try:
            with precision:
                yield
        finally:
            self.module._current_fx_name = previous
        connector.on_batch_end()

    def replay(self, batch: Any, epoch: int, logged: Sequence[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]
               ) -> None:
        """Logs ``(name, value, args, kwargs)`` as the module's ``training_step`` logged them on ``batch``."""
        if self.module is None:
            return
        with self.training_step(batch, epoch, autocast=False):
            for name, value, args, kwargs in logged:
                self.module.log(name, value, *args, **kwargs)

    def optimizer_stepped(self) -> None:
        """Counts one optimizer step (``self.global_step``), as Lightning's loop does after it."""
        loop = self.trainer.fit_loop.epoch_loop
        progress = loop.automatic_optimization.optim_progress.optimizer.step
        progress.increment_ready()
        progress.increment_completed()
        loop._batches_that_stepped += 1

    def end_epoch(self) -> None:
        """Ends the logging epoch as Lightning's fit loop does: epoch-level values into
        ``callback_metrics``, the result collection (and the metrics logged as objects) reset,
        ``current_epoch`` advanced."""
        if self.module is None or not self._in_epoch:
            return
        connector = self.trainer._logger_connector
        connector.epoch_end_reached()
        connector.on_epoch_end()
        connector.reset_results()
        self.trainer.fit_loop.epoch_progress.increment_completed()
        self._in_epoch = False

    @property
    def logged(self) -> dict[str, float]:
        """The last value of everything logged (the Trainer's ``callback_metrics``), as floats."""
        return {name: float(value) for name, value in self.trainer.callback_metrics.items()}


def unattached_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without the Trainer it may be attached to (a module that was fitted
    before: its Trainer, with its loggers and data, is not copied)."""
    trainer = getattr(module, "_trainer", None)
    if not isinstance(module, LightningModule) or trainer is None:
        return copy.deepcopy(module)
    module.trainer = None
    try:
        return copy.deepcopy(module)
    finally:
        module.trainer = trainer


@contextlib.contextmanager
def logging_discarded(modules: Sequence[nn.Module]) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing on ``modules`` (evaluation calls ``training_step``
    too, and what it logs there is not training's)."""
    patched = [m for m in modules if isinstance(m, LightningModule)]
    for module in patched:
        module.log = _discard  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in patched:
            del module.log


def _discard(*args: Any, **kwargs: Any) -> None:
    return None
