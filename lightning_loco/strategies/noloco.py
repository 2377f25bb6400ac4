"""``NoLoCoStrategy``: after every H inner steps each replica partially averages with one random peer."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

import lightning.pytorch as pl
from lightning_loco.algorithms.noloco import NoLoCo, stability_interval
from lightning_loco.strategies.base import OuterStepStrategy


class NoLoCoStrategy(OuterStepStrategy):
    """NoLoCo (Kolehmainen et al., arXiv 2506.10911): no collective at all while training.

    Every ``sync_every`` inner optimizer steps the replicas split into random groups of
    ``group_size`` (drawn from ``seed`` and the outer-step index, identical on every rank with no
    message) and each replica updates its own anchor φ and momentum δ::

        δ ← α·δ + β·(mean θ_G − mean φ_G) − γ·(φ − mean φ_G);   φ ← φ + δ;   θ ← φ

    With γ = β (the default) only live weights travel: one model copy each way per outer step.

    Args:
        sync_every: H, inner optimizer steps between outer steps (paper: 50).
        outer_lr: β, the outer learning rate (paper: 0.7).
        outer_momentum: α, the outer momentum (paper: 0.5).
        averaging_rate: γ, the pull towards the group's mean anchor. None means γ = β, as in the
            reference code (the paper does not state γ). Stable for pairs when α < γ < √(2 + α²).
        group_size: n, replicas per group (paper: 2). If N is not a multiple of n the last group takes
            the remainder.
        seed: seeds the random groups (with the outer-step index); independent of the global RNG.
        overlap_steps: τ, inner steps during which the outer step's exchange runs in the background
            before it lands (0 < τ < H); 0 (default) is the synchronous outer step of the paper.
            "auto" measures the exchange and the inner steps and picks the smallest τ that hides the
            exchange, at most H/2; runs with "auto" are not bitwise reproducible.
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
        outer_state_device: where the float32 anchor and momentum live. None: the model's device;
            "cpu" keeps them off the accelerator.
        accelerator: as in ``DDPStrategy``.
        parallel_devices: as in ``DDPStrategy``.
        cluster_environment: as in ``DDPStrategy``.
        checkpoint_io: as in ``DDPStrategy``.
        precision_plugin: as in ``DDPStrategy``.
        process_group_backend: as in ``DDPStrategy`` ("gloo" on CPU, "nccl" on CUDA by default).
        timeout: as in ``DDPStrategy``: how long a peer is awaited before the run fails.
        start_method: as in ``DDPStrategy``: "popen" (default, also torchrun/SLURM), "spawn", "fork".
    """

    strategy_name = "noloco"

    def __init__(
        self,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.5,
        averaging_rate: Optional[float] = None,
        group_size: int = 2,
        seed: int = 0,
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
        algorithm = NoLoCo(
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            averaging_rate=averaging_rate,
            group_size=group_size,
            seed=seed,
        )
        low, high = stability_interval(algorithm.outer_momentum)
        if not low < algorithm.averaging_rate < high:
            rank_zero_warn(
                f"NoLoCo's averaging_rate γ={algorithm.averaging_rate} is outside the stability interval "
                f"α < γ < √(2 + α²) = ({low:.3g}, {high:.3g}) for outer_momentum α={algorithm.outer_momentum}; "
                "replicas may drift apart. Use averaging_rate=None (γ = outer_lr) or a value inside it."
            )
        super().__init__(
            algorithm, sync_every, average_at_end, outer_state_device, accelerator, parallel_devices,
            cluster_environment, checkpoint_io, precision_plugin, process_group_backend, timeout, start_method,
            overlap_steps=overlap_steps, overlap_merge=overlap_merge, ranks_per_replica=ranks_per_replica,
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        n, size = self.algorithm.group_size, self.num_replicas
        if 1 < size < n:
            rank_zero_warn(
                f"group_size={n} exceeds the {size} replicas: all replicas form one group, exchanging "
                f"{size - 1} model copies each per outer step. An all-reduce (DiLoCoStrategy) is cheaper."
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="NoLoCo: H local steps, then partial averaging with one random peer (no collective)",
            override=True,
        )
