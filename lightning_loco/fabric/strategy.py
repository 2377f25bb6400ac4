"""The outer-step strategies for Lightning Fabric: a Fabric loop's ``optimizer.step()`` is the inner step.

:class:`FabricOuterStepStrategy` is Fabric's ``DDPStrategy`` without the wrapper between replicas (with
``ranks_per_replica`` = k > 1, torch's ``DistributedDataParallel`` over the replica's own k ranks), an adapter of
Fabric's hooks to the same :class:`~lightning_loco.replica.replica.Replica` as the Trainer's strategies: the same
options, rules, layout, driver, algorithm, transport and checkpoint files, so that a Fabric loop and a
``Trainer.fit`` of the same module and batches take the same rounds, bit for bit (``tests/test_fabric.py``).

What the Fabric loop owns, the strategy is told or asked:

* the run's length: ``max_steps`` (the loop's optimizer steps): the last one ends training as the Trainer's
  ``max_steps`` does (a round that lands then lands on the average, and the replicas are averaged at the end
  unless ``average_at_end=False``). Without it, call :meth:`FabricOuterStepStrategy.finish` after the loop;
* checkpoints: ``fabric.save(path, state)`` writes every replica's own file (its model and optimizer states as
  given, and its outer state) and a main file whose modules are the replicas' average; ``fabric.load(path,
  state)`` restores each replica's own, the outer state included, exactly;
* the consensus model: :meth:`FabricOuterStepStrategy.consensus_state_dict`.

FSDP2 inside a replica (``replica_sharding="fsdp"`` with ``ranks_per_replica`` = k > 1) is the Trainer's layout
(:class:`~lightning_loco.replica.layout.ShardedReplicas`): ``fabric.setup_module(model)`` shards the model over
the replica's k ranks (the automatic policy, unless the model was already sharded with ``fully_shard(...,
mesh=fabric.strategy.device_mesh["data_parallel"])``), and the optimizer is created afterwards over the sharded
parameters and given to ``fabric.setup_optimizers``, as with Fabric's own ``ModelParallelStrategy``. Each rank
steps, exchanges and saves its own shards; ``fabric.save``'s main file holds the full consensus model and no
inner optimizer state (its shards are in the replica files).

Not under Fabric (the rules ``fabric-*`` of :mod:`lightning_loco.rules` refuse them when the strategy is
built): ``pacing`` and ``elastic`` replicas, which need the Trainer's loop to end a run on a round and to take a
healed replica's step counts.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_loco import _compat
from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.driver.reports import OuterStepReport
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.fabric.checkpointing import ReplicaCheckpoints
from lightning_loco.replica.options import FSDPConfig, PacingConfig, WireConfig, WireFormatName, check_int
from lightning_loco.replica.replica import Replica
from lightning_loco.replica.short_runs import warn_if_short
from lightning_loco.replica.views import AdapterViews
from lightning_loco.rules import Facts, Fit, Launch, build_options, check_rules
from lightning_loco.rules.table import shared_parameter

_compat.check_lightning()  # a Lightning without the private symbols we use fails here, naming them


class FabricOuterStepStrategy(AdapterViews, ReplicaCheckpoints):
    """Replicas that train apart and meet every ``sync_every`` optimizer steps, in a Fabric loop. Each
    algorithm's strategy passes its ``algorithm`` and ``sync_every``; the other arguments are the Trainer
    strategies' (docs/options.md), and:

    Args:
        max_steps: the loop's number of optimizer steps (per optimizer), when known: its last step ends
            training (see the module docstring). None: call :meth:`finish` after the loop.
        precision, and accelerator, parallel_devices, cluster_environment, checkpoint_io,
            process_group_backend, timeout, start_method: as in Fabric's ``DDPStrategy``.
    """

    strategy_name = ""  # the name for Fabric(strategy=...), set by each algorithm's strategy
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
        max_steps: Optional[int] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
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
        check_rules("build", Facts(self.options, loop="fabric"))
        if max_steps is not None:
            check_int("max_steps", max_steps, "It is the loop's number of optimizer steps (None: call finish()).")
        self.max_steps = max_steps
        # No **kwargs to DDPStrategy: it would hand them to DistributedDataParallel, which only wraps inside a replica.
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )
        _compat.set_backward_sync_control(self, _no_backward_sync)
        self.replica = Replica(self.options, self, loop="fabric")
        self.finished = False  # finish() ran: training ended
        self._module: Optional[weakref.ReferenceType] = None
        self._optimizers: list[Optimizer] = []
        self.outer_step_reports: list[OuterStepReport] = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name:
            strategy_registry.register(cls.strategy_name, cls, description=cls.description, override=True)

    # ------------------------------------------------------------------ what users and the replica read
    # (beyond what the Trainer's strategies show alike: lightning_loco.replica.views)

    @property
    def replica_module(self) -> Optional[nn.Module]:
        """The module given to ``fabric.setup`` (unwrapped): the replica's model."""
        return self._module() if self._module is not None else None

    @property
    def outer_steps(self) -> int:
        """Rounds started by the first optimizer (resumed ones included; 0 before training)."""
        return self.run.outer_steps() if self.run is not None else 0

    @override
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank of the world its own part of the data (``fabric.setup_dataloaders``), as the Trainer's."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def device_mesh(self) -> Any:
        """With ``replica_sharding``, the replica's ("data_parallel", "tensor_parallel") mesh of shape (k, 1), once
        the processes started (``fabric.launch()``): a model sharded by hand before ``fabric.setup_module`` uses
        ``device_mesh["data_parallel"]``."""
        return self.layout.device_mesh

    def comm_device(self) -> torch.device:
        """Where buffers cross the network: the accelerator with NCCL, else the CPU."""
        return self.root_device if self._get_process_group_backend() == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ launch and set-up

    @override
    def _configure_launcher(self) -> None:
        self.replica.check_launch(Launch(self.num_nodes, self.num_processes))
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.replica.setup_distributed(self._get_process_group_backend(), self._timeout)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # DDP inside a replica only
        """Every replica starts from global rank 0's weights (parameters and buffers, one broadcast); no wrapper
        between replicas, torch's ``DistributedDataParallel`` over the replica's own ranks with k > 1, or with
        ``replica_sharding`` FSDP2's ``fully_shard`` over them (the module is sharded in place)."""
        if self._module is not None and self._module() is not None:
            raise RuntimeError(
                f"{type(self).__name__} trains one model, the first given to fabric.setup; its outer step and "
                "consensus would not know a second. Use another model (a frozen teacher, say) without "
                "fabric.setup: move it yourself with model.to(fabric.device)."
            )
        self._module = weakref.ref(module)
        self.layout.prepare_model()  # sharded: every rank takes global rank 0's weights, then FSDP2 shards them
        self.layout.sync_initial_weights()
        if self.ranks_per_replica == 1 or self.layout.sharded:
            return module
        assert self.replica.groups is not None
        device_ids = None if self.root_device.type == "cpu" else [self.root_device.index]
        return DistributedDataParallel(module, device_ids=device_ids, process_group=self.replica.groups.replica)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Each optimizer given to ``fabric.setup`` gets its own outer state when training starts (in that order).
        With ``replica_sharding`` it must hold the sharded model's parameters (created after
        ``fabric.setup_module``)."""
        if self.run is not None:
            raise RuntimeError(
                f"{type(self).__name__}: an optimizer was set up after training started; set up every optimizer "
                "(fabric.setup(model, *optimizers)) before the first optimizer.step()."
            )
        if self.layout.sharded:
            loose = sum(not isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
            if self.replica_module is None or loose:
                raise RuntimeError(
                    f"{type(self).__name__} with replica_sharding: the optimizer holds {loose} parameter(s) that are "
                    "not the sharded model's. Set up the model first, then create the optimizer over its sharded "
                    "parameters: model = fabric.setup_module(model); optimizer = fabric.setup_optimizers("
                    "torch.optim.AdamW(model.parameters()))."
                )
        self._optimizers.append(optimizer)
        return optimizer

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        if self.layout.sharded and optimizers:  # refused before the module changes: nothing is lost
            raise RuntimeError(
                f"{type(self).__name__} with replica_sharding shards the model's parameters in place, so an optimizer "
                "created before would step the unsharded ones. Set up the model first, then create the optimizer: "
                "model = fabric.setup_module(model); optimizer = fabric.setup_optimizers("
                "torch.optim.AdamW(model.parameters()))."
            )
        return self.setup_module(module), [self.setup_optimizer(o) for o in optimizers], scheduler

    # ------------------------------------------------------------------ training

    def _start(self) -> None:
        """At the first optimizer step, before it: the outer state starts at the weights every replica shares."""
        if self.replica_module is None or not self._optimizers:
            raise RuntimeError(f"{type(self).__name__}: set up the model and its optimizers with fabric.setup(model, "
                               "optimizer) before stepping.")
        self.replica.check_fit(_fit(self._optimizers, self.max_steps, self.root_device))  # disjoint-optimizers too
        run = self.replica.start(self._optimizers, None, self.max_steps if self.max_steps is not None else -1)
        self.outer_step_reports = run.driver.reports
        if self.max_steps is not None and self.is_global_zero:
            warn_if_short(self.algorithm, self.max_steps, self.sync_every, rank_zero_warn)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The inner step (Fabric's precision plugin steps the optimizer), then the replica's turn: rounds start
        and land when due, and the last of ``max_steps`` ends training."""
        if self.finished:
            raise RuntimeError(f"{type(self).__name__}: training ended (finish() ran, or max_steps={self.max_steps} "
                               "was reached); a new run needs a new Fabric.")
        if self.run is None:
            self._start()
        run = self.run
        assert run is not None
        output = super().optimizer_step(optimizer, **kwargs)
        index = next((i for i, o in enumerate(self._optimizers) if o is optimizer), None)
        if index is None:
            raise RuntimeError(f"{type(self).__name__} has no outer state for this optimizer: step the optimizers "
                               "returned by fabric.setup.")
        max_steps = self.max_steps if self.max_steps is not None else -1
        run.after_step(index, optimizer, max_steps, who=type(self).__name__)  # the loop ends at max_steps
        if run.reached(max_steps):
            self.finish()
        return output

    def finish(self) -> None:
        """Training ended: a round still in flight lands now (as the final round), and with ``average_at_end``
        (None: yes) every replica takes the replicas' average. Collective: every rank calls it, once the loop ends
        (the last of ``max_steps`` calls it by itself). Checkpoints can still be saved afterwards."""
        if self.finished:
            return
        self.finished = True
        if self.run is None and self.replica.loaded is not None:  # fabric.load of a finished run, then no step
            self.replica.end_without_steps()
            return
        self.replica.end()
        self.replica.average_at_end()

    @override
    def teardown(self) -> None:
        self.replica.close()
        super().teardown()

    # ------------------------------------------------------------------ the consensus (global collectives)

    def average_replicas(self) -> None:
        """Sets every replica to the replicas' average: parameters and floating-point buffers, one all-reduce.
        Collective: every rank must call it."""
        self.replica.average()

    def consensus_state_dict(self) -> Optional[dict[str, Any]]:
        """The replicas' average as a plain state dict of full tensors (floating-point entries averaged, others this
        replica's), for ``torch.save`` or another model's ``load_state_dict``. Collective: every rank must call it;
        with ``replica_sharding`` global rank 0 gets the dict and the others None, else every rank gets it."""
        module = self.replica_module
        assert module is not None, "set up the model with fabric.setup first"
        return self.replica.consensus_state_dict(module.state_dict())


def _no_backward_sync(module: nn.Module, enabled: bool) -> AbstractContextManager:
    """``fabric.no_backward_sync(model)`` (gradient accumulation): DDP's ``no_sync`` inside a replica of several
    ranks, FSDP2's reduce-scatters held back in a sharded one (Fabric's own control for FSDP2); with one rank per
    replica no gradient is synchronised anyway, so there is nothing to hold back."""
    from torch.distributed.fsdp import FSDPModule

    if enabled and isinstance(module, DistributedDataParallel):
        return module.no_sync()
    if enabled and any(isinstance(m, FSDPModule) for m in module.modules()):
        return _compat.fsdp_no_sync(module, enabled)
    return nullcontext()


def _fit(optimizers: list[Optimizer], max_steps: Optional[int], device: torch.device) -> Fit:
    """What the ``fit`` rules look at, as a Fabric loop tells it."""
    params = [[p for g in o.param_groups for p in g["params"]] for o in optimizers]
    return Fit(parameters=tuple(len(p) for p in params), max_steps=max_steps if max_steps is not None else -1,
               model_device=device.type, shared_parameter=shared_parameter(params))
