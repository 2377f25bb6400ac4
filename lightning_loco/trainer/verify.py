"""``VerifyState``: an opt-in callback that checks the state that must agree, with cheap digests
(:mod:`lightning_loco.replica.state_digest`), instead of trusting it.

* ``rounds``: after every DiLoCo round, the replicas' parameters are the same on every replica: one all-gather of
  two int64 numbers per parameter tensor, over every rank of the world (a global collective per round, which is
  why it is off by default). Static DiLoCo runs without overlap, fragments or pacing, where the weights agree right
  after each round.
* ``resume``: at every save the digests of each rank's own state dict (this replica's weights and buffers) go in
  the checkpoint (one all-gather at the save, which already synchronises every replica); when ``fit`` resumes
  from it each rank recomputes its own and compares, before the first batch.

A difference raises :class:`~lightning_loco.replica.state_digest.StateMismatchError` naming the replica, the
tensor and the step.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_loco.replica.state_digest import StateMismatchError, compare_over_world, digests, first_difference

__all__ = ["VerifyState"]

KEY = "lightning_loco_state_digests"


class VerifyState(Callback):
    """Checks state that must agree (see the module docstring). Off unless added to the Trainer's callbacks.

    Args:
        rounds: compare the replicas' parameters after every round (``None``: where the run is a static DiLoCo run
            without overlap, fragments or pacing; ``True`` refuses other runs).
        resume: store digests in every checkpoint and check a resumed fit's state against them.
    """

    def __init__(self, rounds: Optional[bool] = None, resume: bool = True) -> None:
        self.rounds, self.resume = rounds, resume
        self._checking_rounds = False
        self._rounds_seen = 0
        self._saved: Optional[dict[str, Any]] = None  # from the checkpoint fit resumes from

    @staticmethod
    def _why_rounds_disagree(strategy: Any) -> Optional[str]:
        """Why the replicas' weights need not agree right after a round in this run (``None``: they must)."""
        options = getattr(strategy, "options", None)
        if options is None:
            return f"{type(strategy).__name__} is not one of lightning_loco's strategies"
        if strategy.algorithm.name != "diloco":
            return f"{strategy.algorithm.name} replicas keep weights of their own after a round"
        if strategy.elastic is not None:
            return "elastic replicas have no collective over each other"
        if options.overlap_steps or options.fragments > 1 or options.pacing is not None:
            return "with overlap, fragments or pacing the weights differ right after a round"
        return None

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy = trainer.strategy
        why = self._why_rounds_disagree(strategy)
        if self.rounds and why is not None:
            raise ValueError(f"VerifyState(rounds=True) compares the replicas' weights after each round, but {why}. "
                             "Use rounds=None (checked where they must agree) or rounds=False.")
        self._checking_rounds = self.rounds is not False and why is None and dist.is_initialized()
        self._rounds_seen = len(getattr(strategy, "outer_step_reports", []))
        saved, self._saved = self._saved, None
        if saved is None or not self.resume:
            return
        rank = trainer.global_rank
        if len(saved["ranks"]) != trainer.world_size:
            return  # resumed with another number of ranks: each loaded state of its own making
        mine = digests(pl_module.state_dict().items())
        name = first_difference(saved["ranks"][rank], mine)
        if name is not None:
            replica = getattr(strategy, "replica_index", rank)
            raise StateMismatchError(
                f"Replica {replica} (rank {rank}) resumed with state that differs from the checkpoint saved at step "
                f"{saved['step']}: tensor {name!r} is not what was saved. The checkpoint's files may be mixed "
                "from different saves, or loading changed the state."
            )

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._checking_rounds:
            return
        reports = trainer.strategy.outer_step_reports  # type: ignore[attr-defined]
        if len(reports) == self._rounds_seen:
            return
        self._rounds_seen = len(reports)
        strategy: Any = trainer.strategy
        mine = digests((name, p) for name, p in pl_module.named_parameters())
        compare_over_world(mine, strategy.comm_device(), strategy.ranks_per_replica, trainer.global_step,
                           what=f"weights after outer step {reports[-1].outer_step}")

    @override
    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        if not self.resume:
            return
        mine = digests(checkpoint["state_dict"].items())
        ranks: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1 and getattr(trainer.strategy, "elastic", None) is None:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        checkpoint[KEY] = {"step": trainer.global_step, "ranks": ranks}

    @override
    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        self._saved = checkpoint.get(KEY) if trainer.state.fn == "fit" else None
