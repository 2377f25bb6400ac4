"""FSDP2 inside each replica (``replica_sharding="fsdp"``): the Lightning side.

The module gets a device mesh named as Lightning's ``ModelParallelStrategy`` names its own
(``self.device_mesh["data_parallel"]`` is the replica's k ranks), so a ``configure_model`` written
for that strategy shards the model over the replica unchanged; a module without one is sharded by
the automatic policy (:func:`lightning_loco.sharding.auto_shard`). After that the strategy checks,
once at setup, that every parameter is sharded on the replica and that every replica shards alike,
and gives the driver each rank's local shards. The maths and the files are those of
:mod:`lightning_loco.sharding`; with ``sharding`` None every method here is today's behaviour
(DDP inside a replica).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_loco import consensus, sharding
from lightning_loco.flat import FlatParameters, ShardedParameters
from lightning_loco.sharding import ShardingConfig
from lightning_loco.strategies import _compat


class ReplicaSharding:
    """Mixed into ``OuterStepStrategy`` first; uses the strategy's ``sharding``, replica counts and
    process groups."""

    sharding: Optional[ShardingConfig]
    _replica_mesh: Optional[sharding.ReplicaMesh] = None

    @property
    def device_mesh(self) -> Any:
        """The replica's ("data_parallel", "tensor_parallel") mesh of shape (k, 1), with
        ``replica_sharding="fsdp"`` (also the module's ``self.device_mesh``)."""
        if self._replica_mesh is None:
            raise RuntimeError("The device mesh exists with replica_sharding='fsdp' only, once the processes started.")
        return self._replica_mesh.mesh

    @property
    def _slice_group(self) -> Optional[Any]:
        """Where local shards are averaged: rank j of every replica (it outlives ``fit``)."""
        assert self._replica_mesh is not None
        return self._replica_mesh.slice_group

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()  # type: ignore[misc]
        if self.sharding is not None:
            self._replica_mesh = sharding.replica_mesh(
                self.root_device.type, self.ranks_per_replica, self._get_process_group_backend(),
                self._replica_timeout(),  # type: ignore[attr-defined]
            )
            if self.lightning_module is not None:
                self.lightning_module._device_mesh = self.device_mesh  # what configure_model reads

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        if self.sharding is None:
            with super().tensor_init_context(empty_init):  # type: ignore[misc]
                yield
            return
        # As ModelParallelStrategy: layers are built where they are (on the meta device with
        # empty_init=True), not whole on the accelerator; fully_shard moves each rank's shards there.
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def configure_ddp(self) -> None:
        if self.sharding is None:
            super().configure_ddp()  # type: ignore[misc]
        # Sharded: FSDP2 reduce-scatters the gradients inside the replica; no DDP wrapper.

    def _prepare_model(self) -> None:
        """Shards the module (automatic policy when ``configure_model`` sharded nothing), checks it,
        materializes meta-device parameters. The layout check is one ``all_gather_object`` over the
        slice group, here at setup only."""
        if self.sharding is None:
            super()._prepare_model()  # type: ignore[misc]
            return
        module = self.lightning_module
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            sharding.auto_shard(module, self.device_mesh["data_parallel"], self.sharding)
        sharding.reshard(module)
        k, first = self.ranks_per_replica, self.replica_index * self.ranks_per_replica
        sharding.check_sharded(module, range(first, first + k))
        sharding.check_same_layout(module, self._slice_group, self.replica_index)
        _compat.materialize_sharded_module(module, self.root_device)

    def _sync_initial_weights(self) -> None:
        """Every replica starts from replica 0's weights (DDP inside: rank 0's)."""
        if self.sharding is None:
            super()._sync_initial_weights()  # type: ignore[misc]
            return
        sharding.broadcast_first_replica(self.lightning_module, self._comm_device(), self._slice_group,
                                         self.ranks_per_replica)

    def _flat_parameters(self, params: list[torch.Tensor]) -> FlatParameters:
        """An optimizer's parameters as the driver sees them: whole, or this rank's local shards."""
        if self.sharding is None:
            return FlatParameters(params, self.outer_state_device)
        return ShardedParameters(params, self.outer_state_device, after_scatter=self._weights_changed)

    def _transport_options(self) -> dict[str, Any]:
        """Sharded: each rank's buffer is its own part of the model (no slicing, no all-gather)."""
        return {"sharded": True} if self.sharding is not None else {}

    def _weights_changed(self) -> None:
        """After new values went into the local shards: FSDP2 drops unsharded copies it still holds."""
        if self.sharding is not None:
            sharding.reshard(self.lightning_module)

    # ------------------------------------------------------------------ the consensus

    def _consensus_parts(self) -> list[tuple[list[torch.Tensor], Optional[Any]]]:
        """The tensors the consensus averages, each with the group it is averaged over (None: all)."""
        if self.sharding is None:
            return super()._consensus_parts()  # type: ignore[misc]
        return sharding.consensus_parts(self.lightning_module, self._slice_group)

    def replica_spread(self) -> float:
        if self.sharding is None:
            return super().replica_spread()  # type: ignore[misc]
        shards, group = sharding.consensus_parts(self.lightning_module, self._slice_group)[0]
        return consensus.spread(shards, self._comm_device(), group, replicas=self.num_replicas)

    def _checkpoint_consensus(self, state: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The main file's consensus model: today's averaged state dict, or, sharded, the full
        unsharded average assembled inside replica 0 (``None`` on every rank but global rank 0)."""
        if self.sharding is None:
            return consensus.state_dict(state, self._comm_device())
        return sharding.consensus_state_dict(state, self._comm_device(), self._slice_group,
                                             gather=self.replica_index == 0, keep=self.is_global_zero)

    # ------------------------------------------------------------------ loading

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.sharding is None:
            super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]
            return
        sharding.load_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.sharding is None:
            super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
            return
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(sharding.optimizer_state_to_shards(optimizer, saved))
        _compat.optimizers_to_device(self.optimizers, self.root_device)
