"""Lightning glue shared by every low-communication strategy.

``OuterStepStrategy`` is a ``DDPStrategy`` that does not wrap the model: launching (popen, spawn,
torchrun, SLURM), the process group, the ``DistributedSampler`` and ``reduce``/``barrier``/
``broadcast`` are Lightning's. What it adds:

* replicas start from rank 0's weights, then train independently (no gradient all-reduce between
  replicas; with ``ranks_per_replica`` = k > 1 a replica is k consecutive ranks wrapped in torch's
  ``DistributedDataParallel`` over the replica's own process group);
* after every ``sync_every``-th real optimizer step (``optimizer_step`` fires once per update, after
  gradient accumulation, clipping and the precision plugin, and once per optimizer in manual
  optimization) it runs the algorithm's outer step on that optimizer's parameters, or with
  ``overlap_steps`` starts it there and lands it later (see ``lightning_loco/overlap.py``);
* no global collective while training: Lightning's per-batch SIGTERM broadcast is replaced by a
  local check for the duration of ``fit``, and its SIGTERM handler no longer broadcasts (see
  ``_compat.py``): a signalled rank stops at its next batch, its peers with a ``PeerError`` at their
  next exchange with it;
* checkpoints that keep every replica (see ``lightning_loco/checkpoints.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_loco import checkpoints
from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.flat import FlatParameters
from lightning_loco.overlap import (
    AutoOverlap,
    InFlight,
    OverlapSteps,
    auto_cap,
    check_overlap,
    correction_norm,
    merge_at_landing,
)
from lightning_loco.strategies._compat import (
    check_lightning,
    destroy_process_group_at_exit,
    disable_per_batch_sigterm_broadcast,
    local_sigterm_handler,
    optimizers_to_device,
    sync_module_states,
)
from lightning_loco.transport import PendingSum, TorchDistributedTransport

check_lightning()  # a Lightning without the private symbols we use fails here, naming them
log = logging.getLogger("lightning_loco")


@dataclass
class OptimizerReplica:
    """This replica's outer state for one inner optimizer, and its step counters."""

    optimizer: Optimizer
    flat: FlatParameters
    state: OuterState
    inner_steps: int = 0  # optimizer_step calls (counted even if an fp16 scaler skips the step)
    outer_steps: int = 0  # rounds started
    in_flight: Optional[InFlight] = None  # a round started and not landed yet (overlap only)
    auto: Optional[AutoOverlap] = None  # chooses τ when overlap_steps="auto"
    last_step_end: Optional[float] = None  # "auto" only: when this optimizer's previous optimizer_step returned


@dataclass(frozen=True)
class OuterStepReport:
    """What happened at the latest outer step of one optimizer on this replica."""

    optimizer_index: int
    outer_step: int  # index t of the round that just ran
    inner_step: int  # this optimizer's step count when it ran
    peers: tuple[int, ...]
    bytes_sent: int
    bytes_received: int
    comm_seconds: float
    seconds: float
    pseudo_gradient_norm: Optional[float] = None  # ‖θ − anchor‖ before the step (when norms are tracked)
    update_norm: Optional[float] = None  # ‖anchor after − anchor before‖
    overlap_steps: int = 0  # τ: inner steps between the start of the round and its landing
    exchange_seconds: Optional[float] = None  # overlapped rounds: posting until the exchange completed
    correction_norm: Optional[float] = None  # overlapped rounds: ‖change applied to θ at the landing‖
    peer_distance: Optional[float] = None  # ‖own payload − group's mean payload‖: a free, local spread signal


def peer_distance(own: torch.Tensor, group_sum: torch.Tensor, group_size: int) -> Optional[float]:
    """‖own payload − the group's mean payload‖: how far this replica stood from the replicas it just
    met, known after every exchange at no extra cost. ``None`` for a replica that met nobody."""
    if group_size < 2:
        return None
    mean = group_sum.to(own.device) / group_size
    return torch.linalg.vector_norm(own - mean).item()


def _parse_device(value: Optional[Union[str, torch.device]]) -> Optional[torch.device]:
    if value is None:
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"outer_state_device={value!r} is not a device torch knows. Use None (the model's device) "
            "or 'cpu' (keeps the float32 outer state off the accelerator)."
        ) from err


class OuterStepStrategy(DDPStrategy):
    """Replicas that train apart and meet every ``sync_every`` optimizer steps (abstract base).

    Args:
        algorithm: the outer-step maths.
        sync_every: H, inner optimizer steps between outer steps (counted per optimizer).
        average_at_end: at the end of ``fit``, set every replica to the replicas' average (one
            all-reduce), so the model in memory is the consensus model.
        outer_state_device: where the float32 outer state lives; ``None`` means the model's device.
        overlap_steps: τ, inner steps during which the outer step's exchange runs in the background
            before it lands; 0 is the synchronous outer step, "auto" picks τ from measured times.
        overlap_merge: "predict_correct" or "delayed": how a landing round meets the τ steps taken
            meanwhile (``lightning_loco/overlap.py``).
        ranks_per_replica: k, consecutive global ranks that form one replica (DDP inside it).
        The remaining arguments are ``DDPStrategy``'s, with the same meaning.
    """

    def __init__(
        self,
        algorithm: OuterAlgorithm,
        sync_every: int,
        average_at_end: bool = True,
        outer_state_device: Optional[Union[str, torch.device]] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        overlap_steps: OverlapSteps = 0,
        overlap_merge: str = "predict_correct",
        ranks_per_replica: int = 1,
    ) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1, got {sync_every!r}.")
        if isinstance(ranks_per_replica, bool) or not isinstance(ranks_per_replica, int) or ranks_per_replica < 1:
            raise ValueError(
                f"ranks_per_replica must be an integer >= 1, got {ranks_per_replica!r}. 1 (the default) makes every "
                "process a replica; the number of devices per node makes every node one replica."
            )
        check_overlap(overlap_steps, overlap_merge, sync_every)
        device = _parse_device(outer_state_device)
        # No **kwargs to DDPStrategy: it would hand them to DistributedDataParallel, which we never build.
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.algorithm = algorithm
        self.sync_every = sync_every
        self.overlap_steps = overlap_steps
        self.overlap_merge = overlap_merge
        self._overlap_group: Optional[Any] = None  # a process group of its own for background exchanges
        self.ranks_per_replica = ranks_per_replica
        self._replica_group: Optional[Any] = None  # with k > 1: this rank's replica (DDP runs on it)
        self._slice_group: Optional[Any] = None  # with k > 1: local rank j of every replica
        self.average_at_end = bool(average_at_end)
        self._outer_state_device = device
        self._replicas: list[OptimizerReplica] = []
        self._transport: Optional[TorchDistributedTransport] = None
        self._trained_module: Optional[weakref.ReferenceType] = None
        self._restore_sigterm: Optional[Callable[[], None]] = None
        self._restore_sigterm_handler: Optional[Callable[[], None]] = None
        self._final_outer_steps = 0
        self._lingering: list[threading.Thread] = []  # watchers of abandoned rounds still waiting
        self._resumed_outer: Optional[list[dict[str, Any]]] = None  # from a checkpoint, until training starts
        self.outer_step_reports: list[OuterStepReport] = []  # this fit's outer steps, in order
        self.rounds_started: list[tuple[int, int]] = []  # (optimizer index, t) as rounds start, in order
        self.track_norms = False  # set by OuterStepMonitor: costs one anchor copy per outer step

    # ------------------------------------------------------------------ configuration checks

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

    @property
    def outer_state_device(self) -> torch.device:
        return self._outer_state_device if self._outer_state_device is not None else self.root_device

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.ranks_per_replica

    @property
    def replica_index(self) -> int:
        return self.global_rank // self.ranks_per_replica

    @property
    def outer_steps(self) -> int:
        """Outer steps (rounds started) of the first optimizer, resumed ones included; after ``fit``,
        the count it ended with (0 before training)."""
        return self._replicas[0].outer_steps if self._replicas else self._final_outer_steps

    @property
    def last_outer_step(self) -> Optional[OuterStepReport]:
        return self.outer_step_reports[-1] if self.outer_step_reports else None

    @property
    def replicas(self) -> list[OptimizerReplica]:
        """This replica's outer state, one entry per optimizer (empty outside ``fit``)."""
        return self._replicas

    def _comm_device(self) -> torch.device:
        return self.root_device if self._get_process_group_backend() == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is built, once devices and nodes are known: check N before any
        # process starts.
        world, k = self.num_nodes * self.num_processes, self.ranks_per_replica
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
        if self._get_process_group_backend() != "nccl":
            destroy_process_group_at_exit()
        k = self.ranks_per_replica
        if k > 1:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            world, backend = dist.get_world_size(), self._get_process_group_backend()
            for i in range(world // k):
                group = dist.new_group(list(range(i * k, (i + 1) * k)), backend=backend, timeout=self._timeout)
                if i == self.replica_index:
                    self._replica_group = group
            for j in range(k):
                group = dist.new_group(list(range(j, world, k)), backend=backend, timeout=self._timeout)
                if j == self.global_rank % k:
                    self._slice_group = group

    @override
    def configure_ddp(self) -> None:
        """With one rank per replica, no ``DistributedDataParallel`` wrapper: each replica trains on its
        own. With k > 1, torch's ``DistributedDataParallel`` over the replica's process group averages
        gradients inside the replica at every step, and never across replicas."""
        if self.ranks_per_replica > 1:
            self._ddp_kwargs["process_group"] = self._replica_group
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
        # Every trainer call starts without resume state: only fit(ckpt_path=...) may set it, and it
        # does so after this (load_checkpoint runs after setup; see restore_checkpoint_after_setup).
        self._resumed_outer = None
        if self._restore_sigterm_handler is None:  # Trainer registers its handlers after setup
            self._restore_sigterm_handler = local_sigterm_handler(trainer)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._make_replicas_consistent(fitting)
        if fitting:
            self.configure_ddp()
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)

    def _make_replicas_consistent(self, fitting: bool) -> None:
        trained = self._trained_module is not None and self._trained_module() is self.lightning_module
        if not trained:
            # What DistributedDataParallel would do: every replica starts from rank 0's weights.
            sync_module_states(self.model)
        elif fitting:
            # A second fit of a model these replicas already trained: start it from their average.
            log.info("%s: starting this fit from the average of the replicas.", type(self).__name__)
            self.average_replicas()
        # validate/test/predict after fit: every replica keeps its own weights.

    def _check_optimizers(self) -> None:
        owner: dict[int, int] = {}
        for k, optimizer in enumerate(self.optimizers):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in owner and owner[id(p)] != k:
                        raise ValueError(
                            f"A parameter of shape {tuple(p.shape)} belongs to optimizers {owner[id(p)]} and {k}. "
                            "Each parameter must belong to one optimizer: every optimizer has its own outer "
                            "state. Give each optimizer a disjoint set of parameters."
                        )
                    owner[id(p)] = k

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self._trained_module = weakref.ref(self.lightning_module)
        self._transport = self._make_transport()
        self.algorithm.check_num_replicas(self._transport.num_replicas)
        self._replicas = [self._new_replica(optimizer) for optimizer in self.optimizers]
        self.outer_step_reports = []
        self.rounds_started = []
        if self._resumed_outer is not None:
            self._load_outer_state(self._resumed_outer)
            self._resumed_outer = None
        self._restore_sigterm = disable_per_batch_sigterm_broadcast(trainer.fit_loop.epoch_loop)
        self._warn_if_no_outer_step(trainer)

    def _warn_if_no_outer_step(self, trainer: "pl.Trainer") -> None:
        remaining = trainer.max_steps - trainer.global_step
        if trainer.max_steps >= 0 and all(r.inner_steps + remaining < self.sync_every * (r.outer_steps + 1)
                                          for r in self._replicas):
            rank_zero_warn(
                f"No outer step will happen in this fit: {max(remaining, 0)} optimizer step(s) are left before "
                f"max_steps={trainer.max_steps}, fewer than the next outer step needs (sync_every={self.sync_every}), "
                "so the replicas never meet. Lower sync_every or raise max_steps."
            )

    def _make_transport(self) -> TorchDistributedTransport:
        """The transport of the outer steps. With overlap, background exchanges get a process group
        of their own, so that collectives on the default group (logging, checkpoints, validation)
        never interleave with them."""
        if self.overlap_steps != 0 and self._overlap_group is None and dist.get_world_size() > 1:
            self._overlap_group = dist.new_group(backend=self._get_process_group_backend(), timeout=self._timeout)
        return TorchDistributedTransport(
            self._comm_device(), process_group=self._overlap_group, ranks_per_replica=self.ranks_per_replica,
            replica_group=self._replica_group, slice_group=self._slice_group,
        )

    def _new_replica(self, optimizer: Optimizer) -> OptimizerReplica:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        flat = FlatParameters(params, self.outer_state_device)
        state = self.algorithm.init_state(flat.gather(), flat.shapes)
        auto = AutoOverlap(auto_cap(self.sync_every, self.algorithm.name)) if self.overlap_steps == "auto" else None
        return OptimizerReplica(optimizer=optimizer, flat=flat, state=state, auto=auto)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        index, replica = self._replica_of(optimizer)
        replica.inner_steps += 1
        if replica.auto is not None and replica.last_step_end is not None:
            replica.auto.observe_step(time.perf_counter() - replica.last_step_end)
        if replica.in_flight is not None:
            replica.in_flight.poll()
            if replica.inner_steps >= replica.in_flight.land_step:
                self._land(index, replica)
        if replica.inner_steps % self.sync_every == 0:
            tau = self._overlap_for(replica)
            if tau == 0:
                self._outer_step(index, replica)
            else:
                self._start_round(index, replica, tau)
        if replica.auto is not None:
            replica.last_step_end = time.perf_counter()
        return output

    def _overlap_for(self, replica: OptimizerReplica) -> int:
        if replica.auto is None:
            return int(self.overlap_steps)
        tau = replica.auto.choose()
        if self.ranks_per_replica > 1:  # the ranks of a replica land together (they all-gather then)
            agreed = torch.tensor([float(tau)], device=self._comm_device())
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._replica_group)
            tau = int(agreed.item())
        if replica.auto.cannot_hide and not replica.auto.warned:
            replica.auto.warned = True
            warnings.warn(
                f"Replica {self.replica_index}: overlap_steps='auto' needs about {replica.auto.needed} inner steps "
                f"to hide the outer step's exchange but is capped at {replica.auto.cap} "
                f"({'H/2' if self.algorithm.name == 'noloco' else 'H/4'} with H={self.sync_every}); the rest of "
                "the exchange is waited for at each landing. A larger sync_every hides more.",
                stacklevel=2,
            )
        return tau

    def _replica_of(self, optimizer: Optimizer) -> tuple[int, OptimizerReplica]:
        for index, replica in enumerate(self._replicas):
            if replica.optimizer is optimizer:
                return index, replica
        raise RuntimeError(
            f"{type(self).__name__} has no outer state for this optimizer: optimizer steps must happen "
            "during trainer.fit, on an optimizer returned by configure_optimizers."
        )

    def _check_parameters(self, index: int, replica: OptimizerReplica) -> None:
        if sum(len(g["params"]) for g in replica.optimizer.param_groups) != len(replica.flat.params):
            raise RuntimeError(
                f"The parameters of optimizer {index} changed during training (e.g. add_param_group). "
                f"{type(self).__name__} keeps one outer state per optimizer over a fixed parameter list; "
                "give the optimizer all its parameters in configure_optimizers (frozen ones included)."
            )

    def _outer_step(self, index: int, replica: OptimizerReplica) -> None:
        """The synchronous outer step (τ = 0)."""
        start = time.perf_counter()
        self._check_parameters(index, replica)
        self.rounds_started.append((index, replica.outer_steps))
        assert self._transport is not None
        transport = self._transport
        stats = transport.stats
        sent, received, comm = stats.bytes_sent, stats.bytes_received, stats.seconds
        weights = replica.flat.gather()
        pseudo_gradient_norm = update_norm = None
        if self.track_norms:
            before = replica.state.anchor.clone()
            pseudo_gradient_norm = torch.linalg.vector_norm(weights - before).item()
        algorithm = self.algorithm
        round_ = algorithm.schedule(replica.outer_steps, transport.num_replicas)
        group = round_.group_of(transport.replica)
        payload = algorithm.payload(replica.state, weights)
        # an all-reduce sums in place: keep this replica's own payload for the distance
        own = payload.clone() if self.track_norms and round_.collective else payload
        total = transport.all_reduce_sum(payload) if round_.collective else transport.group_sum(payload, group)
        distance = peer_distance(own, total, len(group)) if self.track_norms else None
        replica.flat.scatter(algorithm.apply(replica.state, total, len(group)))
        if self.track_norms:
            update_norm = torch.linalg.vector_norm(replica.state.anchor - before).item()
        self.outer_step_reports.append(
            OuterStepReport(
                optimizer_index=index,
                outer_step=replica.outer_steps,
                inner_step=replica.inner_steps,
                peers=tuple(j for j in group if j != transport.replica),
                bytes_sent=stats.bytes_sent - sent,
                bytes_received=stats.bytes_received - received,
                comm_seconds=stats.seconds - comm,
                seconds=time.perf_counter() - start,
                pseudo_gradient_norm=pseudo_gradient_norm,
                update_norm=update_norm,
                peer_distance=distance,
            )
        )
        if replica.auto is not None:
            replica.auto.observe_exchange(stats.seconds - comm)
        replica.outer_steps += 1

    def _start_round(self, index: int, replica: OptimizerReplica, tau: int) -> None:
        """Posts round t's exchange and returns; the round lands ``tau`` optimizer steps later."""
        start = time.perf_counter()
        self._check_parameters(index, replica)
        assert self._transport is not None and replica.in_flight is None
        transport, algorithm, t = self._transport, self.algorithm, replica.outer_steps
        self.rounds_started.append((index, t))
        weights = replica.flat.gather()  # the snapshot S
        round_ = algorithm.schedule(t, transport.num_replicas)
        group = round_.group_of(transport.replica)
        pseudo_gradient_norm = before = None
        if self.track_norms:
            before = replica.state.anchor.clone()
            pseudo_gradient_norm = torch.linalg.vector_norm(weights - before).item()
        payload = algorithm.payload(replica.state, weights)
        if self.overlap_merge == "delayed" and round_.collective and payload.data_ptr() == weights.data_ptr():
            weights = weights.clone()  # an all-reduce sums in place: keep S apart from what travels
        own = None
        if self.track_norms:  # for the peer distance at the landing
            own = payload.clone() if round_.collective else payload
        if round_.collective:
            pending = transport.start_all_reduce_sum(payload)
        else:
            pending = transport.start_group_sum(payload, group)
        pending.watch()  # so that polls see when the transfer is done (see PendingSum)
        if self.overlap_merge == "predict_correct":
            reference = algorithm.local_proxy(replica.state, weights, len(group))  # φ̂, while the bytes travel
            replica.flat.scatter(reference)
        else:
            reference = weights
        replica.in_flight = InFlight(
            outer_step=t, start_step=replica.inner_steps, land_step=replica.inner_steps + tau, group=tuple(group),
            pending=pending, reference=reference, merge=self.overlap_merge,
            pseudo_gradient_norm=pseudo_gradient_norm, anchor_before=before, own_payload=own,
        )
        replica.outer_steps += 1
        replica.in_flight.start_seconds = time.perf_counter() - start

    def _land(self, index: int, replica: OptimizerReplica) -> None:
        """Completes the round in flight: waits for the exchange if it is still running, commits the
        outer state, and merges the result into the live weights."""
        flight, replica.in_flight = replica.in_flight, None
        assert flight is not None and self._transport is not None
        start = time.perf_counter()
        total = flight.pending.wait()
        distance = None
        if flight.own_payload is not None:
            distance = peer_distance(flight.own_payload, total, len(flight.group))
        exchange = flight.completed_after if flight.completed_after is not None else flight.pending.seconds
        new_anchor = self.algorithm.apply(replica.state, total, len(flight.group))
        merged, correction = merge_at_landing(flight.merge, replica.flat.gather(), new_anchor, flight.reference)
        replica.flat.scatter(merged)
        update_norm = None
        if flight.anchor_before is not None:
            update_norm = torch.linalg.vector_norm(replica.state.anchor - flight.anchor_before).item()
        if replica.auto is not None:
            replica.auto.observe_exchange(exchange)
        pending = flight.pending
        self.outer_step_reports.append(
            OuterStepReport(
                optimizer_index=index,
                outer_step=flight.outer_step,
                inner_step=replica.inner_steps,
                peers=tuple(j for j in flight.group if j != self._transport.replica),
                bytes_sent=pending.nbytes,
                bytes_received=pending.nbytes,
                comm_seconds=pending.wait_seconds,
                seconds=flight.start_seconds + time.perf_counter() - start,
                pseudo_gradient_norm=flight.pseudo_gradient_norm,
                update_norm=update_norm,
                overlap_steps=replica.inner_steps - flight.start_step,  # fewer if fit ended first
                exchange_seconds=exchange,
                correction_norm=correction_norm(correction),
                peer_distance=distance,
            )
        )

    def _land_all(self) -> None:
        for index, replica in enumerate(self._replicas):
            if replica.in_flight is not None:
                self._land(index, replica)

    abandon_timeout_s: float = 10.0  # how long an interrupted fit waits for a round in flight

    def _abandon_all(self) -> None:
        for replica in self._replicas:
            if replica.in_flight is not None:
                pending = replica.in_flight.pending
                finished = pending.abandon(timeout=self.abandon_timeout_s)
                if not finished:
                    warnings.warn(
                        f"Replica {self.replica_index}: training stopped while outer step "
                        f"{replica.in_flight.outer_step} was in flight and its exchange did not finish; "
                        "the round was dropped.",
                        stacklevel=2,
                    )
                if pending.watcher is not None and pending.watcher.is_alive():
                    self._lingering.append(pending.watcher)
                replica.in_flight = None

    def _mean_over_replicas(self, tensors: list[torch.Tensor]) -> tuple[FlatParameters, torch.Tensor]:
        """The replicas' average of ``tensors`` as one flat float32 vector (one all-reduce; every rank
        must call it)."""
        flat = FlatParameters(tensors, self._comm_device())
        total = flat.gather()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            total.div_(dist.get_world_size())
        return flat, total

    def average_replicas(self) -> None:
        """Sets every replica to the replicas' average: parameters and floating-point buffers, one
        all-reduce. Collective: every rank must call it."""
        tensors = self._module_tensors()
        if tensors:
            flat, mean = self._mean_over_replicas(tensors)
            flat.scatter(mean)

    def _module_tensors(self) -> list[torch.Tensor]:
        module = self.lightning_module
        return list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Swaps the replicas' average into the model, and this replica's own weights back afterwards
        (exactly, whatever the dtype). Collective: every rank must enter it."""
        own = FlatParameters(self._module_tensors(), self.outer_state_device)
        saved = own.gather()
        self.average_replicas()
        try:
            yield
        finally:
            own.scatter(saved)

    def replica_spread(self) -> float:
        """RMS distance of the replicas' parameters from their mean (two all-reduces; every rank must
        call it): the papers' weight-spread diagnostic."""
        flat, mean = self._mean_over_replicas(list(self.lightning_module.parameters()))
        squared = (flat.gather().to(mean.device) - mean).pow(2).sum().reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM)
        return (squared / self.world_size).sqrt().item()  # the k ranks of a replica hold the same weights

    def consensus_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with every floating-point tensor replaced by its average over replicas (new
        tensors; the model is not changed). Collective: every rank must call it."""
        keys = [k for k, v in state_dict.items() if torch.is_tensor(v) and v.is_floating_point()]
        if not keys:
            return dict(state_dict)
        flat, mean = self._mean_over_replicas([state_dict[k] for k in keys])
        out = dict(state_dict)
        for k, view in zip(keys, flat.views(mean)):
            out[k] = view.to(dtype=state_dict[k].dtype, device=state_dict[k].device).clone()
        return out

    # ------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Per-replica weights must land after setup's broadcast of rank 0's initial weights.
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Writes this replica's file on every rank, then the main file (consensus weights) on rank 0.
        Collective: Lightning calls it on every rank."""
        path = checkpoints.local_path(filepath)
        save_id = self.broadcast(uuid.uuid4().hex[:12])
        consensus = self.consensus_state_dict(checkpoint["state_dict"])
        sidecar = checkpoints.sidecar_name(path, save_id)
        sidecar_dir = os.path.join(os.path.dirname(os.path.abspath(path)), sidecar)
        if self.global_rank % self.ranks_per_replica == 0:  # one file per replica: its ranks hold the same state
            checkpoints.write_replica(sidecar_dir, self.replica_index, self._replica_payload(checkpoint, save_id))
        else:
            self._replica_payload(checkpoint, save_id)  # still completes a round in flight, as its replica does
        self.barrier("lightning_loco.save_checkpoint")  # every replica file exists before the main file
        if self.is_global_zero:
            meta = {
                "format": checkpoints.FORMAT_VERSION,
                "algorithm": self.algorithm.name,
                "num_replicas": self.num_replicas,
                "save_id": save_id,
                "replicas": sidecar,
            }
            main = {**checkpoint, "state_dict": consensus, checkpoints.META_KEY: meta}
            self.checkpoint_io.save_checkpoint(main, path, storage_options=storage_options)
            checkpoints.remove_sidecars(path, keep=sidecar_dir)

    def _replica_payload(self, checkpoint: dict[str, Any], save_id: str) -> dict[str, Any]:
        return {
            "format": checkpoints.FORMAT_VERSION,
            "save_id": save_id,
            "replica": self.replica_index,
            "num_replicas": self.num_replicas,
            "algorithm": self.algorithm.name,
            "state_dict": checkpoint["state_dict"],
            "optimizer_states": checkpoint.get("optimizer_states"),
            "lr_schedulers": checkpoint.get("lr_schedulers"),
            "outer": [
                {"numel": r.flat.numel, "inner_steps": r.inner_steps, "outer_steps": r.outer_steps,
                 # a round in flight is saved with its received sum (awaited, not landed): exact resume
                 "in_flight": r.in_flight.state_dict() if r.in_flight is not None else None,
                 "state": r.state.state_dict()}
                for r in self._replicas
            ],
        }

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            checkpoints.remove_sidecars(checkpoints.local_path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Loads the main file and, on every rank, that replica's own file. Collective.

        Only ``fit(ckpt_path=...)`` restores outer state (anchors, momenta, counters, a round in
        flight); ``validate``/``test``/``predict`` with a checkpoint load each replica's weights only.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resumed_outer = None
        meta = checkpoint.get(checkpoints.META_KEY)
        if meta is None:
            return checkpoint  # a plain checkpoint (DDP, one device): every replica starts from it
        path = checkpoints.local_path(checkpoint_path)
        if meta["num_replicas"] != self.num_replicas:
            rank_zero_warn(
                f"Checkpoint {path} holds {meta['num_replicas']} replicas but this run has {self.num_replicas}: "
                "every replica starts from the consensus model (the replicas' average) with fresh outer state."
            )
            return checkpoint
        if meta["algorithm"] != self.algorithm.name:
            raise checkpoints.CheckpointError(
                f"Checkpoint {path} was written by {meta['algorithm']!r}; its outer state does not fit "
                f"{self.algorithm.name!r}. Resume it with the {meta['algorithm']!r} strategy, or start a new "
                f"{self.algorithm.name!r} run from its consensus model: "
                f"`MyModule.load_from_checkpoint({path!r})`, then fit without ckpt_path."
            )
        payload: Optional[dict[str, Any]] = None
        error: Optional[checkpoints.CheckpointError] = None
        try:
            checkpoints.check_replica_files(path, meta)  # every rank checks every file
            payload = checkpoints.read_replica(path, meta, self.replica_index)
        except checkpoints.CheckpointError as err:
            error = err
        # Ranks can disagree (a shared filesystem that lags on one node): agree before anything else
        # collective happens, and raise the same error everywhere.
        message = self._first_error(str(error) if error is not None else None)
        if message is not None:
            raise checkpoints.CheckpointError(message) from error
        assert payload is not None
        checkpoint["state_dict"] = payload["state_dict"]
        for key in ("optimizer_states", "lr_schedulers"):
            if payload.get(key) is not None:
                checkpoint[key] = payload[key]
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._resumed_outer = payload["outer"]
        else:
            self._trained_module = None  # the weights are the checkpoint's now: a later fit starts from rank 0's
        return checkpoint

    def _first_error(self, message: Optional[str]) -> Optional[str]:
        """The lowest rank's error message, if any rank has one (one all-gather; every rank calls it)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return message
        messages: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        return next((m for m in messages if m is not None), None)

    def _load_outer_state(self, saved: list[dict[str, Any]]) -> None:
        if not saved:
            return  # saved before training started: fresh outer state
        if len(saved) != len(self._replicas) or any(s["numel"] != r.flat.numel for s, r in zip(saved, self._replicas)):
            raise checkpoints.CheckpointError(
                f"The checkpoint's outer state covers {[s['numel'] for s in saved]} parameters per optimizer, "
                f"this model's optimizers {[r.flat.numel for r in self._replicas]}: the model or its "
                "optimizers changed. Start a new run from the checkpoint's consensus model instead."
            )
        for replica, entry in zip(self._replicas, saved):
            replica.state.load_state_dict(entry["state"])
            replica.inner_steps, replica.outer_steps = entry["inner_steps"], entry["outer_steps"]
            flight = entry.get("in_flight")
            if flight is not None:
                assert self._transport is not None
                device = replica.state.anchor.device
                group = tuple(flight["group"])
                peers = tuple(j for j in group if j != self._transport.replica)
                replica.in_flight = InFlight(
                    outer_step=flight["outer_step"], start_step=flight["start_step"], land_step=flight["land_step"],
                    group=group, pending=PendingSum.resolved(self._transport, flight["sum"].to(device), peers),
                    reference=flight["reference"].to(device), merge=flight["merge"],
                )

    def _restore_lightning(self) -> None:
        if self._restore_sigterm is not None:
            self._restore_sigterm()
            self._restore_sigterm = None

    @override
    def on_train_end(self) -> None:
        self._restore_lightning()
        self._land_all()  # a round still in flight lands now, early
        if self.average_at_end:
            self.average_replicas()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._restore_lightning()
        if self._restore_sigterm_handler is not None:
            self._restore_sigterm_handler()
            self._restore_sigterm_handler = None
        self._abandon_all()  # only left after an interrupted fit: on_train_end lands rounds in flight
        # The outer state (float32 anchors, momenta, outer optimizer state, buffers in flight: 2-3 model
        # copies, on the accelerator by default) goes now. What users read after fit stays:
        # outer_step_reports, and the weights in the module.
        if self._replicas:
            self._final_outer_steps = self._replicas[0].outer_steps
        self._replicas = []
        self._transport = None
        self._resumed_outer = None
        self._destroy_process_groups()
        super().teardown()

    def _destroy_process_groups(self) -> None:
        """Destroys the groups this strategy created. A group still awaited by the watcher of an
        abandoned round is never destroyed under it: it is left to the process exit."""
        self._lingering = [thread for thread in self._lingering if thread.is_alive()]
        for name in ("_overlap_group", "_replica_group", "_slice_group"):
            group = getattr(self, name)
            setattr(self, name, None)
            if group is None:
                continue
            if name == "_overlap_group" and self._lingering:
                log.warning(
                    "rank %s: an abandoned outer-step exchange is still waiting on its process group; the group is "
                    "left to the process exit instead of being destroyed under it.", self.global_rank,
                )
                continue
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                pass  # the default group is already gone, and this one with it
