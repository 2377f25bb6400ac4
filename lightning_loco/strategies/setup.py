"""Launching and setup hooks of the strategies: arguments and N checked before any process starts,
replicas that start equal, DDP only inside a replica, the optimizers every outer state follows, and
the replicas' consensus (global collectives, used only where asked).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_loco import consensus
from lightning_loco.driver import check_final_outer_step  # noqa: F401  (with the other argument checks)
from lightning_loco.elastic.ranks import ReplicaRankError, restart_advice
from lightning_loco.fragments import next_round_step
from lightning_loco.process_groups import ProcessGroups
from lightning_loco.short_runs import warn_if_short
from lightning_loco.strategies import _compat

log = logging.getLogger("lightning_loco")


def check_int(name: str, value: Any, advice: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}. {advice}")


def parse_device(value: Optional[Union[str, torch.device]]) -> Optional[torch.device]:
    try:
        return None if value is None else torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"outer_state_device={value!r} is not a device torch knows. Use None (the model's device) "
            "or 'cpu' (keeps the float32 outer state off the accelerator)."
        ) from err


def fit_ends_after_this_step(trainer: "pl.Trainer", optimizers_per_batch: int = 1) -> bool:
    """Whether the optimizer step being taken is the last of ``fit``: ``max_steps`` is reached with it,
    or it falls in the last batch of the last epoch (``max_epochs``). An early stop (``EarlyStopping``,
    ``max_time``, a signal) cannot be foreseen. With manual optimization ``optimizers_per_batch``
    optimizer steps are taken to make up one batch (one step each of the optimizers), so that every
    optimizer's step of the last batch counts as its last; a guess that proves wrong is undone when
    the next batch starts (``OuterStepDriver.restore_outer_weights``)."""
    if trainer.max_steps >= 0 and trainer.global_step + optimizers_per_batch >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs < 0 or trainer.current_epoch + 1 < max_epochs:
        return False
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.is_last_batch or progress.current.ready >= trainer.num_training_batches


def check_paced_fit(trainer: "pl.Trainer", module: "pl.LightningModule", num_optimizers: int) -> None:
    """Raises ``ValueError`` before training when a fit cannot run with ``sync_seconds``: replicas then
    take different numbers of steps, so whatever Lightning does by each replica's own step or epoch
    count happens at different moments on different replicas, and a collective there (a validation
    pass, a checkpoint) would wait for replicas that are training towards their next round."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.model_helpers import is_overridden

    problems = []
    if num_optimizers != 1:
        problems.append(f"it paces the rounds of one optimizer; this model has {num_optimizers}")
    if trainer.max_steps < 1:
        problems.append("the run is ⌈max_steps / sync_every⌉ rounds: set Trainer(max_steps=...)")
    if trainer.max_epochs not in (None, -1):
        problems.append(f"replicas go through their data at different speeds: leave max_epochs unset "
                        f"(got {trainer.max_epochs}) and end the run with max_steps")
    names = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    if names:
        problems.append(f"{', '.join(names)} saves by each replica's own step or epoch count: use "
                        "lightning_loco.OuterStepCheckpoint (every k outer steps) or enable_checkpointing=False")
    if trainer.limit_val_batches != 0 and is_overridden("validation_step", module):
        problems.append("validation during fit runs at each replica's own step or epoch count: set "
                        "limit_val_batches=0 and validate after fit (trainer.validate) or from the checkpoints")
    if problems:
        raise ValueError("sync_seconds cannot run this fit: " + "; ".join(problems) + ".")


def params_of(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class ReplicaSetup:
    """Mixed into ``OuterStepStrategy`` before ``DDPStrategy``."""

    _groups: Optional[ProcessGroups]
    _trained_module: Optional[weakref.ReferenceType]

    @property
    def _layer_sync(self) -> None:
        return None

    @_layer_sync.setter
    def _layer_sync(self, value: Any) -> None:
        # Lightning sets this from Trainer(sync_batchnorm=True) while building the Trainer.
        if value is not None:
            raise ValueError(
                f"{type(self).__name__} does not support sync_batchnorm=True: it all-reduces batch "
                "statistics in every forward pass, which defeats low-communication training. "
                "Remove sync_batchnorm=True (each replica keeps its own statistics)."
            )

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is built, once devices and nodes are known: check N before any process starts.
        world, k = self.num_nodes * self.num_processes, self.ranks_per_replica
        if self.elastic is not None:  # type: ignore[attr-defined]
            if world != k:
                raise ValueError(
                    f"lighthouse=... makes this Trainer one replica of ranks_per_replica={k} process(es), but it has "
                    f"{world} processes ({self.num_nodes} node(s) × {self.num_processes} device(s)). Use devices=1 "
                    "and num_nodes=1 for a replica of one process, or devices × num_nodes = ranks_per_replica for a "
                    "replica of several; start one Trainer per replica."
                )
            super()._configure_launcher()
            return
        if world % k:
            raise ValueError(
                f"ranks_per_replica={k} does not divide the {world} processes ({self.num_nodes} node(s) × "
                f"{self.num_processes} device(s)). Use a divisor of {world}, e.g. the devices per node "
                f"({self.num_processes}) for one replica per node."
            )
        self.algorithm.check_num_replicas(world // k)
        if world // k == 1:
            rank_zero_warn(
                f"{type(self).__name__} with a single replica ({world} process(es), ranks_per_replica={k}): "
                "there is nobody to exchange with, so the outer steps only move this replica along its own "
                "pseudo-gradient. Use devices > 1 (or more nodes) for several replicas"
                + (", or strategy='ddp' for plain data parallelism." if k > 1 else ".")
            )
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        backend = self._get_process_group_backend()
        if backend != "nccl":
            _compat.destroy_process_group_at_exit()
        self._groups = ProcessGroups(self.ranks_per_replica, backend, self._replica_timeout())
        self._groups.create_replica_groups()

    def _replica_timeout(self) -> timedelta:
        """The timeout of a replica's own process groups. An elastic replica's own operations (DDP's or FSDP2's
        collectives, a round's agreement) fail within outer_step_timeout when one of its ranks dies: the
        replica then leaves the membership as a whole (lightning_loco.elastic.ranks)."""
        elastic = self.elastic  # type: ignore[attr-defined]
        return self._timeout if elastic is None else timedelta(seconds=elastic.outer_step_timeout)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """An elastic replica of several ranks: the error says that the replica leaves the membership as a
        whole and is restarted as a whole (a rank that died fails the others' next operation)."""
        super().on_exception(exception)
        elastic, k = self.elastic, self.ranks_per_replica  # type: ignore[attr-defined]
        if elastic is not None and k > 1 and isinstance(exception, Exception):
            if not isinstance(exception, ReplicaRankError):  # e.g. gloo's, from DDP's all-reduce: says why
                advice = restart_advice(elastic.replica_id, self.global_rank, k)
                exception.args = (f"{exception.args[0] if exception.args else exception} {advice}", *exception.args[1:])
            log.error("%s: %s", type(exception).__name__, exception)

    @override
    def configure_ddp(self) -> None:
        """With one rank per replica, no ``DistributedDataParallel`` wrapper: each replica trains on its
        own. With k > 1, torch's ``DistributedDataParallel`` over the replica's process group averages
        gradients inside the replica at every step, and never across replicas."""
        if self.ranks_per_replica > 1:
            assert self._groups is not None
            self._ddp_kwargs["process_group"] = self._groups.replica
            super().configure_ddp()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        device = self.outer_state_device
        if device.type != "cpu" and device.type != self.root_device.type:
            raise ValueError(
                f"outer_state_device={str(device)!r} does not match the model's device "
                f"{str(self.root_device)!r}. Use None or 'cpu'."
            )
        # Only fit(ckpt_path=...) may restore outer state; load_checkpoint runs after setup.
        self._resumed_outer = None
        if self._restore_signal_handler is None:  # Trainer registers its signal handlers after setup
            self._restore_signal_handler = _compat.local_sigterm_handler(trainer)
        self.accelerator.setup(trainer)
        self._prepare_model()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        trained = self._trained_module is not None and self._trained_module() is self.lightning_module
        if not trained:
            self._sync_initial_weights()  # as DistributedDataParallel would: rank 0's weights
        elif fitting:
            log.info("%s: starting this fit from the average of the replicas.", type(self).__name__)
            self.average_replicas()
        # validate/test/predict after fit: every replica keeps its own weights.
        if fitting:
            self.configure_ddp()
            self.setup_optimizers(trainer)
            self._check_optimizers()
            if self.sync_seconds is not None:  # type: ignore[attr-defined]
                check_paced_fit(trainer, self.lightning_module, len(self.optimizers))
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _prepare_model(self) -> None:
        """Called by ``setup`` before the precision plugin and the device move (sharding's turn)."""

    def _sync_initial_weights(self) -> None:
        _compat.sync_module_states(self.model)

    def _agree_overlap(self, tau: int) -> int:
        """A replica's ranks agree (they land together; sharded, they hold one model between them): the
        largest τ."""
        assert self._groups is not None
        return int(self._groups.replica_max(tau, self._comm_device()))

    def _agree_seconds(self, seconds: float) -> float:
        """Under ``sync_seconds`` a replica's ranks agree on their phase's seconds (the largest), so that
        they start rounds together and their schedules read the same nominal progress."""
        assert self._groups is not None
        return self._groups.replica_max(seconds, self._comm_device())

    def _check_optimizers(self) -> None:
        owner: dict[int, int] = {}
        for k, optimizer in enumerate(self.optimizers):
            for p in (p for group in optimizer.param_groups for p in group["params"]):
                if owner.setdefault(id(p), k) != k:
                    raise ValueError(
                        f"A parameter of shape {tuple(p.shape)} belongs to optimizers {owner[id(p)]} and {k}. "
                        "Each parameter must belong to one optimizer: every optimizer has its own outer "
                        "state. Give each optimizer a disjoint set of parameters."
                    )


    def _check_fixed_parameters(self, index: int, optimizer: Optimizer, params: list[torch.Tensor]) -> None:
        if len(params_of(optimizer)) != len(params):
            raise RuntimeError(
                f"The parameters of optimizer {index} changed during training (e.g. add_param_group). "
                f"{type(self).__name__} keeps one outer state per optimizer over a fixed parameter list; "
                "give the optimizer all its parameters in configure_optimizers (frozen ones included)."
            )

    def _warn_if_no_outer_step(self, trainer: "pl.Trainer") -> None:
        remaining, h = trainer.max_steps - trainer.global_step, self.sync_every  # type: ignore[attr-defined]
        slots = self.outer_slots  # type: ignore[attr-defined]
        if trainer.max_steps >= 0 and all(s.inner_steps + remaining < next_round_step(s, h) for s in slots):
            rank_zero_warn(
                f"No outer step will happen in this fit: {max(remaining, 0)} optimizer step(s) are left before "
                f"max_steps={trainer.max_steps}, fewer than the next outer step needs (sync_every={h}), "
                "so the replicas never meet. Lower sync_every or raise max_steps."
            )

    def _warn_if_short_run(self, trainer: "pl.Trainer") -> None:
        """Once per fit, on global rank 0: the outer step's defaults on a run of fewer outer steps than
        B5 showed they need (:mod:`lightning_loco.short_runs`). The run's length is ``max_steps``, else
        what ``max_epochs`` makes of the training batches."""
        steps = trainer.max_steps if trainer.max_steps >= 0 else trainer.estimated_stepping_batches
        warn_if_short(self.algorithm, steps, self.sync_every, rank_zero_warn)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ the consensus (global collectives)

    def _module_tensors(self) -> list[torch.Tensor]:
        module = self.lightning_module
        return list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]

    def _consensus_parts(self) -> list[tuple[list[torch.Tensor], Optional[Any]]]:
        """The tensors the consensus averages, each with its group (None: all ranks)."""
        return [(self._module_tensors(), None)]

    def _weights_changed(self) -> None:
        """Called after the consensus wrote into the model (sharding's turn)."""

    def average_replicas(self) -> None:
        """Sets every replica to the replicas' average: parameters and floating-point buffers, one
        all-reduce (two with sharded replicas). Collective: every rank must call it."""
        for tensors, group in self._consensus_parts():
            consensus.average_into(tensors, self._comm_device(), group)
        self._weights_changed()

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Swaps the replicas' average into the model, and this replica's own weights back afterwards
        (exactly, whatever the dtype). Collective: every rank must enter it."""
        device, keep_on = self._comm_device(), self.outer_state_device
        try:
            with ExitStack() as stack:
                for tensors, group in self._consensus_parts():
                    stack.enter_context(consensus.swapped_in(tensors, device, keep_on, group))
                self._weights_changed()
                yield
        finally:
            self._weights_changed()

    def replica_spread(self) -> float:
        """RMS distance of the replicas' parameters from their mean (two all-reduces; every rank must
        call it): the papers' weight-spread diagnostic."""
        return consensus.spread(list(self.lightning_module.parameters()), self._comm_device())
