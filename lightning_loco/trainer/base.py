"""Lightning glue shared by every low-communication strategy: hooks in, the replica out.

``OuterStepStrategy`` is a ``DDPStrategy`` that never wraps the model across replicas; launching,
the process group and the ``DistributedSampler`` stay Lightning's. It is an adapter of the Trainer's hooks to
its :class:`~lightning_loco.replica.replica.Replica` (``self.replica``), the same Lightning-free replica the
Fabric strategies adapt: its run mode, layout (whole or FSDP2), process groups, run of rounds, checkpoint
payloads and consensus. Every real optimizer step (``optimizer_step`` fires once per update, after
accumulation, clipping and the precision plugin) reaches the replica's
:class:`~lightning_loco.replica.run.ReplicaRun`. The options are
:mod:`lightning_loco.replica.options`'s, their rules :mod:`lightning_loco.rules`'s. Checkpoint hooks
are in ``checkpointing.py``, fit's facts and warnings in ``setup.py``, private Lightning symbols in
``_compat.py``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_loco import _compat
from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.driver import lr_schedules
from lightning_loco.driver.reports import OuterStepReport
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.replica.options import FSDPConfig, PacingConfig, WireConfig, WireFormatName
from lightning_loco.replica.replica import Replica
from lightning_loco.rules import Launch, build_options
from lightning_loco.trainer import data_lengths, setup, validation
from lightning_loco.trainer.checkpointing import ReplicaCheckpoints
from lightning_loco.trainer.training_state import (
    BetweenSteps,
    LightningTrainingState,
    say_why_fit_ended,
    stop_on_sigterm,
)

_compat.check_lightning()  # a Lightning without the private symbols we use fails here, naming them
log = logging.getLogger("lightning_loco")


class OuterStepStrategy(ReplicaCheckpoints):
    """Replicas that train apart and meet every ``sync_every`` optimizer steps. Each algorithm's
    strategy passes its ``algorithm`` and ``sync_every``; these arguments are common to all (their
    combinations are refused or served as docs/options.md's table says):

    Args:
        overlap_steps: τ: the exchange hides behind τ inner steps (0: none; "auto"). docs/overlap.md.
        overlap_merge: how an overlapped round lands: "predict_correct" or "delayed".
        fragments: F: one of F fragments of the model meets every H/F steps. docs/fragments.md.
        pacing: replicas of different speeds: T seconds a round, or a PacingConfig. docs/heterogeneous.md.
        ranks_per_replica: k consecutive ranks form one replica (DDP or FSDP2 inside). docs/launching.md.
        replica_sharding: FSDP2 inside each replica: "fsdp" or an FSDPConfig (None: DDP inside).
        average_at_end: end fit on the replicas' average (None: unless elastic).
        final_outer_step: how the last round lands (docs/checkpoints.md).
        wire: the payloads' format (or a WireConfig). docs/compression.md.
        outer_state_device: where the float32 outer state lives ("cpu"; None: the model's device).
        transport_factory: builds the rounds' transport (network models, tests).
        elastic: an ElasticConfig: this Trainer is one replica of an elastic run on torchft's Lighthouse.
            docs/elastic.md.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as in ``DDPStrategy``.
    """

    strategy_name = ""  # the name for Trainer(strategy=...), set by each algorithm's strategy
    description = ""

    def __init__(
        self,
        algorithm: OuterAlgorithm,
        sync_every: int,
        *,
        overlap_steps: Union[int, Literal["auto"]] = 0,
        overlap_merge: Literal["predict_correct", "delayed"] = "predict_correct",
        fragments: int = 1,
        pacing: Union[None, float, Literal["auto"], PacingConfig] = None,
        ranks_per_replica: int = 1,
        replica_sharding: Union[None, Literal["fsdp"], FSDPConfig] = None,
        average_at_end: Optional[bool] = None,
        final_outer_step: Literal["average", "outer"] = "average",
        wire: Union[WireFormatName, WireConfig] = "float32",
        outer_state_device: Optional[str] = None,
        transport_factory: Optional[Callable[..., Any]] = None,
        elastic: Optional[ElasticConfig] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.options = build_options(
            algorithm, sync_every, overlap_steps=overlap_steps, overlap_merge=overlap_merge, fragments=fragments,
            pacing=pacing, ranks_per_replica=ranks_per_replica, replica_sharding=replica_sharding,
            average_at_end=average_at_end, final_outer_step=final_outer_step, wire=wire,
            outer_state_device=outer_state_device, transport_factory=transport_factory, elastic=elastic,
            start_method=start_method,
        )
        # No **kwargs to DDPStrategy: it would hand them to DistributedDataParallel, which we never build.
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
        )
        self.replica = Replica(self.options, self)  # its mode, layout, process groups, run, checkpoints, consensus
        self._sync_batchnorm = False
        self._trained_module: Optional[weakref.ReferenceType] = None
        # each undoes one of our changes to Lightning's trainer (see _compat.py)
        self._restore_signal_handler: Optional[Callable[[], None]] = None  # from setup to teardown
        self._restore_sigterm_check: Optional[Callable[[], None]] = None  # while training
        self._nominal_schedulers: list[Any] = []  # with pacing: Lightning's step-interval scheduler configs, in fit
        self._said_why_ended = False  # the end of fit was logged
        self.outer_step_reports: list[OuterStepReport] = []  # this fit's rounds, in the order they finished
        self.rounds_started: list[tuple[int, int]] = []  # (optimizer index, t) as rounds start, in order

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name:
            strategy_registry.register(cls.strategy_name, cls, description=cls.description, override=True)

    @property
    def device_mesh(self) -> Any:
        """The replica's ("data_parallel", "tensor_parallel") mesh of shape (k, 1), with
        ``replica_sharding`` (also the module's ``self.device_mesh``)."""
        return self.layout.device_mesh

    # ------------------------------------------------------------------ launching and setup

    @property
    def _layer_sync(self) -> None:
        return None

    @_layer_sync.setter
    def _layer_sync(self, value: Any) -> None:
        # Lightning sets this from Trainer(sync_batchnorm=...) while building the Trainer, before the launcher.
        self._sync_batchnorm = value is not None

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is built, once devices and nodes are known: before any process starts.
        launch = Launch(self.num_nodes, self.num_processes, self._sync_batchnorm)
        self.replica.check_launch(launch)
        setup.warn_if_one_replica(self, launch)
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        backend = self._get_process_group_backend()
        if backend != "nccl":
            _compat.destroy_process_group_at_exit()
        self.replica.setup_distributed(backend, self._timeout)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        with self.layout.tensor_init_context(empty_init, super().tensor_init_context,
                                             self.precision_plugin.tensor_init_context):
            yield

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        data_lengths.say_fit_failed(self, exception)
        self.mode.annotate(exception, self.global_rank, self.ranks_per_replica)

    @override
    def configure_ddp(self) -> None:
        """With one rank per replica, no ``DistributedDataParallel`` wrapper: each replica trains on its
        own. With k > 1 (whole replicas), torch's ``DistributedDataParallel`` over the replica's process
        group averages gradients inside the replica at every step, and never across replicas."""
        def inside_the_replica() -> None:
            assert self.replica.groups is not None
            self._ddp_kwargs["process_group"] = self.replica.groups.replica
            DDPStrategy.configure_ddp(self)

        self.layout.configure_ddp(inside_the_replica)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        validation.put_first(trainer)
        # Only fit(ckpt_path=...) may restore outer state; load_checkpoint runs after setup.
        self.replica.resumed_outer = None
        if self._restore_signal_handler is None:  # Trainer registers its signal handlers after setup
            self._restore_signal_handler = _compat.local_sigterm_handler(trainer)
        self.accelerator.setup(trainer)
        self.layout.prepare_model()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        trained = self._trained_module is not None and self._trained_module() is self.lightning_module
        if not trained:
            self.layout.sync_initial_weights()  # as DistributedDataParallel would: rank 0's weights
        elif fitting:
            log.info("%s: starting this fit from the average of the replicas.", type(self).__name__)
            self.average_replicas()
        # validate/test/predict after fit: every replica keeps its own weights.
        if fitting:
            self.configure_ddp()
            self.setup_optimizers(trainer)
            facts = setup.fit_facts(trainer, self.module, self.optimizers, self.root_device)
            self.replica.check_fit(facts)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    # ------------------------------------------------------------------ training

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.module.trainer
        self._trained_module = weakref.ref(self.lightning_module)
        name = self.mode.replica_name(self.replica_index)
        # what a healing elastic replica takes beyond the driver's state: optimizers, schedulers, loop counters
        state = LightningTrainingState(trainer, self.layout).for_plugin()
        run = self.replica.start(self.optimizers, state, trainer.max_steps,
                                 check_stop=stop_on_sigterm(trainer, f"Replica {name!r}"))
        self.outer_step_reports, self.rounds_started = run.driver.reports, run.driver.rounds_started
        data_lengths.watch_peers(self, trainer)  # uneven data: refused now, or named when a replica stops
        BetweenSteps.insert(trainer)  # the plug-in's between_steps, before any callback sees a batch's step
        self._said_why_ended = False
        self._restore_sigterm_check = _compat.disable_per_batch_sigterm_broadcast(trainer.fit_loop.epoch_loop)
        setup.warn_if_no_outer_step(self, trainer)
        setup.warn_if_short_run(self, trainer)
        setup.warn_if_replicas_read_the_same_data(self, trainer)
        self._nominal_schedulers = setup.schedulers_on_nominal_steps(self, trainer)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        index = next((i for i, o in enumerate(self.optimizers) if o is optimizer), None)
        if self.run is None or index is None:
            raise RuntimeError(
                f"{type(self).__name__} has no outer state for this optimizer: optimizer steps must happen "
                "during trainer.fit, on an optimizer returned by configure_optimizers."
            )
        trainer = self.module.trainer
        per_batch = 1 if self.module.automatic_optimization else len(self.optimizers)
        stop = self.run.after_step(index, optimizer, trainer.max_steps,
                                   lambda: setup.fit_ends_after_this_step(trainer, per_batch), type(self).__name__)
        if stop:  # the driver ends the run (pacing: on a round; a healed replica: at the run's step count)
            trainer.should_stop = True
        return output

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.run is not None:
            self.run.before_batch()

    def follow_nominal_steps(self) -> None:
        """With ``pacing``: the step-interval schedulers catch up with the run's nominal progress
        (:mod:`lightning_loco.driver.lr_schedules`); called after each batch's own scheduler steps, and at the end."""
        nominal = self.nominal_step
        if nominal is None:
            return
        limit = self.module.trainer.max_steps
        for config in self._nominal_schedulers:
            lr_schedules.catch_up(config.scheduler, nominal, config.frequency,
                                  limit // config.frequency if limit >= 0 else None)

    @override
    def on_train_end(self) -> None:
        self._undo_sigterm_check()
        if self.run is not None:
            data_lengths.say_fit_ended(self, self.module.trainer)
            self.replica.end()  # a round still in flight lands now, early (as the final round)
            self.follow_nominal_steps()
            self._say_why_ended(interrupted=False)
        self.replica.average_at_end()
        super().on_train_end()

    def _say_why_ended(self, interrupted: bool) -> None:
        """Elastic: one log line for the step fit stopped at (and why, when it is not ``max_steps``)."""
        if self.mode.explains_stops() and not self._said_why_ended and self.run is not None:
            self._said_why_ended = True
            label = f"Replica {self.mode.replica_name(self.replica_index)!r}"
            say_why_fit_ended(self.module.trainer, label, self.outer_steps, interrupted)

    def _undo_sigterm_check(self) -> None:
        if self._restore_sigterm_check is not None:
            self._restore_sigterm_check()
            self._restore_sigterm_check = None

    @override
    def teardown(self) -> None:
        self._undo_sigterm_check()
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:
            BetweenSteps.remove(trainer)
        if self._restore_signal_handler is not None:
            self._restore_signal_handler()
            self._restore_signal_handler = None
        if trainer is not None and self.replica.loaded is not None:
            self._end_a_fit_resumed_at_its_end(trainer)  # fit(ckpt_path=...) of a finished run: no step taken
        if self.run is not None:  # rounds are only left in flight after an interrupted fit: on_train_end lands them
            self._say_why_ended(interrupted=True)
        # elastic: leaves the membership (heartbeats stop). The outer state (float32 anchors, momenta, outer
        # optimizer state, buffers in flight: 2-3 model copies, on the accelerator by default) goes now, and the
        # process groups; outer_step_reports and the module's weights stay.
        self.replica.close()
        super().teardown()

    # ------------------------------------------------------------------ state dicts

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.layout.load_model_state_dict(checkpoint, strict, super().load_model_state_dict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self.layout.load_optimizer_state_dict(checkpoint, self.optimizers, super().load_optimizer_state_dict)

    # ------------------------------------------------------------------ the consensus (global collectives)

    def average_replicas(self) -> None:
        """Sets every replica to the replicas' average: parameters and floating-point buffers, one
        all-reduce (two with sharded replicas). Collective: every rank must call it."""
        self.replica.average()

    def consensus_state_dict(self) -> Optional[dict[str, Any]]:
        """The replicas' average as a plain state dict of full tensors, for ``torch.save`` or another model's
        ``load_state_dict`` (with FSDP2 inside a replica the module's own ``state_dict()`` holds ``DTensor``
        shards). Floating-point entries are averaged over the replicas, others are this replica's. A
        collective: every rank must call it; with sharded replicas global rank 0 gets the dict and the others
        None, else every rank gets it. Elastic replicas have no collective over each other: refused."""
        if self.elastic is not None:
            raise RuntimeError(
                "consensus_state_dict() averages over every replica, and elastic replicas have no collective over "
                "each other; save this replica's own weights (its checkpoint) instead."
            )
        return self.replica.consensus_state_dict(self.module.state_dict())

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Swaps the replicas' average into the model, and this replica's own weights back afterwards
        (exactly, whatever the dtype). Collective: every rank must enter it."""
        with self.replica.consensus_weights():
            yield

    def replica_spread(self) -> float:
        """RMS distance of the replicas' parameters from their mean (two all-reduces; every rank must
        call it): the papers' weight-spread diagnostic."""
        return self.replica.spread()
