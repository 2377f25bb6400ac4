"""``OuterStepCheckpoint``: checkpoints every k outer steps, at the same round on every replica.

Lightning's ``ModelCheckpoint`` saves when a replica's own step or epoch count says so, and names the
file after them. Under ``sync_seconds`` every replica takes its own number of inner steps per round,
so those counts differ between replicas, while saving is collective (every replica writes its own
file, rank 0 the consensus): replicas would be asked to save at different moments, under different
names. This callback saves every ``every_n_outer_steps`` rounds instead, at the batch in which the
round started on each replica (with ``overlap_steps=0``, where it also landed), as
``<dirpath>/outer_step=<k>.ckpt`` with k the rounds started, a name every replica agrees on. It serves
fixed H as well; ``fit(ckpt_path=...)`` resumes from its files as from any other of ours.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint


class OuterStepCheckpoint(Checkpoint):
    """Saves ``<dirpath>/outer_step=<k>.ckpt`` after every ``every_n_outer_steps``-th round.

    Args:
        dirpath: the folder, shared by every rank (as for any of our checkpoints).
        every_n_outer_steps: k, rounds between saves (an integer >= 1).
    """

    def __init__(self, dirpath: str, every_n_outer_steps: int = 1) -> None:
        if isinstance(every_n_outer_steps, bool) or not isinstance(every_n_outer_steps, int) or every_n_outer_steps < 1:
            raise ValueError(f"every_n_outer_steps must be an integer >= 1, got {every_n_outer_steps!r}")
        self.dirpath, self.every = os.fspath(dirpath), every_n_outer_steps
        self._seen = 0  # rounds started when this callback last looked
        self.saved: list[str] = []  # the files this fit wrote, in order

    def _rounds(self, trainer: L.Trainer) -> int:
        return int(getattr(trainer.strategy, "outer_steps", 0))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen = self._rounds(trainer)  # resumed: the round the checkpoint was taken at is not saved again

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        rounds = self._rounds(trainer)
        if rounds != self._seen and rounds % self.every == 0:
            path = os.path.join(self.dirpath, f"outer_step={rounds}.ckpt")
            trainer.save_checkpoint(path)  # collective: every replica reaches this round, and saves here
            self.saved.append(path)
        self._seen = rounds
