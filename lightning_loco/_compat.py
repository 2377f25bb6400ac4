"""Every private Lightning symbol our strategies use, in one place, checked against the installed version.

Lightning has no public API for a strategy that launches like DDP but never wraps the model, keeps
per-replica state and avoids Lightning's hidden global collectives. We therefore rely on a few
private names. They are listed in ``PRIVATE_SYMBOLS`` and ``check_lightning()`` verifies them when
the strategies are imported, so a Lightning release that renames one fails at import with a message
that names it, instead of misbehaving in the middle of a run.

Two behaviours of Lightning are replaced while one of our strategies runs:

* **The per-batch SIGTERM broadcast** (``_TrainingEpochLoop._broadcast_sigterm_tensor``, Lightning
  >= 2.5.2): a blocking global collective on every training batch, exactly what low-communication
  training removes. It becomes a check of this process's own flag.
* **The broadcast in Lightning's SIGTERM handler** (``_SignalConnector._sigterm_notifier_fn``): on
  SIGTERM every rank calls ``dist.broadcast(src=0)``, which only the per-batch broadcast above used
  to match. A rank signalled alone (a preempted node) would wait there for the whole process-group
  timeout. Our handler does what Lightning's does without the broadcast: it forwards the signal to
  the processes this one launched and sets the flag, so the process stops at its next batch.

Elastic replicas that heal copy the fit loop's step counters (``LOOP_COUNTERS``) from one Trainer to
another: :func:`loop_counters` and :func:`load_loop_counters`.
"""

from __future__ import annotations

import atexit
import logging
import signal as _signal
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

log = logging.getLogger("lightning_loco")

# (module, attribute path, what we use it for). Checked by check_lightning().
PRIVATE_SYMBOLS: tuple[tuple[str, str, str], ...] = (
    ("lightning.pytorch.overrides.distributed", "_sync_module_states", "broadcast rank 0's initial weights"),
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device", "move inner optimizer state to the device"),
    ("lightning.fabric.utilities.init", "_materialize_distributed_module",
     "materialize meta-device parameters of a sharded replica"),
    ("lightning.fabric.utilities.distributed", "_destroy_dist_connection", "destroy the gloo group at exit"),
    ("lightning.fabric.strategies.registry", "_StrategyRegistry", "register the strategy names"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._configure_launcher", "check N before processes start"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._get_process_group_backend", "gloo or NCCL"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy.configure_ddp", "DDP inside a replica (k > 1)"),
    ("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector._sigterm_notifier_fn",
     "replace the broadcast in the SIGTERM handler"),
    ("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector.register_signal_handlers",
     "reads the SIGTERM handler when a run starts"),
    # Fabric's strategies
    ("lightning.fabric.strategies.strategy", "_BackwardSyncControl",
     "hold back gradient synchronisation inside a replica (fabric.no_backward_sync)"),
    ("lightning.fabric.strategies.model_parallel", "_FSDPNoSync", "hold back FSDP2's reduce-scatters in a replica"),
    ("lightning.fabric.strategies.strategy", "Strategy._convert_stateful_objects_in_state",
     "take the state fabric.save is given"),
    ("lightning.fabric.strategies.strategy", "_validate_keys_for_strict_loading", "load fabric.load's state strictly"),
    ("lightning.fabric.utilities.types", "_Stateful", "restore fabric.load's stateful objects"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection._forked_name",
     "name the epoch metrics a validation's callbacks read (ReplicaValidation: replica 0's on every rank)"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection.valid_items",
     "the epoch metrics a validation's callbacks read"),
)
# Optional: Lightning < 2.5.2 has no per-batch SIGTERM broadcast, so there is nothing to replace.
OPTIONAL_SYMBOLS: tuple[tuple[str, str, str], ...] = (
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor",
     "replace the per-batch SIGTERM broadcast"),
)
# Instance attributes set by DDPStrategy.__init__ (checked on a fresh instance).
PRIVATE_ATTRIBUTES: tuple[str, ...] = ("_ddp_kwargs", "_timeout", "_layer_sync", "_process_group_backend")
# Instance attributes set by Fabric's DDPStrategy.__init__ (checked on a fresh instance).
FABRIC_PRIVATE_ATTRIBUTES: tuple[str, ...] = ("_backward_sync_control",)


class LightningCompatibilityError(ImportError):
    """The installed Lightning lacks a private symbol our strategies rely on."""


def _resolve(module: str, path: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_symbols() -> list[str]:
    """Names of the private Lightning symbols the installed version lacks (empty when all are there)."""
    missing = []
    for module, path, _ in PRIVATE_SYMBOLS:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy

    probe = DDPStrategy()
    missing += [f"DDPStrategy().{name}" for name in PRIVATE_ATTRIBUTES if not hasattr(probe, name)]
    fabric_probe = FabricDDPStrategy()
    missing += [f"lightning.fabric DDPStrategy().{name}" for name in FABRIC_PRIVATE_ATTRIBUTES
                if not hasattr(fabric_probe, name)]
    return missing


def check_lightning() -> None:
    """Raises :class:`LightningCompatibilityError` naming every private symbol the installed
    Lightning lacks."""
    missing = missing_symbols()
    if missing:
        import lightning

        uses = {f"{m}.{p}": why for m, p, why in PRIVATE_SYMBOLS}
        lines = "\n".join(f"  - {name}" + (f" (to {uses[name]})" if name in uses else "") for name in missing)
        raise LightningCompatibilityError(
            f"lightning_loco needs private Lightning symbols that lightning {lightning.__version__} does not have:\n"
            f"{lines}\nInstall a supported version: pip install 'lightning>=2.4,<2.7'."
        )


# ---------------------------------------------------------------- the fit loop's counters

# (name, attribute path from the Trainer): the progress objects of the fit loop that ``trainer.global_step``,
# ``current_epoch``, the batch index, scheduler steps and validation checks read, and the logging step
# (``_batches_that_stepped``, the step loggers get). Progress objects have ``state_dict``/``load_state_dict``.
LOOP_COUNTERS: tuple[tuple[str, str], ...] = (
    ("epochs", "fit_loop.epoch_progress"),
    ("batches", "fit_loop.epoch_loop.batch_progress"),
    ("scheduler_steps", "fit_loop.epoch_loop.scheduler_progress"),
    ("optimizer_steps", "fit_loop.epoch_loop.automatic_optimization.optim_progress"),
    ("manual_optimizer_steps", "fit_loop.epoch_loop.manual_optimization.optim_step_progress"),
    ("logged_steps", "fit_loop.epoch_loop._batches_that_stepped"),
)


def _counter(trainer: Any, path: str) -> tuple[Any, str]:
    """The object holding the counter at ``path`` and the counter's attribute name."""
    owner, _, name = path.rpartition(".")
    try:
        obj = trainer
        for part in owner.split("."):
            obj = getattr(obj, part)
        getattr(obj, name)
    except AttributeError as err:
        raise LightningCompatibilityError(
            f"This Lightning's Trainer has no {path} ({err}), which elastic replicas copy when they heal: install a "
            "supported version (pip install 'lightning>=2.4,<2.7')."
        ) from err
    return obj, name


def loop_counters(trainer: Any) -> dict[str, Any]:
    """The fit loop's counters as plain values (``LOOP_COUNTERS``)."""
    out: dict[str, Any] = {}
    for key, path in LOOP_COUNTERS:
        obj, name = _counter(trainer, path)
        value = getattr(obj, name)
        out[key] = value.state_dict() if hasattr(value, "state_dict") else int(value)
    return out


def load_loop_counters(trainer: Any, saved: dict[str, Any]) -> None:
    """Sets the fit loop's counters to ``saved`` (from :func:`loop_counters`), without marking the loop as
    restarting: training goes on from them as if this Trainer had counted them."""
    for key, path in LOOP_COUNTERS:
        obj, name = _counter(trainer, path)
        value = getattr(obj, name)
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(saved[key])
        else:
            setattr(obj, name, int(saved[key]))


# ---------------------------------------------------------------- SIGTERM

_SIGTERM_HOOK = "_broadcast_sigterm_tensor"
_NOTIFIER = "_sigterm_notifier_fn"


def disable_per_batch_sigterm_broadcast(epoch_loop: Any) -> Optional[Callable[[], None]]:
    """Replaces the per-batch SIGTERM broadcast of ``epoch_loop`` with a local check.

    Returns a function that undoes the change, or ``None`` when this Lightning version has no such
    broadcast (nothing to remove).
    """
    if not callable(getattr(type(epoch_loop), _SIGTERM_HOOK, None)):
        return None

    def local_sigterm_check() -> None:
        trainer = getattr(epoch_loop, "trainer", None)
        if getattr(trainer, "received_sigterm", False):
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            raise SIGTERMException()

    setattr(epoch_loop, _SIGTERM_HOOK, local_sigterm_check)

    def restore() -> None:
        epoch_loop.__dict__.pop(_SIGTERM_HOOK, None)

    return restore


def local_sigterm_handler(trainer: Any) -> Callable[[], None]:
    """Makes the trainer's SIGTERM handler local: it forwards the signal to the processes this one
    launched (as Lightning's does) and sets the flag the training loop checks, with no collective.

    Must be called before ``Trainer`` registers its signal handlers (``Strategy.setup`` is). Returns
    a function that undoes the change.
    """
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None:
        raise LightningCompatibilityError(
            "This Lightning's Trainer has no _signal_connector: install a supported version "
            "(pip install 'lightning>=2.4,<2.7')."
        )

    def notify(signum: Any, frame: Any) -> None:
        name = _signal.Signals(signum).name if isinstance(signum, int) else str(signum)
        log.info("rank %s: received %s; stopping at the next batch", trainer.global_rank, name)
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the popen launcher's children (rank 0 only); a no-op elsewhere
        connector.received_sigterm = True

    setattr(connector, _NOTIFIER, notify)

    def restore() -> None:
        connector.__dict__.pop(_NOTIFIER, None)

    return restore


# ---------------------------------------------------------------- process groups

_destroy_registered = False


def destroy_process_group_at_exit() -> None:
    """Destroys the default process group at interpreter exit (Lightning does this only for NCCL).

    Without it, gloo processes occasionally abort at exit (``terminate called ...``).
    """
    global _destroy_registered
    if _destroy_registered:
        return
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    atexit.register(_destroy_dist_connection)
    _destroy_registered = True


def sync_module_states(module: Any) -> None:
    """Every rank gets rank 0's parameters and buffers (what DistributedDataParallel does at wrap time)."""
    from lightning.pytorch.overrides.distributed import _sync_module_states

    _sync_module_states(module)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def materialize_sharded_module(module: Any, device: Any) -> None:
    """Allocates and initialises (``reset_parameters``) a sharded module built on the meta device, as
    Lightning's ``ModelParallelStrategy`` does; a no-op when nothing is on the meta device."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


# ---------------------------------------------------------------- Fabric


def set_backward_sync_control(strategy: Any, no_backward_sync: Callable[[Any, bool], AbstractContextManager]) -> None:
    """Gives a Fabric strategy the control ``fabric.no_backward_sync(model)`` asks: ``no_backward_sync(module,
    enabled)`` returns the context that holds gradient synchronisation back."""
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    class _Control(_BackwardSyncControl):
        def no_backward_sync(self, module: Any, enabled: bool) -> AbstractContextManager:
            return no_backward_sync(module, enabled)

    strategy._backward_sync_control = _Control()


def fsdp_no_sync(module: Any, enabled: bool) -> AbstractContextManager:
    """Fabric's own context that holds FSDP2's reduce-scatters back (``ModelParallelStrategy``'s)."""
    from lightning.fabric.strategies.model_parallel import _FSDPNoSync

    return _FSDPNoSync(module=module, enabled=enabled)


def convert_stateful_objects(strategy: Any, state: dict[str, Any], filter: dict[str, Any]) -> dict[str, Any]:
    """The state ``fabric.save`` was given, with modules, optimizers and stateful objects as their state dicts
    (Fabric's own conversion)."""
    return strategy._convert_stateful_objects_in_state(state, filter=filter)


def validate_keys_for_strict_loading(requested: Any, loaded: Any, strict: bool) -> None:
    """Fabric's check of ``fabric.load``'s keys: with ``strict``, every requested key must be in the file."""
    from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading

    _validate_keys_for_strict_loading(requested, loaded, strict=strict)


def is_stateful(obj: Any) -> bool:
    """Whether Fabric restores ``obj`` by its ``load_state_dict`` (it has ``state_dict`` and ``load_state_dict``)."""
    from lightning.fabric.utilities.types import _Stateful

    return isinstance(obj, _Stateful)


def set_epoch_metrics(trainer: Any, values: dict[str, float]) -> int:
    """Makes the callbacks that run after this one read ``values`` as the current loop's epoch metrics (by name):
    ``trainer.callback_metrics`` is rebuilt from the loop's results at every read, so each result's computed value
    is replaced, and the names not among them are set in the dict itself. Returns how many results were set."""
    import torch

    results, count = trainer._results, 0
    for _, result in (results.valid_items() if results is not None else ()):
        name, forked = results._forked_name(result, False)
        key = forked if forked in values else name if name in values else None
        own = result._computed
        if key is None or not isinstance(own, torch.Tensor) or own.numel() != 1:
            continue
        result._computed = torch.tensor(values[key], dtype=own.dtype, device=own.device)
        count += 1
    metrics = trainer.callback_metrics
    for key, value in values.items():
        own = metrics.get(key)
        like = own if isinstance(own, torch.Tensor) else torch.tensor(0.0)
        metrics[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return count
