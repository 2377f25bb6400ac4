"""The independent reference the tests hold the outer-step driver and the transports against.

:class:`ReplicaSimulator` runs N replicas of an outer-step algorithm in one process on flat vectors,
written once more from the algorithm's own ``schedule``, ``payload`` and ``apply``, the transport's
group-order summation and the codec functions alone: no :class:`~lightning_loco.driver.driver.OuterStepDriver`,
no transport. The driver over the in-process transport (``tests/test_driver.py``) and over
torch.distributed, the wire formats (``tests/test_compression.py``) and the outer maths
(``tests/test_algorithms.py``, ``tests/test_gasloc.py``, ``tests/test_overlap.py``) must agree with it.
The library's own simulator is :class:`lightning_loco.simulator.TrainingSimulator`, which runs the driver.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.algorithms.schedules import Round
from lightning_loco.transport.base import sum_in_group_order
from lightning_loco.wire.codecs import WireFormat, chunked_all_reduce, decode_sum, roundtrip_segments, segments


class ReplicaSimulator:
    """Simulated replicas sharing one algorithm.

    Args:
        algorithm: the outer-step maths.
        weights: the replicas' initial flat float32 weights (usually N copies of one vector).
        shapes: parameter shapes covering the flat vector (default: one flat parameter).
        wire: a wire format (:func:`lightning_loco.wire.codecs.wire_format`): payloads are encoded and
            decoded as the transports do (group sums of decoded payloads, the chunked all-reduce,
            error-feedback residuals), written here once more from the codec functions alone.
    """

    def __init__(
        self,
        algorithm: OuterAlgorithm,
        weights: Sequence[Tensor],
        shapes: Sequence[torch.Size] | None = None,
        wire: WireFormat | None = None,
    ) -> None:
        if not weights:
            raise ValueError("need at least one replica")
        self.algorithm = algorithm
        self.shapes = list(shapes) if shapes is not None else [weights[0].shape]
        self.states: list[OuterState] = [algorithm.init_state(w.clone(), self.shapes) for w in weights]
        self.outer_step = 0
        self.last_round: Round | None = None
        self.wire = wire if wire is not None and wire.lossy else None
        self.residuals: dict[int, Tensor] | None = {} if self.wire and self.wire.error_feedback else None

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
            total = self._group_total(payloads, group, round_.collective)
            for i in group:
                new[i] = self.algorithm.apply(self.states[i], total.clone(), len(group)).clone()
        self.outer_step += 1
        self.last_round = round_
        return new

    def _group_total(self, payloads: dict[int, Tensor], group: Sequence[int], collective: bool) -> Tensor:
        talks = len(group) > 1
        if self.wire is None or not talks:
            return sum_in_group_order(payloads, group)
        codec, n = self.wire.codec, self.num_replicas
        sent = {}
        for i in group:
            x = payloads[i]
            if self.residuals is not None:
                residual = self.residuals.get(i, torch.zeros_like(x))
                assert self.wire is not None
                x = x + residual if self.wire.decay == 1.0 else x.add(residual, alpha=self.wire.decay)
                parts = segments(x.numel(), 1, n if collective and not codec.gathers else 1)
                self.residuals[i] = x - roundtrip_segments(x, codec, parts)
            sent[i] = x
        if collective:
            return chunked_all_reduce([sent[i] for i in sorted(group)], codec)
        return decode_sum({i: codec.encode(x) for i, x in sent.items()}, sent[group[0]].numel(), codec, group)
