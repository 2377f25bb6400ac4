"""What the training simulator measures: the replicas' weights, their spread, bytes sent, and
validation of each replica and of their average (a mixin of :class:`~.training.TrainingSimulator`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_loco.driver.flat import FlatParameters
from lightning_loco.simulator.context import logging_discarded
from lightning_loco.simulator.data import Batch
from lightning_loco.wire.codecs import ring_all_reduce_bytes

LossFn = Callable[[nn.Module, Batch], Tensor]


@dataclass
class Evaluation:
    """Validation of the simulated replicas."""

    replica_losses: list[float]  # each replica's own weights
    consensus_loss: float  # the replicas' average weights

    @property
    def mean_replica_loss(self) -> float:
        return sum(self.replica_losses) / len(self.replica_losses)


class Measurements:
    """The simulator's measurements; the simulator sets the attributes annotated here."""

    num_replicas: int
    contexts: list[Any]
    drivers: list[Any]
    flats: list[FlatParameters]
    params: list[list[nn.Parameter]]
    replicas: list[nn.Module]
    gradient_averaging: bool
    step_count: int
    loss_fn: LossFn
    _template: nn.Module

    @property
    def logged(self) -> list[dict[str, float]]:
        """Per replica, the last value of everything its ``training_step`` logged with ``self.log`` or
        ``self.log_dict`` (its Trainer's ``callback_metrics``: ``name``, or ``name_step`` and
        ``name_epoch`` for values logged on both)."""
        return [context.logged for context in self.contexts]

    def weights(self) -> list[Tensor]:
        """Every replica's flat float32 weights (in its optimizer's parameter order)."""
        return [flat.gather() for flat in self.flats]

    def outer_weights(self) -> list[Tensor] | None:
        """After a final landing (``final_outer_step="average"``): the weights the papers' plain outer
        step gave each replica instead, which training that goes on starts from. Else ``None``. With
        fragments, every fragment's (the end lands a round of each), joined in parameter order."""
        kept = [[slot.outer_weights for slot in d.slots] for d in self.drivers]
        if not kept or any(w is None for per_slot in kept for w in per_slot):
            return None
        return [torch.cat(per_slot) if len(per_slot) > 1 else per_slot[0].clone() for per_slot in kept]

    def spread(self) -> float:
        """RMS distance of the replicas' weights from their mean (the strategies' ``replica_spread``)."""
        w = torch.stack(self.weights())
        return (w - w.mean(0)).pow(2).sum(1).mean().sqrt().item()

    def bytes_sent(self) -> list[int]:
        """Payload bytes each replica has sent so far (DDP: a ring all-reduce of the gradients per
        step; independent replicas: none)."""
        if self.drivers:
            return [sum(r.bytes_sent for r in d.reports) for d in self.drivers]
        if self.gradient_averaging:
            n, numel = self.num_replicas, sum(p.numel() for p in self.params[0])
            return [ring_all_reduce_bytes(numel * 4, n) * self.step_count] * n
        return [0] * self.num_replicas

    def consensus_module(self) -> nn.Module:
        """A copy of the module holding the replicas' consensus, as the strategies average it: the mean of
        the weights and of the floating-point buffers (BatchNorm's running statistics); integer buffers
        (``num_batches_tracked``) are not averaged, and are replica 0's, as on the strategies' rank 0."""
        return self._module_with(torch.stack(self.weights()).mean(0), buffers=None)

    def consensus_buffers(self) -> dict[str, Tensor]:
        """The consensus's buffers: floating-point ones averaged over the replicas, the others replica 0's."""
        per_replica = [dict(r.named_buffers()) for r in self.replicas]
        out = {}
        for name, first in per_replica[0].items():
            if first.is_floating_point():
                mean = torch.stack([b[name].detach().float() for b in per_replica]).mean(0)
                out[name] = mean.to(first.dtype)
            else:
                out[name] = first.detach().clone()
        return out

    def _module_with(self, flat: Tensor, buffers: int | None) -> nn.Module:
        """A copy of the module with the flat weights ``flat`` and replica ``buffers``'s buffers (None: the
        consensus's)."""
        module = copy.deepcopy(self._template)
        own = {id(p): name for name, p in self.replicas[0].named_parameters()}
        target = dict(module.named_parameters())
        FlatParameters([target[own[id(p)]] for p in self.params[0]], "cpu").scatter(flat)
        values = self.consensus_buffers() if buffers is None else dict(self.replicas[buffers].named_buffers())
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(values[name])
        return module

    def _replica_copy(self, i: int) -> nn.Module:
        """Replica ``i``'s weights and buffers in a copy of the module: evaluation leaves the replica's
        own state (its metrics' accumulated values, what it logged) as training left it."""
        module = copy.deepcopy(self._template)
        module.load_state_dict(self.replicas[i].state_dict())
        return module

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[Batch],
        loss: LossFn | None = None,
        weights: Sequence[Tensor] | None = None,
        replicas: Sequence[int] | None = None,
    ) -> Evaluation:
        """Mean loss over ``batches`` of each replica and of the consensus (average of all replicas)
        model; of ``weights`` (flat, one per replica, e.g. :meth:`outer_weights`) instead of the live
        ones when given. ``replicas``: evaluate only these replicas (the consensus still averages all).
        The models are copies, and what their ``training_step`` logs (the default loss) is discarded:
        evaluating leaves training's state, logged values and metrics as they were."""
        loss_fn = loss or self.loss_fn
        batches = list(batches)
        chosen = list(range(self.num_replicas)) if replicas is None else list(replicas)
        if weights is None:
            models = [*(self._replica_copy(i) for i in chosen), self.consensus_module()]
        else:
            mean = torch.stack(list(weights)).mean(0)
            models = [*(self._module_with(weights[i], i) for i in chosen), self._module_with(mean, None)]
        for i, model in zip([*chosen, 0], models):  # a training_step may read self.trainer
            self.contexts[i].attach(model)
        results = []
        with logging_discarded(models):
            for model in models:
                was_training = model.training
                model.eval()
                total = sum(float(loss_fn(model, b)) for b in batches)
                model.train(was_training)
                results.append(total / max(1, len(batches)))
        return Evaluation(replica_losses=results[:-1], consensus_loss=results[-1])
