"""N replicas of a real module trained in one process, with the strategies' own outer step.

It runs the very code the strategies run (the :class:`~lightning_loco.driver.driver.OuterStepDriver` with
its algorithm, schedule, payload, apply, wire format and group-order summation) over an in-process
transport; only the network is replaced. The replicas' modules run their own ``training_step`` with
a Lightning Trainer attached, so ``self.log`` works (:mod:`.context`); their gradients come from one
``vmap`` call over stacked parameters (:mod:`.batched`) or from a loop over replicas
(:mod:`.training`). ``docs/simulator.md`` shows how to use it.
"""

from lightning_loco.simulator.context import training_step_loss
from lightning_loco.simulator.data import distributed_shards
from lightning_loco.simulator.training import Evaluation, TrainingSimulator

__all__ = ["Evaluation", "TrainingSimulator", "distributed_shards", "training_step_loss"]
