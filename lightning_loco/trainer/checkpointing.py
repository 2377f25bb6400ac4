"""Checkpoint hooks of the strategies: every replica's own file, and the consensus in the main file.

The save and load of the replica payloads are the replica's (:meth:`~lightning_loco.replica.replica.Replica.save`,
:meth:`~lightning_loco.replica.replica.Replica.load`, the same as Fabric's; the file layout, its checks and errors
are :mod:`lightning_loco.replica.checkpoints`); this class only connects them to Lightning's ``Strategy`` hooks
(Lightning calls each of them on every rank), and resolves a "last" checkpoint behind a newer complete one.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_loco.replica import checkpoints
from lightning_loco.trainer.validation import ReplicaScope


class ReplicaCheckpoints(ReplicaScope):
    """The checkpoint hooks of :class:`~lightning_loco.trainer.base.OuterStepStrategy` (its base).

    Under ``pacing`` each replica's file also keeps its own loops' progress (its global step, epoch and
    batch counts differ from rank 0's, which the main file holds), so that each replica resumes from its
    own place in its own data."""

    _trained_module: Any  # OuterStepStrategy's, which load_checkpoint resets

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # per-replica weights land after setup's broadcast of rank 0's initial weights

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Writes this replica's file on every rank, then the main file (consensus weights) on rank 0.
        Collective: Lightning calls it on every rank. Sharded replicas: every rank writes its own
        shards, and the main file holds the full consensus model and no inner optimizer state."""

        def write_main(averaged: Any, meta: dict[str, Any]) -> None:
            main = self.layout.main_file({**checkpoint, "state_dict": averaged, checkpoints.META_KEY: meta})
            self.checkpoint_io.save_checkpoint(main, filepath, storage_options=storage_options)

        # replicas at different step counts (pacing): each keeps its own loops' progress
        extra = {"loops": checkpoint.get("loops")} if self.options.pacing is not None else None
        decisions = self._checkpoint_decisions(checkpoint)
        agreed = self.replica.save(filepath, checkpoint,
                                   lambda: self.replica.consensus_state_dict(checkpoint["state_dict"]),
                                   write_main, step=checkpoint, extra=extra, agreed=decisions)
        if not self.is_global_zero:
            self._take_checkpoint_decisions(agreed)
        if self.agreed is not None:  # a save during a validation under ReplicaValidation: the file is there now
            self.agreed.saved(filepath)

    def _checkpoint_decisions(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's ``ModelCheckpoint`` states as this save holds them (best and k-th best paths and scores, the
        last path): the save is named after rank 0's file name, so every rank takes rank 0's bookkeeping with it,
        in the save's one broadcast (a metric in the file name may differ between replicas)."""
        if not self.is_global_zero:
            return {}
        states = checkpoint.get("callbacks") or {}
        keys = {cb.state_key for cb in self._model_checkpoints()}
        return apply_to_collection({k: v for k, v in states.items() if k in keys}, Tensor, lambda t: t.detach().cpu())

    def _take_checkpoint_decisions(self, states: dict[str, Any]) -> None:
        for callback in self._model_checkpoints():
            if callback.state_key in states:
                callback.load_state_dict(states[callback.state_key])

    def _model_checkpoints(self) -> list[ModelCheckpoint]:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)] if trainer else []

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            checkpoints.remove_sidecars(filepath)
        if self.agreed is not None:
            self.agreed.saved(filepath, present=False)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Loads the main file and, on every rank, that replica's own file. Collective.

        Only ``fit(ckpt_path=...)`` restores outer state (anchors, momenta, counters, a round in
        flight); ``validate``/``test``/``predict`` with a checkpoint load each replica's weights only.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self._is_last_checkpoint(checkpoint_path):
            checkpoint_path, checkpoint = self._newest_instead_of_last(checkpoint_path, checkpoint, weights_only)
        fitting = self.module.trainer.state.fn == TrainerFn.FITTING  # only fit takes up the outer state
        payload = self.replica.load(checkpoint, checkpoint_path, resume=fitting)
        if payload is None:
            return checkpoint  # a plain checkpoint, or another number of replicas: every replica starts from it
        checkpoint["state_dict"] = payload["state_dict"]
        for key in ("optimizer_states", "lr_schedulers", "loops"):  # "loops": saved under pacing only
            if payload.get(key) is not None:
                checkpoint[key] = payload[key]
        if not fitting:
            self._trained_module = None  # the weights are the checkpoint's now: a later fit starts from rank 0's
        return checkpoint

    def _end_a_fit_resumed_at_its_end(self, trainer: Any) -> None:
        """A fit that loaded a checkpoint and ended without training (taken at ``max_steps``, or at the last
        epoch's end): Lightning skips the training loop and its hooks, so the run's end happens here, as the run
        that saved it ended (see :meth:`~lightning_loco.replica.replica.Replica.end_without_steps`). Not after an
        error (every rank must take part)."""
        if trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING:
            self.replica.end_without_steps()
        self.replica.loaded = None

    def _is_last_checkpoint(self, checkpoint_path: Any) -> bool:
        """Whether the file is named as a ``ModelCheckpoint`` of this trainer names its "last" checkpoint
        (``last.ckpt``, ``last-v1.ckpt``, ...): what ``ckpt_path="last"`` resolves to."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None:
            return False
        name = posixpath.basename(checkpoints.storage(checkpoint_path)[1])
        return any(
            re.fullmatch(rf"{re.escape(cb.CHECKPOINT_NAME_LAST)}(-v\d+)?{re.escape(cb.FILE_EXTENSION)}", name)
            for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.CHECKPOINT_NAME_LAST
        )

    def _newest_instead_of_last(
        self, checkpoint_path: Any, checkpoint: dict[str, Any], weights_only: Optional[bool]
    ) -> tuple[Any, dict[str, Any]]:
        """A "last" checkpoint behind a newer complete one (its own save was interrupted) gives way to
        that one. Rank 0 looks and every rank follows (one broadcast, only when loading a "last" file)."""
        step = checkpoint.get("global_step", -1)
        newer = checkpoints.newer_complete_checkpoint(checkpoint_path, step) if self.is_global_zero else None
        newer = self.broadcast(newer)
        if newer is None:
            return checkpoint_path, checkpoint
        path, newer_step = newer
        rank_zero_warn(
            f"{checkpoint_path} holds global step {step}, but {path}, written after it, is a complete checkpoint "
            f"at step {newer_step}: the save of {checkpoint_path} was interrupted. Loading {path} instead."
        )
        return path, super().load_checkpoint(path, weights_only=weights_only)
