"""Lightning glue shared by every low-communication strategy.

``OuterStepStrategy`` is a ``DDPStrategy`` that does not wrap the model: launching (popen, spawn,
torchrun, SLURM), the process group, the ``DistributedSampler`` and ``reduce``/``barrier``/
``broadcast`` are Lightning's. What it adds:

* replicas start from rank 0's weights, then train independently (no gradient all-reduce);
* after every ``sync_every``-th real optimizer step (``optimizer_step`` fires once per update, after
  gradient accumulation, clipping and the precision plugin, and once per optimizer in manual
  optimization) it runs the algorithm's outer step on that optimizer's parameters;
* no global collective while training: Lightning's per-batch SIGTERM broadcast is replaced by a
  local check for the duration of ``fit`` (see ``_compat.py``).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.flat import FlatParameters
from lightning_loco.strategies._compat import destroy_process_group_at_exit, disable_per_batch_sigterm_broadcast
from lightning_loco.transport import TorchDistributedTransport


@dataclass
class OptimizerReplica:
    """This replica's outer state for one inner optimizer, and its step counters."""

    optimizer: Optimizer
    flat: FlatParameters
    state: OuterState
    inner_steps: int = 0  # optimizer_step calls (counted even if an fp16 scaler skips the step)
    outer_steps: int = 0


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
        outer_state_device: where the float32 outer state lives; ``None`` means the model's device.
        The remaining arguments are ``DDPStrategy``'s, with the same meaning.
    """

    def __init__(
        self,
        algorithm: OuterAlgorithm,
        sync_every: int,
        outer_state_device: Optional[Union[str, torch.device]] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1, got {sync_every!r}.")
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
        self._outer_state_device = device
        self._replicas: list[OptimizerReplica] = []
        self._transport: Optional[TorchDistributedTransport] = None
        self._trained_module: Optional[weakref.ReferenceType] = None
        self._restore_sigterm: Optional[Callable[[], None]] = None
        self.last_outer_step: Optional[OuterStepReport] = None

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
        return self.world_size

    @property
    def replica_index(self) -> int:
        return self.global_rank

    @property
    def outer_steps(self) -> int:
        """Outer steps taken by the first optimizer in this ``fit`` (0 before training)."""
        return self._replicas[0].outer_steps if self._replicas else 0

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
        self.algorithm.check_num_replicas(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        if self._get_process_group_backend() != "nccl":
            destroy_process_group_at_exit()

    @override
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel`` wrapper: each replica trains on its own."""

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        device = self.outer_state_device
        if device.type != "cpu" and device.type != self.root_device.type:
            raise ValueError(
                f"outer_state_device={str(device)!r} does not match the model's device "
                f"{str(self.root_device)!r}. Use None or 'cpu'."
            )
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._make_replicas_consistent(fitting)
        if fitting:
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _make_replicas_consistent(self, fitting: bool) -> None:
        trained = self._trained_module is not None and self._trained_module() is self.lightning_module
        if not trained:
            # What DistributedDataParallel would do: every replica starts from rank 0's weights.
            _sync_module_states(self.model)
        elif fitting:
            # A second fit of a model these replicas already trained: start it from their average.
            rank_zero_info(f"{type(self).__name__}: starting this fit from the average of the replicas.")
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
        self._transport = TorchDistributedTransport(self._comm_device())
        self.algorithm.check_num_replicas(self._transport.num_replicas)
        self._replicas = [self._new_replica(optimizer) for optimizer in self.optimizers]
        self._restore_sigterm = disable_per_batch_sigterm_broadcast(trainer.fit_loop.epoch_loop)

    def _new_replica(self, optimizer: Optimizer) -> OptimizerReplica:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        flat = FlatParameters(params, self.outer_state_device)
        state = self.algorithm.init_state(flat.gather(), flat.shapes)
        return OptimizerReplica(optimizer=optimizer, flat=flat, state=state)

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
        if replica.inner_steps % self.sync_every == 0:
            self._outer_step(index, replica)
        return output

    def _replica_of(self, optimizer: Optimizer) -> tuple[int, OptimizerReplica]:
        for index, replica in enumerate(self._replicas):
            if replica.optimizer is optimizer:
                return index, replica
        raise RuntimeError(
            f"{type(self).__name__} has no outer state for this optimizer: optimizer steps must happen "
            "during trainer.fit, on an optimizer returned by configure_optimizers."
        )

    def _outer_step(self, index: int, replica: OptimizerReplica) -> None:
        start = time.perf_counter()
        if sum(len(g["params"]) for g in replica.optimizer.param_groups) != len(replica.flat.params):
            raise RuntimeError(
                f"The parameters of optimizer {index} changed during training (e.g. add_param_group). "
                f"{type(self).__name__} keeps one outer state per optimizer over a fixed parameter list; "
                "give the optimizer all its parameters in configure_optimizers (frozen ones included)."
            )
        assert self._transport is not None
        transport = self._transport
        stats = transport.stats
        sent, received, comm = stats.bytes_sent, stats.bytes_received, stats.seconds
        new_weights, group = self.algorithm.step(replica.state, replica.flat.gather(), replica.outer_steps, transport)
        replica.flat.scatter(new_weights)
        self.last_outer_step = OuterStepReport(
            optimizer_index=index,
            outer_step=replica.outer_steps,
            inner_step=replica.inner_steps,
            peers=tuple(j for j in group if j != transport.replica),
            bytes_sent=stats.bytes_sent - sent,
            bytes_received=stats.bytes_received - received,
            comm_seconds=stats.seconds - comm,
            seconds=time.perf_counter() - start,
        )
        replica.outer_steps += 1

    def average_replicas(self) -> None:
        """Sets every replica to the average of all replicas (one all-reduce over parameters and
        floating-point buffers). Collective: every rank must call it."""
        module = self.lightning_module
        tensors = [p for p in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]
        if not tensors or not dist.is_available() or not dist.is_initialized():
            return
        flat = FlatParameters(tensors, self._comm_device())
        total = flat.gather()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        flat.scatter(total.div_(dist.get_world_size()))

    def _restore_lightning(self) -> None:
        if self._restore_sigterm is not None:
            self._restore_sigterm()
            self._restore_sigterm = None

    @override
    def on_train_end(self) -> None:
        self._restore_lightning()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._restore_lightning()
        self._transport = None
        super().teardown()
