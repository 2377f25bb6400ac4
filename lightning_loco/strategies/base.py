"""Lightning glue shared by every low-communication strategy: hooks in, driver out.

``OuterStepStrategy`` is a ``DDPStrategy`` that never wraps the model across replicas; launching,
the process group and the ``DistributedSampler`` stay Lightning's. Every real optimizer step
(``optimizer_step`` fires once per update, after accumulation, clipping and the precision plugin)
reaches :class:`~lightning_loco.driver.OuterStepDriver`. Setup and the consensus are in
``setup.py``, FSDP2 inside a replica in ``sharded.py``, checkpoint hooks in ``checkpointing.py``,
private Lightning symbols in ``_compat.py``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_loco import checkpoints
from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.algorithms.outer_optimizer import check_picklable
from lightning_loco.algorithms.step_weighted import check_merge
from lightning_loco.codecs import DEFAULT_BLOCK_SIZE, wire_format
from lightning_loco.driver import OuterSlot, OuterStepDriver
from lightning_loco.reports import OuterStepReport
from lightning_loco.elastic.config import elastic_config, elastic_seams
from lightning_loco.fragments import check_fragments
from lightning_loco.plugins import DriverPlugin, no_plugin
from lightning_loco.overlap import check_overlap
from lightning_loco.pacing import check_pacing
from lightning_loco.process_groups import ProcessGroups
from lightning_loco.sharding import Block, sharding_config
from lightning_loco.strategies import _compat
from lightning_loco.strategies.checkpointing import ReplicaCheckpoints
from lightning_loco.strategies.sharded import ReplicaSharding
from lightning_loco.strategies.views import ReplicaViews
from lightning_loco.strategies.setup import (
    ReplicaSetup,
    check_final_outer_step,
    check_int,
    fit_ends_after_this_step,
    params_of,
    parse_device,
)
from lightning_loco.strategies.training_state import (
    BetweenSteps,
    LightningTrainingState,
    say_why_fit_ended,
    stop_on_sigterm,
)
from lightning_loco.transport import TorchDistributedTransport, Transport

_compat.check_lightning()  # a Lightning without the private symbols we use fails here, naming them
log = logging.getLogger("lightning_loco")
TransportFactory = Callable[..., Transport]


class OuterStepStrategy(ReplicaViews, ReplicaSharding, ReplicaSetup, ReplicaCheckpoints, DDPStrategy):
    """Replicas that train apart and meet every ``sync_every`` optimizer steps. Each algorithm's
    strategy passes its ``algorithm`` and ``sync_every``; these arguments are common to all:

    Args:
        overlap_steps: τ, inner steps during which the outer step's exchange runs in the background
            before it lands (0 < τ < H); 0 (default) is the papers' synchronous outer step. "auto"
            measures the exchange and the inner steps and picks the smallest τ that hides the
            exchange, at most H/2 for NoLoCo and H/4 otherwise; runs with "auto" are not bitwise
            reproducible.
        fragments: F, streaming fragments: one of F fragments of the model (whole parameters) has a round
            every H/F steps, with its own outer state and peers (F divides H, τ < H/F; 1: the whole model).
        overlap_merge: how a landing round meets the τ steps taken meanwhile: "predict_correct"
            (default: start the τ steps from the local prediction of the outer step, add the
            correction at the landing) or "delayed" (apply the outer step's change at the landing).
        sync_seconds: T, for replicas of different speeds: each replica takes its own number of inner
            steps per round, H_i, posting its next round once its inner phase is as near T seconds of
            compute on its own clock (the waits at exchanges left out) as its steps allow, after at
            least one inner step and at most ``sync_every``, so that nobody waits for a slower replica. About ``sync_every`` × the
            fastest replica's step time paces every replica. The run is then ⌈max_steps / sync_every⌉
            rounds on every replica (``max_steps`` is required, counted in nominal steps), each
            replica's ``global_step`` is its own optimizer steps, and validation and checkpoints must
            not follow those counts: use ``OuterStepCheckpoint``. None (default): every replica takes
            ``sync_every`` steps per round. Needs ``overlap_steps=0`` and one optimizer; see
            docs/heterogeneous.md.
        merge: with ``sync_seconds``, how a group combines payloads of unequal H_i: "mean" (default: the
            plain mean) or "steps" (each replica weighted by its H_i, which travels with the payload;
            NoLoCo and DiLoCo, float32 wire only). See docs/heterogeneous.md.
        ranks_per_replica: k, consecutive global ranks that form one replica (default 1: every
            process is a replica). Inside a replica torch's ``DistributedDataParallel`` averages
            gradients at every step over the replica's own process group; between replicas only the
            outer step travels, each rank moving 1/k of the model. Use the devices per node for one
            replica per node. The world size must be a multiple of k.
        replica_sharding: None (default: every rank of a replica holds the whole model, DDP inside) or
            "fsdp": FSDP2 shards the model, its gradients and inner optimizer state over the replica's
            k ranks, and the outer step runs on each rank's local shards (outer state and bytes sent
            1/k per rank; rank j exchanges with rank j of its partners, nothing is gathered). The
            module's ``configure_model`` may call ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``
            as for Lightning's ``ModelParallelStrategy`` (the mesh is the replica's k ranks); without
            one, the automatic policy shards every ``fsdp_blocks`` module, then every direct child
            of the LightningModule that holds parameters. Every replica must shard alike (checked at
            setup; elastic replicas: at each heal, which goes shard by shard). Launch with popen (the
            default), torchrun or SLURM. See docs/launching.md.
        fsdp_blocks: with replica_sharding="fsdp" and no sharding in ``configure_model``: the module
            classes (or class names) sharded one unit each, e.g. ``(TransformerBlock,)`` (default ():
            each direct child of the LightningModule is one unit).
        fsdp_kwargs: keyword arguments of the automatic policy's ``fully_shard`` calls, e.g.
            ``{"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}``
            (the outer state stays float32) or ``{"reshard_after_forward": False}``.
        average_at_end: at the end of ``fit``, set every replica to the replicas' average (one
            all-reduce), so the model in memory is the consensus model. The papers define no final
            model; this is our choice. False keeps each replica's own weights.
        final_outer_step: how the round that ends ``fit`` lands. "average" (default): the live weights
            become the group's combination without the outer step's momentum extrapolation (NoLoCo:
            the group's mean weights; DiLoCo: the replicas' mean weights; GASLoC: the gossip mix x),
            since no inner step follows to correct an overshoot; the outer state is updated as usual.
            "outer": the papers' plain outer step. The papers define no final model; this is our
            choice. It applies when ``fit`` ends at ``max_steps`` or ``max_epochs`` (and to a round
            still in flight then), not to an early stop nobody can foresee.
        wire_dtype: the float format of the outer step's payloads on the wire: "float32" (default: sent
            as they are), "bfloat16" or "float16" (half the bytes). The outer state stays float32 and
            receivers decode and sum in float32; DiLoCo's all-reduce never sums in low precision (an
            all-to-all of encoded chunks, float32 sums, an all-gather). float16 keeps 3 more bits than
            bfloat16 but carries no |x| > 65504 (such a payload fails with a clear error). See
            docs/compression.md for which suits which algorithm.
        compression: None (default) or "int8": each block of ``compression_block_size`` values is sent
            as int8 with one float32 scale (about a quarter of float32's bytes). Leave ``wire_dtype`` at
            "float32" with it.
        compression_block_size: values per int8 scale, an integer >= 1 (default 256: 1.6 % of the int8
            bytes go to scales; smaller blocks follow outliers more closely for more scale bytes).
        error_feedback: with a lossy wire format, keep what the codec lost of each payload and add it
            to the next (the residual is outer state, saved in checkpoints). None (default): on where
            the payload is a pseudo-gradient (DiLoCo), off where it is weights (NoLoCo, GASLoC), as
            measured in docs/compression.md; True or False forces it.
        outer_state_device: where the float32 outer state lives. None: the model's device; "cpu"
            keeps it off the accelerator.
        transport_factory: builds the transport of the outer steps, with the keyword arguments of
            ``TorchDistributedTransport`` (default: that class; ``sharded=True`` too with
            replica_sharding). For network models and tests.
        lighthouse: ``HOST:PORT`` of a Lighthouse (``lightning-loco lighthouse``) for elastic replicas:
            this Trainer is then one replica, its own job, and replicas that die or join do not stop the
            others (needs ``pip install lightning-loco[elastic]``; see ``docs/elastic.md``). None
            (default): the static launch, one world of every replica.
        replica_id: elastic only: this replica's name, unique among the live replicas (default HOST-PID).
        outer_step_timeout: elastic only: seconds an exchange waits for a partner before this replica
            finishes the round alone (default 120).
        join_timeout: elastic only: seconds a replica waits to be admitted to a membership and for the
            state it heals from (default 600).
        membership_every: elastic only: K, outer steps between membership refreshes (default 1).
        heal: elastic only: a joiner takes a live replica's whole training state (True, default) or only
            its step counts (False: resumed from its own checkpoint).
        heal_optimizer: elastic only: the state a joiner takes includes the inner optimizer's (True, default);
            False leaves it out (half a heal's bytes with AdamW; the joiner's optimizer starts afresh).
        straggler_timeout: elastic only: seconds an exchange waits for a live partner that is late; past it
            both take that round alone (DiLoCo: drop it) and meet again next round (default None: off).
        accelerator: as in ``DDPStrategy``.
        parallel_devices: as in ``DDPStrategy``.
        cluster_environment: as in ``DDPStrategy``.
        checkpoint_io: as in ``DDPStrategy``.
        precision_plugin: as in ``DDPStrategy``.
        process_group_backend: as in ``DDPStrategy`` ("gloo" on CPU, "nccl" on CUDA by default).
        timeout: as in ``DDPStrategy``: how long a peer is awaited before the run fails.
        start_method: as in ``DDPStrategy``: "popen" (default, also torchrun/SLURM), "spawn" or
            "forkserver" (the strategy's arguments must pickle), "fork".
    """

    strategy_name = ""  # the name for Trainer(strategy=...), set by each algorithm's strategy
    description = ""
    abandon_timeout_s: float = 10.0  # how long an interrupted fit waits for a round in flight

    def __init__(
        self,
        algorithm: OuterAlgorithm,
        sync_every: int,
        *,
        overlap_steps: Union[int, Literal["auto"]] = 0,
        overlap_merge: Literal["predict_correct", "delayed"] = "predict_correct",
        fragments: int = 1,
        sync_seconds: Optional[float] = None,
        merge: Literal["mean", "steps"] = "mean",
        ranks_per_replica: int = 1,
        replica_sharding: Optional[Literal["fsdp"]] = None,
        fsdp_blocks: Sequence[Block] = (),
        fsdp_kwargs: Optional[dict[str, Any]] = None,
        average_at_end: bool = True,
        final_outer_step: Literal["average", "outer"] = "average",
        wire_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        compression: Optional[Literal["int8"]] = None,
        compression_block_size: int = DEFAULT_BLOCK_SIZE,
        error_feedback: Optional[bool] = None,
        outer_state_device: Optional[str] = None,
        transport_factory: Optional[TransportFactory] = None,
        lighthouse: Optional[str] = None,
        replica_id: Optional[str] = None,
        outer_step_timeout: float = 120.0,
        join_timeout: float = 600.0,
        membership_every: int = 1,
        heal: bool = True,
        straggler_timeout: Optional[float] = None,
        heal_optimizer: bool = True,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        check_int("sync_every (H)", sync_every, "It counts inner optimizer steps between outer steps.")
        check_int("ranks_per_replica", ranks_per_replica, "1 (the default) makes every process a replica; the "
                   "number of devices per node makes every node one replica.")
        check_overlap(overlap_steps, overlap_merge, sync_every)
        check_pacing(sync_seconds, overlap_steps)
        check_fragments(fragments, sync_every, overlap_steps, sync_seconds=sync_seconds, elastic=lighthouse is not None,
                        replica_sharding=replica_sharding)
        check_final_outer_step(final_outer_step)
        wire = wire_format(wire_dtype, compression, compression_block_size, error_feedback,
                           pseudo_gradient=algorithm.payload_is_pseudo_gradient)
        check_merge(merge, sync_seconds, algorithm.name, wire.lossy)
        device = parse_device(outer_state_device)
        check_picklable(getattr(algorithm, "outer_optimizer", None), start_method)
        self.elastic = elastic_config(
            lighthouse, replica_id, outer_step_timeout, join_timeout, membership_every, heal, straggler_timeout,
            heal_optimizer,
            algorithm_name=algorithm.name, overlap_steps=overlap_steps, ranks_per_replica=ranks_per_replica,
            topology=getattr(algorithm, "topology", None), lossy_wire=wire.lossy,
        )
        self.sharding = sharding_config(replica_sharding, fsdp_blocks, fsdp_kwargs, start_method=start_method)
        # No **kwargs to DDPStrategy: it would hand them to DistributedDataParallel, which we never build.
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
        )
        self.algorithm, self.sync_every = algorithm, sync_every
        self.overlap_steps, self.overlap_merge, self.fragments = overlap_steps, overlap_merge, fragments
        self.sync_seconds, self.merge = sync_seconds, merge
        self.pacing_clock: Callable[[], float] = time.perf_counter  # the inner phases' clock (tests replace it)
        self.ranks_per_replica, self.average_at_end = ranks_per_replica, bool(average_at_end)
        self.replica_sharding, self.fsdp_blocks, self.fsdp_kwargs = replica_sharding, fsdp_blocks, fsdp_kwargs
        self.final_outer_step = final_outer_step
        self.wire_dtype, self.compression = wire_dtype, compression
        self.compression_block_size, self.error_feedback = compression_block_size, error_feedback
        self.wire = wire
        self._outer_state_device = device
        self.transport_factory = transport_factory or TorchDistributedTransport
        self._plugin_factory: Callable[[Transport], DriverPlugin] = no_plugin
        if self.elastic is not None:  # the elastic transport and the driver's plug-in, through the same seams
            self.transport_factory, self._plugin_factory = elastic_seams(self.elastic, transport_factory, sync_seconds)
        self.driver: Optional[OuterStepDriver] = None  # during fit
        self._groups: Optional[ProcessGroups] = None
        self._trained_module: Optional[weakref.ReferenceType] = None
        # each undoes one of our changes to Lightning's trainer (see _compat.py)
        self._restore_signal_handler: Optional[Callable[[], None]] = None  # from setup to teardown
        self._restore_sigterm_check: Optional[Callable[[], None]] = None  # while training
        self._resumed_outer: Optional[list[dict[str, Any]]] = None  # from fit(ckpt_path=...), until training starts
        self._final_outer_steps = 0
        self._said_why_ended = False  # elastic: the end of fit was logged
        self.outer_step_reports: list[OuterStepReport] = []  # this fit's rounds, in the order they finished
        self.rounds_started: list[tuple[int, int]] = []  # (optimizer index, t) as rounds start, in order
        self.track_norms = False  # set by OuterStepMonitor: costs one anchor copy per outer step

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name:
            strategy_registry.register(cls.strategy_name, cls, description=cls.description, override=True)

    # ------------------------------------------------------------------ training

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self._trained_module = weakref.ref(self.lightning_module)
        assert self._groups is not None
        elastic = {} if self.elastic is None else {  # the waits for the Lighthouse and a donor stop on SIGTERM
            "check_stop": stop_on_sigterm(trainer, f"Replica {self.elastic.replica_id!r}")}
        transport = self.transport_factory(
            device=self._comm_device(), process_group=self._groups.overlap_group() if self.overlap_steps else None,
            ranks_per_replica=self.ranks_per_replica, replica_group=self._groups.replica,
            slice_group=self._groups.slice, **elastic, **self._transport_options(),
        )
        self.driver = OuterStepDriver(
            self.algorithm, transport, self.sync_every, self.overlap_steps, self.overlap_merge,
            agree_overlap=self._agree_overlap if self.ranks_per_replica > 1 else None,
            label=f"Replica {self.replica_index}", final_outer_step=self.final_outer_step,
            wire=self.wire if self.wire.lossy else None, plugin=self._plugin_factory(transport),
            sync_seconds=self.sync_seconds, merge=self.merge, clock=self.pacing_clock,
            agree_seconds=self._agree_seconds if self.ranks_per_replica > 1 else None, fragments=self.fragments,
        )
        self.driver.track_norms = self.track_norms
        for optimizer in self.optimizers:
            self.driver.add(self._flat_parameters(params_of(optimizer)))
        self.outer_step_reports, self.rounds_started = self.driver.reports, self.driver.rounds_started
        if self._resumed_outer is not None:
            try:
                self.driver.load_state_dict(self._resumed_outer)
            except ValueError as err:
                raise checkpoints.CheckpointError(str(err)) from err
            self._resumed_outer = None
        # what a healing elastic replica takes beyond the driver's state: optimizers, schedulers, loop counters
        self.driver.plugin.use_training_state(LightningTrainingState(trainer).for_plugin())
        BetweenSteps.insert(trainer)  # the plug-in's between_steps, before any callback sees a batch's step
        self._said_why_ended = False
        if self.driver.pacing is not None:
            self.driver.pacing.end_at(trainer.max_steps)  # ⌈max_steps / H⌉ rounds, the same on every replica
        self.driver.before_training()  # elastic: the first membership is taken at the first batch's start
        self._restore_sigterm_check = _compat.disable_per_batch_sigterm_broadcast(trainer.fit_loop.epoch_loop)
        self._warn_if_no_outer_step(trainer)
        self._warn_if_short_run(trainer)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        index = next((i for i, o in enumerate(self.optimizers) if o is optimizer), None)
        if self.driver is None or index is None or index >= len(self.driver.optimizer_slots):
            raise RuntimeError(
                f"{type(self).__name__} has no outer state for this optimizer: optimizer steps must happen "
                "during trainer.fit, on an optimizer returned by configure_optimizers."
            )
        if self.driver.round_due(index):
            self._check_fixed_parameters(index, optimizer, self.driver.params_of(index))
        trainer = self.lightning_module.trainer
        driver_steps = self.driver.ends_by_driver_steps and trainer.max_steps >= 0
        if driver_steps:
            # A healed replica took the others' step count, and under sync_seconds the run ends on a round:
            # max_steps counts the run's steps, not this process's.
            last = self.driver.last_step(index, trainer.max_steps)
        else:
            per_batch = 1 if self.lightning_module.automatic_optimization else len(self.optimizers)
            last = fit_ends_after_this_step(trainer, per_batch)
        self.driver.after_inner_step(index, last=last)
        if driver_steps and last:
            trainer.should_stop = True
        return output

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.driver is not None:
            # Rounds that landed as the last (final_outer_step="average") before more training, from a
            # resumed checkpoint or a guess for manual optimization: back to the outer step's weights.
            self.driver.restore_outer_weights()

    @override
    def on_train_end(self) -> None:
        self._undo_sigterm_check()
        if self.driver is not None:
            self.driver.land_all()  # a round still in flight lands now, early (as the final round)
            self._say_why_ended(interrupted=False)
        if self.average_at_end:
            self.average_replicas()
        super().on_train_end()

    def _say_why_ended(self, interrupted: bool) -> None:
        """Elastic: one log line for the step fit stopped at (and why, when it is not ``max_steps``)."""
        if self.elastic is not None and not self._said_why_ended and self.driver is not None:
            self._said_why_ended = True
            label = f"Replica {self.elastic.replica_id!r}"
            say_why_fit_ended(self.lightning_module.trainer, label, self.outer_steps, interrupted)

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
        lingering = []
        if self.driver is not None:  # only left in flight after an interrupted fit: on_train_end lands rounds
            self._say_why_ended(interrupted=True)
            lingering = self.driver.abandon_all(self.abandon_timeout_s)
            self._final_outer_steps = self.outer_steps
            self.driver.close()  # elastic: leaves the membership (the heartbeats stop)
        # The outer state (float32 anchors, momenta, outer optimizer state, buffers in flight: 2-3 model
        # copies, on the accelerator by default) goes now; outer_step_reports and the module's weights stay.
        self.driver, self._resumed_outer = None, None
        if self._groups is not None:
            self._groups.destroy(lingering)
            self._groups = None
        super().teardown()
