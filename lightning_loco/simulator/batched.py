"""The batched path: every replica's gradients in one ``torch.func.vmap(grad(...))`` call.

Every replica's parameters are stacked into one ``[N, ...]`` tensor per name and each replica's
parameters become views into it, so its optimizer and its driver see ordinary parameters. One copy of
the module (with replica 0's Trainer, see :mod:`.context`) runs the loss under ``vmap``; what its
``training_step`` logs is taken out of the call as auxiliary outputs, one value per replica, and then
logged on every replica's own Trainer as if its own ``training_step`` had logged it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_loco.simulator.context import ReplicaContext

Batch = Any
Logged = list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]  # (name, value, args, kwargs) of self.log calls


class _LogRecorder:
    """``self.log`` on the module run under ``vmap``: keeps the calls, to be logged per replica after."""

    def __init__(self) -> None:
        self.calls: Logged = []

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(value, (Tensor, int, float)):
            raise TypeError(
                f"self.log({name!r}, ...) got a {type(value).__name__}: under vmap only tensors and numbers can be "
                f"logged (a torchmetrics metric updates its state in place)"
            )
        self.calls.append((name, value, args, kwargs))


class _LossModule(nn.Module):
    """``loss(inner, batch, batch_idx)`` as a module, so that ``functional_call`` can swap the inner weights."""

    def __init__(self, inner: nn.Module, loss: Callable[[nn.Module, Batch, int], Tensor]) -> None:
        super().__init__()
        self.inner, self.loss = inner, loss

    def forward(self, batch: Batch, batch_idx: int) -> Tensor:
        return self.loss(self.inner, batch, batch_idx)


@dataclass
class BatchedStep:
    """What the batched path computed for one optimizer step (all micro-batches)."""

    losses: list[float]  # each replica's mean loss over its micro-batches
    logged: list[list[Logged]] = field(default_factory=list)  # [micro-batch][replica]: its self.log calls


class BatchedGradients:
    """Computes every replica's gradients in one ``vmap`` call per micro-batch.

    Args:
        replicas: the replicas' modules (their parameters become views into the stacked tensors).
        blank: an unattached copy of the module (the copy run under ``vmap`` is made from it).
        loss: ``loss(module, batch, batch_idx)``.
        context: replica 0's context (its Trainer and precision plugin serve the copy under ``vmap``).
        accumulate: gradient accumulation: each micro-batch's loss is divided by it.

    Raises where the module cannot be batched: BatchNorm's running statistics and torchmetrics'
    states are updated in place, per replica.
    """

    def __init__(
        self, replicas: Sequence[nn.Module], blank: nn.Module, loss: Callable[[nn.Module, Batch, int], Tensor],
        context: ReplicaContext, accumulate: int,
    ) -> None:
        from torch.func import functional_call, grad, vmap
        from torchmetrics import Metric

        first = replicas[0]
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in first.modules()):
            raise ValueError("BatchNorm running statistics are updated in place")
        metrics = [name for name, m in first.named_modules() if isinstance(m, Metric)]
        if metrics:
            raise ValueError(
                f"torchmetrics metrics ({', '.join(metrics)}) keep state per replica, and vmap runs one copy"
            )
        self.replicas = list(replicas)
        self.names = [name for name, _ in first.named_parameters()]
        inner = copy.deepcopy(blank)
        context.attach(inner)
        self._recorder = _LogRecorder()
        inner.log = self._recorder  # type: ignore[assignment]  # log_dict calls self.log too
        template = _LossModule(inner, loss)
        self.stacked: dict[str, Tensor] = {}
        for name in self.names:
            stacked = torch.stack([r.get_parameter(name).detach() for r in self.replicas])
            self.stacked[name] = stacked
            for i, r in enumerate(self.replicas):
                r.get_parameter(name).data = stacked[i]
        buffers = {f"inner.{k}": v for k, v in first.named_buffers()}
        recorder = self._recorder

        def loss_of(params: dict[str, Tensor], batch: Batch, batch_idx: int) -> tuple[Tensor, Any]:
            recorder.calls.clear()
            weights = {f"inner.{k}": v for k, v in params.items()}
            with context.precision_context():
                loss = functional_call(template, {**weights, **buffers}, (batch, batch_idx))
            values = tuple(v for _, v, _, _ in recorder.calls if isinstance(v, Tensor))
            return loss / accumulate, (loss.detach(), values)

        self._grad_fn = vmap(grad(loss_of, has_aux=True), in_dims=(0, 0, None), randomness="different")

    def compute(self, draws: Sequence[Sequence[tuple[Batch, int, int]]]) -> BatchedStep | None:
        """Every replica's gradients (set as its parameters' ``.grad``) over its micro-batches
        ``draws[i]`` (``(batch, batch_idx, epoch)`` each). ``None`` (nothing set) where this step
        cannot be batched: replicas with different numbers of micro-batches, batches of different
        shapes (a last partial batch) or different indices; the loop takes such a step."""
        if len({len(d) for d in draws}) != 1 or any(len({d[j][1] for d in draws}) != 1 for j in range(len(draws[0]))):
            return None
        stacked_batches = []
        for j in range(len(draws[0])):
            try:
                stacked_batches.append(tree_map(lambda *xs: torch.stack(xs), *(d[j][0] for d in draws)))
            except (RuntimeError, TypeError):
                return None
        n = len(self.replicas)
        total: dict[str, Tensor] = {}
        losses = torch.zeros(n)
        step = BatchedStep(losses=[])
        for j, batch in enumerate(stacked_batches):
            with warnings.catch_warnings():
                # PyTorch warns once that some ops (CPU flash attention) have no batching rule and loop
                # over the replicas instead: correct, only slower (docs/simulator.md says so)
                warnings.filterwarnings(
                    "ignore", message="There is a performance drop because we have not yet implemented"
                )
                grads, (loss, values) = self._grad_fn({k: self.stacked[k] for k in self.names}, batch, draws[0][j][1])
            for name in self.names:
                total[name] = grads[name] if j == 0 else total[name] + grads[name]
            losses += loss.detach().float()
            step.logged.append([self._per_replica(values, i) for i in range(n)])
        for i, r in enumerate(self.replicas):
            for name in self.names:
                r.get_parameter(name).grad = total[name][i]
        step.losses = (losses / len(stacked_batches)).tolist()
        return step

    def _per_replica(self, values: Sequence[Tensor], i: int) -> Logged:
        """Replica ``i``'s ``self.log`` calls of the last ``vmap`` call, with its own values."""
        tensors = iter(values)
        return [(name, next(tensors)[i] if isinstance(v, Tensor) else v, args, kwargs)
                for name, v, args, kwargs in self._recorder.calls]
