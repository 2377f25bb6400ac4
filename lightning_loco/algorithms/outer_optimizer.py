"""An anchor stepped by a torch optimizer: the outer state of DiLoCo and GASLoC.

The anchor is one flat float32 buffer (what the transport moves); the optimizer sees
``torch.nn.Parameter`` views of it shaped like the model's parameters, so per-tensor optimizers
behave as they would on the model. The outer gradient lives in a second flat buffer whose views are
the parameters' ``.grad``.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_loco.algorithms.base import OuterState

OuterOptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], Optimizer]


def parameter_views(flat: Tensor, shapes: Sequence[torch.Size]) -> list[torch.nn.Parameter]:
    """``torch.nn.Parameter`` views into ``flat``, one per shape, for an outer optimizer.

    Stepping a torch optimizer over these updates ``flat`` in place, so the outer optimizer keeps
    per-tensor semantics while the buffer that travels stays flat.
    """
    views, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        views.append(torch.nn.Parameter(flat[offset : offset + n].view(shape)))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"shapes cover {offset} elements but the buffer has {flat.numel()}")
    return views


@dataclass
class OptimizerOuterState(OuterState):
    anchor: Tensor
    gradient: Tensor  # the views' .grad live in it
    optimizer: Optimizer  # steps parameter views of ``anchor``

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.anchor.copy_(state_dict["anchor"])
        self.optimizer.load_state_dict(state_dict["optimizer"])

    def shadow(self, factory: OuterOptimizerFactory) -> dict[str, Any]:
        """Fields of an independent copy (anchor, gradient, optimizer and its state), for a dry run.
        ``copy.deepcopy`` would not do: it clones the optimizer's parameter views apart from the
        anchor and drops their gradients."""
        shapes = [p.shape for group in self.optimizer.param_groups for p in group["params"]]
        fields = anchor_fields(self.anchor.clone(), shapes, factory)
        fields["optimizer"].load_state_dict(copy.deepcopy(self.optimizer.state_dict()))
        return fields

    def step(self) -> Tensor:
        """One optimizer step on the anchor with the gradient already in ``self.gradient``."""
        self.optimizer.step()
        return self.anchor


def check_factory(factory: Optional[OuterOptimizerFactory]) -> None:
    if factory is not None and not callable(factory):
        raise ValueError(
            "outer_optimizer must be a callable that builds an optimizer from parameters, e.g. "
            f"functools.partial(torch.optim.SGD, lr=0.7), got {factory!r}"
        )


def picklable_problem(factory: Optional[OuterOptimizerFactory], start_method: str) -> Optional[str]:
    """Why ``factory`` cannot travel with ``start_method`` (None if it can). With "spawn" or "forkserver"
    the strategy travels to every process by pickle: a lambda or a function defined inside another
    cannot. "popen" and "fork" pickle nothing."""
    if factory is None or start_method not in ("spawn", "forkserver"):
        return None
    try:
        pickle.dumps(factory)
    except Exception as error:
        return (
            f"outer_optimizer {factory!r} cannot be pickled, which start_method={start_method!r} needs to send "
            "it to every process. Use a module-level function or functools.partial, e.g. "
            "functools.partial(torch.optim.Adam, lr=1e-3), instead of a lambda or a local function "
            f"(or start_method='popen'). Pickling failed with: {error}"
        )
    return None


@dataclass(frozen=True)
class SGDFactory:
    """Builds the default outer SGD. A class rather than a closure, so that strategies pickle (spawn).
    torch refuses Nesterov without momentum; with momentum 0 both are plain SGD anyway."""

    lr: float
    momentum: float
    nesterov: bool

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> Optimizer:
        nesterov = self.nesterov and self.momentum > 0
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=nesterov)


def anchor_fields(weights: Tensor, shapes: Sequence[torch.Size], factory: OuterOptimizerFactory) -> dict[str, Any]:
    """The fields of an :class:`OptimizerOuterState` starting at ``weights``."""
    anchor = weights.clone()
    gradient = torch.zeros_like(anchor)
    params = parameter_views(anchor, shapes)
    for p, g in zip(params, parameter_views(gradient, shapes)):
        p.grad = g.detach()
    optimizer = factory(params)
    if not isinstance(optimizer, Optimizer):
        raise ValueError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(optimizer)}")
    return {"anchor": anchor, "gradient": gradient, "optimizer": optimizer}
