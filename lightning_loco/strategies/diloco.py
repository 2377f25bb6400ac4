"""``DiLoCoStrategy``: the baseline; every H inner steps one all-reduce of the pseudo-gradients."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

import lightning.pytorch as pl
from lightning_loco.algorithms.diloco import DiLoCo, OuterOptimizerFactory
from lightning_loco.algorithms.outer_optimizer import check_picklable
from lightning_loco.strategies.base import OuterStepStrategy


class DiLoCoStrategy(OuterStepStrategy):
    """DiLoCo (Douillard et al., arXiv 2311.08105): the all-reduce baseline.

    Every ``sync_every`` inner optimizer steps the replicas all-reduce their pseudo-gradients
    Δ = θ − φ, the outer optimizer steps the shared anchor φ with gradient −mean Δ, and every replica
    restarts from φ.

    Args:
        sync_every: H, inner optimizer steps between outer steps (paper: 500).
        outer_lr: learning rate of the default outer SGD (paper: 0.7).
        outer_momentum: momentum of the default outer SGD (paper: 0.9).
        nesterov: Nesterov momentum for the default outer SGD (paper: True).
        outer_optimizer: builds any torch optimizer over the outer parameters (the anchor), e.g.
            ``functools.partial(torch.optim.Adam, lr=1e-3)``; replaces the SGD above when given.
            In a LightningCLI config: ``outer_optimizer: {class_path: torch.optim.Adam, init_args: {lr: 0.001}}``
            (the parameters are left out). With ``start_method`` "spawn" or "forkserver" it must pickle:
            a module-level function or a ``functools.partial``, not a lambda or a local function.
        overlap_steps: τ, inner steps during which the outer step's exchange runs in the background
            before it lands (0 < τ < H); 0 (default) is the synchronous outer step of the paper.
            "auto" measures the exchange and the inner steps and picks the smallest τ that hides the
            exchange, at most H/4; runs with "auto" are not bitwise reproducible.
        overlap_merge: how a landing round meets the τ steps taken meanwhile: "predict_correct"
            (default: start the τ steps from the local prediction of the outer step, add the
            correction at the landing) or "delayed" (apply the outer step's change at the landing).
        ranks_per_replica: k, consecutive global ranks that form one replica (default 1: every
            process is a replica). Inside a replica torch's ``DistributedDataParallel`` averages
            gradients at every step over the replica's own process group; between replicas only the
            outer step travels, each rank moving 1/k of the model. Use the devices per node for one
            replica per node. The world size must be a multiple of k.
        average_at_end: at the end of ``fit``, set every replica to the replicas' average (one
            all-reduce), so the model in memory is the consensus model. The papers define no final
            model; this is our choice. False keeps each replica's own weights.
        outer_state_device: where the float32 anchor and outer optimizer state live. None: the model's
            device; "cpu" keeps them off the accelerator.
        accelerator: as in ``DDPStrategy``.
        parallel_devices: as in ``DDPStrategy``.
        cluster_environment: as in ``DDPStrategy``.
        checkpoint_io: as in ``DDPStrategy``.
        precision_plugin: as in ``DDPStrategy``.
        process_group_backend: as in ``DDPStrategy`` ("gloo" on CPU, "nccl" on CUDA by default).
        timeout: as in ``DDPStrategy``: how long a peer is awaited before the run fails.
        start_method: as in ``DDPStrategy``: "popen" (default, also torchrun/SLURM), "spawn", "fork".
    """

    strategy_name = "diloco"

    def __init__(
        self,
        sync_every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        overlap_steps: Union[int, Literal["auto"]] = 0,
        overlap_merge: Literal["predict_correct", "delayed"] = "predict_correct",
        ranks_per_replica: int = 1,
        average_at_end: bool = True,
        outer_state_device: Optional[str] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        algorithm = DiLoCo(
            outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov, outer_optimizer=outer_optimizer
        )
        check_picklable(outer_optimizer, start_method)
        super().__init__(
            algorithm, sync_every, average_at_end, outer_state_device, accelerator, parallel_devices,
            cluster_environment, checkpoint_io, precision_plugin, process_group_backend, timeout, start_method,
            overlap_steps=overlap_steps, overlap_merge=overlap_merge, ranks_per_replica=ranks_per_replica,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DiLoCo: H local steps, then an all-reduce of pseudo-gradients and an outer optimizer step",
            override=True,
        )
