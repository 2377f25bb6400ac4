"""The short-run warning: the outer step's defaults on a run of few outer steps.

The papers tuned their outer steps for hundreds of outer steps. B5 (docs/benchmarks.md, the tables in
docs/tuning.md) found that the same defaults cost a short run part or all of what communicating
gains. A user who keeps them on a short run is told so once, when ``fit`` starts (or when a
:class:`~lightning_loco.simulator.TrainingSimulator` is built with ``max_steps``), with what B5
measured and where the tuned settings are. Nothing changes: the defaults stay the papers'.

Only the defaults warn: any outer-step argument changed from its default, or a custom
``outer_optimizer``, counts as tuned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from lightning_loco.algorithms.outer_optimizer import SGDFactory


@dataclass(frozen=True)
class ShortRun:
    """Below ``outer_steps`` planned outer steps the defaults lost in B5; ``measured`` says by how much."""

    outer_steps: int
    measured: str


# The one place of the thresholds and of what they rest on. B5, the example GPT on Shakespeare, iid
# shards (docs/benchmarks.md, "B5"; docs/tuning.md, "Short runs and few replicas"):
# FILLED IN FROM THE MEASUREMENTS
SHORT_RUN: dict[str, ShortRun] = {
    "diloco": ShortRun(100, "at 45 outer steps (H = 10, N = 4) they ended 0.27 above replicas that never communicate."),
}


def _diloco_defaults(algorithm: Any) -> bool:
    # DiLoCo builds SGDFactory(outer_lr, outer_momentum, nesterov) unless given an outer_optimizer
    return algorithm.outer_optimizer == SGDFactory(0.7, 0.9, True)


def _noloco_defaults(algorithm: Any) -> bool:
    return (algorithm.outer_lr, algorithm.outer_momentum, algorithm.averaging_rate) == (0.7, 0.5, 0.7)


def _gasloc_defaults(algorithm: Any) -> bool:
    default_optimizer = algorithm.sent or algorithm.outer_optimizer == SGDFactory(1.0, algorithm.outer_momentum, True)
    return default_optimizer and (algorithm.outer_lr, algorithm.outer_momentum, algorithm.gossip_step) == (0.7, 0.5, 0.25)


DEFAULTS: dict[str, Callable[[Any], bool]] = {
    "diloco": _diloco_defaults, "noloco": _noloco_defaults, "gasloc": _gasloc_defaults,
}


def planned_outer_steps(max_steps: Optional[float], sync_every: int) -> Optional[int]:
    """The run's outer steps: ``max_steps // H``; ``None`` where the length is unknown or endless."""
    if max_steps is None or max_steps < 0 or max_steps == float("inf"):
        return None
    return int(max_steps) // sync_every


def short_run_note(algorithm: Any, outer_steps: Optional[int]) -> Optional[str]:
    """The warning's text where ``algorithm`` keeps its outer-step defaults and the run plans at
    least one outer step but fewer than B5 showed the defaults need; else ``None``."""
    name = getattr(algorithm, "name", None)
    threshold = SHORT_RUN.get(name) if isinstance(name, str) else None
    if threshold is None or outer_steps is None or not 1 <= outer_steps < threshold.outer_steps:
        return None
    if not DEFAULTS[name](algorithm):
        return None
    return (
        f"{type(algorithm).__name__} with its default outer step on a run of {outer_steps} outer step(s): in our "
        f"convergence benchmark (B5) these defaults needed at least {threshold.outer_steps} outer steps to pay off; "
        f"{threshold.measured} For short runs see docs/tuning.md (Short runs and few replicas) for the settings "
        "that were measured better. Set any outer-step argument (e.g. outer_momentum) to silence this."
    )


def warn_if_short(algorithm: Any, max_steps: Optional[float], sync_every: int, warn: Callable[[str], Any]) -> None:
    """Calls ``warn`` once with :func:`short_run_note`'s text, if there is one."""
    note = short_run_note(algorithm, planned_outer_steps(max_steps, sync_every))
    if note is not None:
        warn(note)
