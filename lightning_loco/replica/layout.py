"""How a replica lays out its model over its ranks: whole on every rank (DDP inside, the default) or
sharded by FSDP2 (``replica_sharding="fsdp"``).

A strategy holds one :class:`ReplicaLayout` and asks it, instead of branching on the layout, for
whatever differs: how the model is prepared and where it starts from, the flat parameters the driver
steps, the tensors the consensus averages, the consensus model of a checkpoint's main file, and how
state dicts load. :class:`WholeReplicas` is every rank holding the replica's whole model (with k > 1
ranks, torch's ``DistributedDataParallel`` over the replica's own group); :class:`ShardedReplicas` is
FSDP2 over the replica's k ranks, with the outer step on each rank's local shards
(:mod:`lightning_loco.replica.sharding` holds the maths and the files, without Lightning).

Where a layout keeps Lightning's own behaviour it calls the ``default`` it is given (the strategy's
``super()`` method), so that nothing here subclasses Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Optional, Protocol

import torch
from torch.distributed.tensor import DTensor

from lightning_loco import _compat
from lightning_loco.driver.flat import FlatParameters, ShardedParameters
from lightning_loco.replica import consensus, sharding
from lightning_loco.replica.options import FSDPConfig


class Host(Protocol):
    """The replica (:class:`~lightning_loco.replica.replica.Replica`), as its layout sees it."""

    @property
    def ranks_per_replica(self) -> int: ...

    @property
    def module(self) -> Any:
        """The model the replica trains, unwrapped (None before the loop gave it)."""

    @property
    def root_device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def replica_index(self) -> int: ...

    @property
    def num_replicas(self) -> int: ...

    @property
    def outer_state_device(self) -> torch.device: ...

    def comm_device(self) -> torch.device: ...


class ReplicaLayout:
    """Every rank holds its replica's whole model (DDP inside a replica of several ranks)."""

    sharded = False

    def __init__(self, host: Host) -> None:
        self.host = host

    def setup_distributed(self, backend: str, timeout: Any) -> None:
        """After the process groups exist: the layout's own groups."""

    @property
    def device_mesh(self) -> Any:
        raise RuntimeError("The device mesh exists with replica_sharding='fsdp' only, once the processes started.")

    def tensor_init_context(self, empty_init: Optional[bool],
                            default: Callable[[Optional[bool]], AbstractContextManager[None]],
                            precision: Callable[[], AbstractContextManager[None]]) -> AbstractContextManager[None]:
        """Where the model's layers are built: the strategy's ``default``, or (sharded) ``precision``'s context."""
        return default(empty_init)

    def configure_ddp(self, default: Callable[[], None]) -> None:
        """With k > 1 ranks, torch's ``DistributedDataParallel`` over the replica's own group (``default``)."""
        if self.host.ranks_per_replica > 1:
            default()

    def prepare_model(self) -> None:
        """Before the precision plugin and the device move."""

    def sync_initial_weights(self) -> None:
        """Every replica starts from global rank 0's weights, as ``DistributedDataParallel`` would."""
        _compat.sync_module_states(self.host.module)

    def flat_parameters(self, params: list[torch.Tensor]) -> FlatParameters:
        """An optimizer's parameters as the driver sees them."""
        return FlatParameters(params, self.host.outer_state_device)

    def transport_options(self) -> dict[str, Any]:
        return {}

    def weights_changed(self) -> None:
        """Called after new values went into the model."""

    def consensus_parts(self) -> list[tuple[list[torch.Tensor], Optional[Any]]]:
        """The tensors the consensus averages, each with the group it is averaged over (None: all ranks):
        the parameters and the floating-point buffers."""
        module = self.host.module
        return [(list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()], None)]

    def replica_spread(self) -> float:
        return consensus.spread(list(self.host.module.parameters()), self.host.comm_device())

    def checkpoint_consensus(self, state: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The main file's consensus model (a collective)."""
        return consensus.state_dict(state, self.host.comm_device())

    def replica_file(self, replica: dict[str, Any]) -> tuple[Optional[dict[str, Any]], Optional[int]]:
        """What this rank writes as its replica's file, and the shard it is (None: the replica's one file,
        written by its first rank; nothing on the others)."""
        if self.host.global_rank % self.host.ranks_per_replica:
            return None, None
        return replica, None

    def shards(self) -> Optional[int]:
        """The number of shards of each replica's files (None: one file per replica)."""
        return None

    def replica_shard(self) -> dict[str, int]:
        """``checkpoints.read_own_replica``'s arguments for this rank's file."""
        return {}

    def main_file(self, main: dict[str, Any]) -> dict[str, Any]:
        """The main file as it is written (the consensus model and Lightning's state)."""
        return main

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool,
                              default: Callable[..., None]) -> None:
        default(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any], optimizers: list[Any],
                                  default: Callable[[Mapping[str, Any]], None]) -> None:
        default(checkpoint)

    def export_tree(self, state: dict[str, Any]) -> dict[str, Any]:
        """A training state as a joiner of an elastic run receives it (see ``training_state``)."""
        return state

    def module_state(self) -> Optional[list[Any]]:
        """How this rank's part of the model is laid out (None: whole)."""
        return None

    def load_module_state(self, module: Any, state: Mapping[str, Any], strict: bool = False) -> None:
        """Loads ``state`` into ``module`` (any module of this layout, not only the trained one)."""
        module.load_state_dict(state, strict=strict)

    def optimizer_state(self, optimizer: Any, saved: Any) -> Any:
        return saved


class ShardedReplicas(ReplicaLayout):
    """FSDP2 shards the model, its gradients and inner optimizer state over the replica's k ranks; the
    outer step runs on each rank's local shards (rank j meets rank j of its partners over the slice
    group, nothing is gathered).

    The module gets a device mesh named as Lightning's ``ModelParallelStrategy`` names its own
    (``self.device_mesh["data_parallel"]`` is the replica's k ranks), so a ``configure_model`` written
    for that strategy shards the model over the replica unchanged; a module without one is sharded by
    the automatic policy (:func:`lightning_loco.replica.sharding.auto_shard`). The layout is checked once, at
    setup: every parameter sharded on the replica, and every replica sharded alike."""

    sharded = True

    def __init__(self, host: Host, config: FSDPConfig, root_is_called: bool = False) -> None:
        super().__init__(host)
        self.config = config
        self.root_is_called = root_is_called  # Fabric: the loop calls the module itself (see auto_shard)
        self._mesh: Optional[sharding.ReplicaMesh] = None

    def setup_distributed(self, backend: str, timeout: Any) -> None:
        host = self.host
        self._mesh = sharding.replica_mesh(host.root_device.type, host.ranks_per_replica, backend, timeout)
        if host.module is not None:
            host.module._device_mesh = self.device_mesh  # what configure_model reads

    @property
    def device_mesh(self) -> Any:
        """The replica's ("data_parallel", "tensor_parallel") mesh of shape (k, 1) (the module's too)."""
        if self._mesh is None:
            return super().device_mesh
        return self._mesh.mesh

    @property
    def slice_group(self) -> Optional[Any]:
        """Where local shards are averaged: rank j of every replica (it outlives ``fit``)."""
        assert self._mesh is not None
        return self._mesh.slice_group

    def tensor_init_context(self, empty_init: Optional[bool],
                            default: Callable[[Optional[bool]], AbstractContextManager[None]],
                            precision: Callable[[], AbstractContextManager[None]]) -> AbstractContextManager[None]:
        return self._build_where_they_are(empty_init, precision)

    @contextmanager
    def _build_where_they_are(self, empty_init: Optional[bool],
                              precision: Callable[[], AbstractContextManager[None]]) -> Generator[None, None, None]:
        # As ModelParallelStrategy: layers are built where they are (on the meta device with
        # empty_init=True), not whole on the accelerator; fully_shard moves each rank's shards there.
        with torch.device("meta") if empty_init else nullcontext(), precision():
            yield

    def configure_ddp(self, default: Callable[[], None]) -> None:
        """FSDP2 reduce-scatters the gradients inside the replica; no DDP wrapper."""

    def prepare_model(self) -> None:
        """Shards the module (the automatic policy when ``configure_model`` sharded nothing; every rank first
        takes global rank 0's full weights, as DDP inside does), checks it and materializes
        meta-device parameters. The layout check is one ``all_gather_object`` over the slice group, here
        at setup only."""
        host = self.host
        module = host.module
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            sharding.broadcast_whole(module, host.comm_device())  # every rank starts from global rank 0's weights
            sharding.auto_shard(module, self.device_mesh["data_parallel"], self.config, self.root_is_called)
        sharding.reshard(module)
        k, first = host.ranks_per_replica, host.replica_index * host.ranks_per_replica
        sharding.check_sharded(module, range(first, first + k))
        sharding.check_same_layout(module, self.slice_group, host.replica_index)
        _compat.materialize_sharded_module(module, host.root_device)

    def sync_initial_weights(self) -> None:
        """Every replica starts from replica 0's weights (its shards, rank by rank)."""
        host = self.host
        sharding.broadcast_first_replica(host.module, host.comm_device(), self.slice_group,
                                         host.ranks_per_replica)

    def flat_parameters(self, params: list[torch.Tensor]) -> FlatParameters:
        """This rank's local shards."""
        return ShardedParameters(params, self.host.outer_state_device, after_scatter=self.weights_changed)

    def transport_options(self) -> dict[str, Any]:
        """Each rank's buffer is its own part of the model (no slicing, no all-gather)."""
        return {"sharded": True}

    def weights_changed(self) -> None:
        """FSDP2 drops unsharded copies it still holds."""
        sharding.reshard(self.host.module)

    def consensus_parts(self) -> list[tuple[list[torch.Tensor], Optional[Any]]]:
        return sharding.consensus_parts(self.host.module, self.slice_group)

    def replica_spread(self) -> float:
        shards, group = sharding.consensus_parts(self.host.module, self.slice_group)[0]
        return consensus.spread(shards, self.host.comm_device(), group, replicas=self.host.num_replicas)

    def checkpoint_consensus(self, state: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The full unsharded average, assembled inside replica 0 (``None`` on every rank but global rank 0)."""
        host = self.host
        return sharding.consensus_state_dict(state, host.comm_device(), self.slice_group,
                                             gather=host.replica_index == 0, keep=host.is_global_zero)

    def replica_file(self, replica: dict[str, Any]) -> tuple[Optional[dict[str, Any]], Optional[int]]:
        """Every rank its own shards, as plain tensors."""
        shard = self.host.global_rank % self.host.ranks_per_replica
        return {**sharding.local_tree(replica), "shard": shard}, shard

    def shards(self) -> Optional[int]:
        return self.host.ranks_per_replica

    def replica_shard(self) -> dict[str, int]:
        k = self.host.ranks_per_replica
        return {"shard": self.host.global_rank % k, "shards": k}

    def main_file(self, main: dict[str, Any]) -> dict[str, Any]:
        return {**main, "optimizer_states": []}  # the inner optimizers' shards are in the replica files only

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool,
                              default: Callable[..., None]) -> None:
        sharding.load_state_dict(self.host.module, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any], optimizers: list[Any],
                                  default: Callable[[Mapping[str, Any]], None]) -> None:
        for optimizer, saved in zip(optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(sharding.optimizer_state_to_shards(optimizer, saved))
        _compat.optimizers_to_device(optimizers, self.host.root_device)

    def export_tree(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's local shards as plain tensors, and how the model is sharded."""
        return {**sharding.local_tree(state), "layout": sharding.layout(self.host.module)}

    def module_state(self) -> Optional[list[Any]]:
        return sharding.layout(self.host.module)

    def load_module_state(self, module: Any, state: Mapping[str, Any], strict: bool = False) -> None:
        sharding.load_state_dict(module, state, strict=strict)  # shard by shard, into this rank's DTensors

    def optimizer_state(self, optimizer: Any, saved: Any) -> Any:
        return sharding.optimizer_state_to_shards(optimizer, saved)


def replica_layout(host: Host, config: Optional[FSDPConfig], root_is_called: bool = False) -> ReplicaLayout:
    """The layout of ``replica_sharding``'s option: whole replicas (None) or FSDP2 inside each
    (``root_is_called``: the loop calls the module itself, as a Fabric loop does)."""
    return ReplicaLayout(host) if config is None else ShardedReplicas(host, config, root_is_called)
