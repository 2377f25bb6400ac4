"""The merge of unequal H_i weighted by steps (``merge="steps"``, under ``sync_seconds``).

With ``sync_seconds`` every replica takes its own number of inner steps H_i per round
(:mod:`lightning_loco.driver.pacing`). The algorithms combine their group's payloads with a plain mean;
``merge="steps"`` weights each replica's payload by the steps it took, as a token-weighted merge does:

* DiLoCo: Δ̄ = Σ_i H_i·Δ_i / Σ_j H_j in place of (1/N)·Σ_i Δ_i, then the same outer optimizer step;
* NoLoCo: the group's means (of θ_j, and of φ_j when γ ≠ β) weighted by H_j, Σ_j H_j·θ_j / Σ_j H_j,
  then the same momentum update δ_i ← α·δ_i + β·(θ̄ − φ_i).

H_i travels with the round: each replica sends H_i·x_i with H_i appended as one more value, so that
the group's sum carries Σ H_i·x_i and Σ H_j together, and every member divides one by the other.
Both algorithms use the group's size only as the divisor of that mean, so the weighted merge is their
own ``apply`` and ``final_weights`` given the group's sum without the appended value and Σ H_j as the
divisor. The appended value must arrive exactly (a lossy wire format would round it with the
payload), so lossy wire formats are refused.

GASLoC is refused: its mix x_i = z_i − α·Σ_j (z_i − z_j) is mean-preserving (the mean over replicas
follows Nesterov DiLoCo), and no mix of a pair that leans both members towards the one that took more
steps can be (docs/algorithms.md, "Replicas of different speeds").

:func:`with_merge` is what the driver calls: it returns the algorithm to run (the combinations that serve
are rules of :mod:`lightning_loco.replica.options`). No torch.distributed, transport or Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.algorithms.schedules import Round


def with_merge(algorithm: OuterAlgorithm, merge: str) -> OuterAlgorithm:
    """The algorithm to run: ``algorithm`` itself for ``merge="mean"``, else :class:`StepWeighted` over
    it (which combinations serve is a rule of :mod:`lightning_loco.replica.options`)."""
    return algorithm if merge == "mean" else StepWeighted(algorithm)


class WeightedState(OuterState):
    """The inner algorithm's outer state, and the steps H_i of the round being posted (set by
    :meth:`StepWeighted.phase_ended` just before the payload; not saved: a round under
    ``sync_seconds`` lands before the next step)."""

    def __init__(self, inner: OuterState) -> None:
        self.inner = inner
        self.steps: Optional[int] = None

    @property
    def anchor(self) -> Tensor:  # type: ignore[override]
        return self.inner.anchor

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def _unweighted(group_sum: Tensor) -> tuple[Tensor, int]:
    """The group's Σ H_i·x_i (a view) and Σ H_j, exact: whole numbers below 2²⁴ in float32."""
    return group_sum[:-1], int(group_sum[-1].item())


class StepWeighted(OuterAlgorithm):
    """``inner`` (DiLoCo or NoLoCo) with its group's mean weighted by each member's inner steps."""

    def __init__(self, inner: OuterAlgorithm) -> None:
        if not inner.step_weighting:
            raise ValueError(f"merge='steps' does not serve {inner.name}: its apply does not take the group's size "
                             "as the divisor of a mean (see the rule steps-merge-algorithm)")
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        for capability in ("payload_is_pseudo_gradient", "collective", "seeded_schedule", "any_replica_count",
                           "overlap_share", "step_weighting"):
            setattr(self, capability, getattr(inner, capability))

    def check_num_replicas(self, num_replicas: int) -> None:
        self.inner.check_num_replicas(num_replicas)

    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        return self.inner.schedule(outer_step, num_replicas)

    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> WeightedState:
        return WeightedState(self.inner.init_state(weights, shapes))

    def phase_ended(self, state: OuterState, steps: int) -> None:
        assert isinstance(state, WeightedState)
        state.steps = steps

    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        """H_i·x_i with H_i appended, x_i the inner algorithm's payload: summed over a group, Σ H_i·x_i
        followed by Σ H_j."""
        assert isinstance(state, WeightedState) and state.steps is not None, "phase_ended before payload"
        values = self.inner.payload(state.inner, weights)
        return torch.cat([values * state.steps, values.new_tensor([float(state.steps)])])

    def payload_numel(self, state: OuterState) -> int:
        assert isinstance(state, WeightedState)
        return self.inner.payload_numel(state.inner) + 1

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        assert isinstance(state, WeightedState)
        return self.inner.apply(state.inner, *_unweighted(group_sum))

    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        assert isinstance(state, WeightedState)
        return self.inner.final_weights(state.inner, *_unweighted(group_sum))

    def local_proxy(self, state: OuterState, weights: Tensor, group_size: int) -> Tensor:
        """The inner algorithm's: with every member's payload this replica's own, any weighting gives it."""
        assert isinstance(state, WeightedState)
        return self.inner.local_proxy(state.inner, weights, group_size)
