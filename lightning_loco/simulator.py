"""N replicas of an outer-step algorithm in one process, for studying schedules and for tests.

It runs the very code the strategies run (``schedule``, ``payload``, ``apply`` and the same
group-order summation as the transport); only the network is replaced by a loop over groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.schedules import Round
from lightning_loco.transport.base import sum_in_group_order


class ReplicaSimulator:
    """Simulated replicas sharing one algorithm.

    Args:
        algorithm: the outer-step maths.
        weights: the replicas' initial flat float32 weights (usually N copies of one vector).
        shapes: parameter shapes covering the flat vector (default: one flat parameter).
    """

    def __init__(
        self,
        algorithm: OuterAlgorithm,
        weights: Sequence[Tensor],
        shapes: Sequence[torch.Size] | None = None,
    ) -> None:
        if not weights:
            raise ValueError("need at least one replica")
        self.algorithm = algorithm
        self.shapes = list(shapes) if shapes is not None else [weights[0].shape]
        self.states: list[OuterState] = [algorithm.init_state(w.clone(), self.shapes) for w in weights]
        self.outer_step = 0
        self.last_round: Round | None = None

    @property
    def num_replicas(self) -> int:
        return len(self.states)

    @property
    def anchors(self) -> list[Tensor]:
        return [state.anchor for state in self.states]

    def step(self, weights: Sequence[Tensor]) -> list[Tensor]:
        """One outer step from the replicas' live weights at the end of an inner phase.

        Returns the new live weights (new tensors; ``weights`` is left unchanged).
        """
        if len(weights) != self.num_replicas:
            raise ValueError(f"expected {self.num_replicas} weight vectors, got {len(weights)}")
        round_ = self.algorithm.schedule(self.outer_step, self.num_replicas)
        payloads = {i: self.algorithm.payload(s, w.clone()) for i, (s, w) in enumerate(zip(self.states, weights))}
        new: list[Tensor] = [torch.empty(0)] * self.num_replicas
        for group in round_.groups:
            total = sum_in_group_order(payloads, group)
            for i in group:
                new[i] = self.algorithm.apply(self.states[i], total.clone(), len(group)).clone()
        self.outer_step += 1
        self.last_round = round_
        return new
