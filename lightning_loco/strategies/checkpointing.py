"""Checkpoint hooks of the strategies: every replica's own file, and the consensus in the main file.

The file layout, its checks and errors are :mod:`lightning_loco.checkpoints`; this mixin only
connects them to Lightning's ``Strategy`` hooks (Lightning calls each of them on every rank).
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_loco import checkpoints, consensus, sharding


class ReplicaCheckpoints:
    """Mixed into ``OuterStepStrategy`` before ``DDPStrategy``; uses the strategy's ``driver``,
    ``algorithm``, replica counts and ``_resumed_outer``."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # per-replica weights land after setup's broadcast of rank 0's initial weights

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Writes this replica's file on every rank, then the main file (consensus weights) on rank 0.
        Collective: Lightning calls it on every rank. Sharded replicas: every rank writes its own
        shards, and the main file holds the full consensus model and no inner optimizer state."""
        path = checkpoints.local_path(filepath)
        save_id = self.broadcast(uuid.uuid4().hex[:12])
        averaged = self._checkpoint_consensus(checkpoint["state_dict"])
        outer = self.driver.state_dict() if self.driver is not None else []  # completes a round in flight
        replica = checkpoints.replica_payload(checkpoint, save_id, self.replica_index, self.num_replicas,
                                              self.algorithm.name, outer)
        sidecar_dir = checkpoints.sidecar_dir(path, save_id)
        sharded = self.sharding is not None
        shard = self.global_rank % self.ranks_per_replica if sharded else None
        if sharded:  # each rank its own shards, as plain tensors
            replica = {**sharding.local_tree(replica), "shard": shard}
            checkpoints.write_replica(sidecar_dir, self.replica_index, replica, shard)
        elif self.global_rank % self.ranks_per_replica == 0:  # one file per replica: its ranks hold the same state
            checkpoints.write_replica(sidecar_dir, self.replica_index, replica)
        self.barrier("lightning_loco.save_checkpoint")  # every replica file exists before the main file
        if self.is_global_zero:
            meta = checkpoints.main_meta(path, save_id, self.algorithm.name, self.num_replicas,
                                         shards=self.ranks_per_replica if sharded else None)
            main = {**checkpoint, "state_dict": averaged, checkpoints.META_KEY: meta}
            if sharded:
                main["optimizer_states"] = []  # sharded: in the replica files only
            self.checkpoint_io.save_checkpoint(main, path, storage_options=storage_options)
            checkpoints.remove_sidecars(path, keep=sidecar_dir)

    def _replica_shard(self) -> dict[str, int]:
        """``read_own_replica``'s arguments for this rank's file in a sharded replica (none otherwise)."""
        if self.sharding is None:
            return {}
        return {"shard": self.global_rank % self.ranks_per_replica, "shards": self.ranks_per_replica}

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            checkpoints.remove_sidecars(checkpoints.local_path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Loads the main file and, on every rank, that replica's own file. Collective.

        Only ``fit(ckpt_path=...)`` restores outer state (anchors, momenta, counters, a round in
        flight); ``validate``/``test``/``predict`` with a checkpoint load each replica's weights only.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        payload = checkpoints.read_own_replica(
            checkpoint, checkpoints.local_path(checkpoint_path), self.replica_index, self.num_replicas,
            self.algorithm.name, agree=consensus.first_error, **self._replica_shard(),
        )
        self._resumed_outer = None
        if payload is None:
            return checkpoint  # a plain checkpoint, or another number of replicas: every replica starts from it
        checkpoint["state_dict"] = payload["state_dict"]
        for key in ("optimizer_states", "lr_schedulers"):
            if payload.get(key) is not None:
                checkpoint[key] = payload[key]
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._resumed_outer = payload["outer"]
        else:
            self._trained_module = None  # the weights are the checkpoint's now: a later fit starts from rank 0's
        return checkpoint
