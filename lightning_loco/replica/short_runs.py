"""The short-run warning: the outer step's defaults on a run of few outer steps.

The papers tuned their outer steps for hundreds of outer steps. B5 (docs/benchmarks.md, the tables in
docs/tuning.md) found that on its one model, the byte-level example GPT on Shakespeare, the same defaults
cost a short run part or all of what communicating gains. A user who keeps them on a short run is told
so once, when ``fit`` starts (or when a :class:`~lightning_loco.simulator.TrainingSimulator` is built with
``max_steps``): what B5 measured and on what model, that it need not hold for another model (settings
that did better on B5's GPT were reported worse on a user's LSTM), and how to compare settings on one's own model
with the simulator (docs/simulator.md). It recommends no setting as better. Nothing changes: the
defaults stay the papers'.

Only the defaults warn: any outer-step argument other than the paper's, or a custom ``outer_optimizer``,
counts as tuned. The papers' values given explicitly cannot be told from the defaults (LightningCLI passes
every default explicitly), so the warning has a category of its own, :class:`ShortRunWarning`, for a user
who keeps them on purpose to filter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional


class ShortRunWarning(UserWarning):
    """The outer step's paper defaults on a short run (filter it to keep them without the warning)."""


@dataclass(frozen=True)
class ShortRun:
    """Below ``outer_steps`` planned outer steps the defaults lost in B5; ``measured`` says by how much."""

    outer_steps: int
    measured: str


# The one place of the thresholds and of what they rest on: B5, the byte-level example GPT on Shakespeare, iid
# shards, consensus loss at the end of a run against one independent replica's
# (docs/benchmarks.md, "B5"; docs/tuning.md, "Short runs and few replicas" and "At the papers' H").
# - 45 outer steps (H = 10, 450 inner steps, N = 4, 3 seeds): DiLoCo's defaults lost, 2.825 against
#   2.560; NoLoCo's and GASLoC's tied (2.562, 2.553), each 0.09 behind itself tuned.
# - 9 outer steps (H = 50, 450 inner steps, N = 4, seed 0): all three lost, by 0.19, 0.08 and 0.07.
# - 60 outer steps (H = 50, 3000 inner steps, N = 8, 3 seeds): all three won, by 0.07 to 0.18.
# So 60 outer steps is the shortest run at which the defaults were measured to pay off. The boundary
# is not sharp: the same 450 inner steps at H = 5 (90 outer steps) also lost, so the number of inner
# steps matters too; inside the 60-step run the defaults were ahead from 5 outer steps on, but an
# intermediate point is not the end of a shorter run (its learning rate has not decayed).
# The warning states what the defaults did against one replica trained alone on that model, and names no
# setting as better: settings tuned on B5's GPT need not transfer to another model.
SHORT_RUN_OUTER_STEPS = 60
SHORT_RUN: dict[str, ShortRun] = {
    "diloco": ShortRun(SHORT_RUN_OUTER_STEPS, "at 45 outer steps (H = 10, 4 replicas) its consensus model's "
                       "validation loss ended at 2.825 against 2.560 for one replica trained alone (3 seeds)."),
    "noloco": ShortRun(SHORT_RUN_OUTER_STEPS, "at 45 outer steps (H = 10, 4 replicas) its consensus model's "
                       "validation loss only tied one replica trained alone, 2.562 against 2.560 (3 seeds)."),
    "gasloc": ShortRun(SHORT_RUN_OUTER_STEPS, "at 45 outer steps (H = 10, 4 replicas) its consensus model's "
                       "validation loss only tied one replica trained alone, 2.553 against 2.560 (3 seeds)."),
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
    if not algorithm.keeps_paper_outer_step():
        return None
    return (
        f"{type(algorithm).__name__} with its default outer step on a run of {outer_steps} outer step(s). What this "
        "rests on: one model, the byte-level example GPT on Shakespeare (our convergence benchmark B5, iid shards), "
        f"where these defaults paid off only in runs of {threshold.outer_steps} outer steps or more; "
        f"{threshold.measured} That was measured on one model and one data set and need not hold for yours: "
        "settings that did better there can do worse on another model. To choose the outer step for your model, "
        "compare the defaults with other settings on it in the training simulator (docs/simulator.md: N replicas "
        "of your module in one process); B5's numbers are in docs/tuning.md ('Short runs and few replicas'). Any "
        "outer-step argument other than the paper's silences this; to keep the paper's, filter the warning: "
        "warnings.filterwarnings('ignore', "
        f"category=lightning_loco.ShortRunWarning), or for a command PYTHONWARNINGS='ignore:{type(algorithm).__name__} "
        "with its default outer step'."
    )


def warn_if_short(algorithm: Any, max_steps: Optional[float], sync_every: int, warn: Callable[..., Any]) -> None:
    """Calls ``warn`` once with :func:`short_run_note`'s text (as a :class:`ShortRunWarning`), if there is one."""
    note = short_run_note(algorithm, planned_outer_steps(max_steps, sync_every))
    if note is not None:
        warn(note, category=ShortRunWarning)
