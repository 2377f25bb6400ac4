"""Fabric's ``fabric.save`` and ``fabric.load`` of every replica's own file and the consensus main file.

The save and the load of the replica payloads are the replica's (:meth:`~lightning_loco.replica.replica.Replica.save`,
:meth:`~lightning_loco.replica.replica.Replica.load`), the same as the Trainer's strategies use; this class only
connects them to Fabric's ``Strategy`` hooks (Fabric calls each of them on every rank) and restores the objects of
the state ``fabric.load`` is given.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_loco import _compat
from lightning_loco.replica import checkpoints
from lightning_loco.replica.replica import Replica


class ReplicaCheckpoints(DDPStrategy):
    """The checkpoint hooks of :class:`~lightning_loco.fabric.strategy.FabricOuterStepStrategy` (its base)."""

    replica: Replica  # FabricOuterStepStrategy's, which these hooks use

    # ------------------------------------------------------------------ checkpoints (collective)

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Every replica's own file (the state as ``fabric.save`` was given it, and the outer state; with
        ``replica_sharding`` every rank's own shards), then the main file on global rank 0: the same state with each
        module's weights the replicas' average (full tensors; sharded inner optimizer states stay in the replica
        files). Collective."""
        converted = _compat.convert_stateful_objects(self, state, filter or {})

        def main_consensus() -> dict[str, Any]:
            averaged = {}
            for key, value in converted.items():
                if isinstance(state[key], nn.Module):
                    averaged[key] = self.replica.consensus_state_dict(value)
                elif not (self.replica.layout.sharded and isinstance(state[key], Optimizer)):
                    averaged[key] = value
            return averaged

        def write_main(averaged: dict[str, Any], meta: dict[str, Any]) -> None:
            self.checkpoint_io.save_checkpoint({**averaged, checkpoints.META_KEY: meta}, path,
                                               storage_options=storage_options)

        self.replica.save(path, {"state_dict": converted}, main_consensus, write_main)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restores ``state`` from this replica's own file, and the outer state (taken up at the next optimizer
        step); a checkpoint of another number of replicas restores every replica from the main file's average,
        with fresh outer state. Collective."""
        if self.replica.run is not None:
            raise RuntimeError(f"{type(self).__name__}: load checkpoints before training starts (before the first "
                               "optimizer.step()), so that the outer state starts from them.")
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        payload = self.replica.load(checkpoint, path)
        sharded_main = payload is None and (checkpoint.get(checkpoints.META_KEY) or {}).get("shards") is not None
        checkpoint.pop(checkpoints.META_KEY, None)
        if payload is not None:
            checkpoint = dict(payload["state_dict"])
        if not state:
            return checkpoint
        if isinstance(state, (nn.Module, Optimizer)):
            raise TypeError(f"{type(self).__name__} loads a checkpoint into a dict of objects, as fabric.save was "
                            "given one: fabric.load(path, {'model': model, 'optimizer': optimizer, ...}).")
        fresh = [k for k, v in state.items() if sharded_main and isinstance(v, Optimizer) and k not in checkpoint]
        if fresh:  # a sharded run's main file keeps no inner optimizer state (its shards are in the replica files)
            rank_zero_warn(f"{path} holds no state for {fresh} (a main file written with replica_sharding): "
                           "they start fresh, as the Trainer's inner optimizers do from such a file.")
        return _restore(self, state, checkpoint, strict, skip=fresh)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """As the replica's layout loads a module (sharded: shard by shard, from this rank's own shards or from
        full tensors, a main file)."""
        self.replica.layout.load_module_state(module, state_dict, strict)


def _restore(strategy: ReplicaCheckpoints, state: dict[str, Any], checkpoint: dict[str, Any],
             strict: bool, skip: list[str]) -> dict[str, Any]:
    """Fabric's restore of ``state``'s objects from ``checkpoint`` (modules, optimizers, stateful objects; other
    values replaced in ``state``), but for the keys in ``skip``; returns what ``state`` did not ask for."""
    _compat.validate_keys_for_strict_loading([k for k in state if k not in skip], checkpoint.keys(), strict)
    for name, obj in state.copy().items():
        if name not in checkpoint:
            continue
        if isinstance(obj, nn.Module):
            strategy.load_module_state_dict(module=obj, state_dict=checkpoint.pop(name), strict=strict)
        elif isinstance(obj, Optimizer):  # sharded replicas: this rank's shards become DTensors like its parameters
            obj.load_state_dict(strategy.replica.layout.optimizer_state(obj, checkpoint.pop(name)))
        elif _compat.is_stateful(obj):
            obj.load_state_dict(checkpoint.pop(name))
        else:
            state[name] = checkpoint.pop(name)
    return checkpoint
