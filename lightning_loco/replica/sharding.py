"""FSDP2 inside each replica (``replica_sharding="fsdp"``): the model as this rank's local shards.

A replica of k ranks shards its model with FSDP2's ``fully_shard`` over its own k ranks: every
parameter is a ``DTensor`` of which this rank holds one part (``to_local()``), and so are its
gradient and its inner optimizer state. FSDP2's all-gathers and reduce-scatters run on the replica's
own device mesh, never across replicas. The outer step runs on the local shards: rank j of every
replica holds the same part of the model (checked once at setup, :func:`check_same_layout`), so rank j
exchanges its part with rank j of its partners over the slice group and nothing is gathered.

This module holds what that needs, without Lightning: the replica's device mesh (named like
Lightning's ``ModelParallelStrategy``'s), the automatic sharding policy, the setup checks, the
tensors the consensus averages, and the local form of state dicts that the replica files keep (plain
tensors, loadable with ``torch.load(weights_only=True)``) with the way back into the model and its
optimizers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_loco.driver.flat import FlatParameters
from lightning_loco.replica import consensus
from lightning_loco.replica.options import Block, FSDPConfig

MESH_DIMS = ("data_parallel", "tensor_parallel")  # as Lightning's ModelParallelStrategy names them


# ---------------------------------------------------------------- the mesh

@dataclass
class ReplicaMesh:
    """The process groups of a sharded replica: the (k, 1) device mesh FSDP2 runs on, and the slice
    group (this rank's counterparts in every replica; ``None`` with k = 1: all ranks) over which the
    consensus averages local shards."""

    mesh: Any
    slice_group: Optional[Any]


# (id of the default group, ...) -> (that group, the mesh): holding the group keeps its id from being
# reused by a later default group, whose ranks then get meshes of their own
_MESHES: dict[tuple[Any, ...], tuple[Any, ReplicaMesh]] = {}


def replica_mesh(device_type: str, ranks_per_replica: int, backend: str, timeout: Any) -> ReplicaMesh:
    """This rank's replica as a 2-D ``DeviceMesh`` of shape (k, 1) named ("data_parallel",
    "tensor_parallel"), as Lightning's ``ModelParallelStrategy`` names its mesh: the data-parallel
    dimension is the replica's own k ranks; tensor parallelism has size 1. With it, the slice group.

    The groups are created with local synchronisation (only their members meet, in the same order on
    every rank: replica, then this rank alone, then slice) and once per process: a model sharded on
    them keeps using them after ``fit`` (validation, a checkpoint written after ``fit``), so they live
    until the process ends, and later strategies in the same process get the same ones."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(dist.group.WORLD), device_type, ranks_per_replica, backend)
    if key not in _MESHES:
        k, rank, world = ranks_per_replica, dist.get_rank(), dist.get_world_size()
        first = rank - rank % k
        ranks = list(range(first, first + k))

        def group(members: list[int]) -> Any:
            return dist.new_group(members, backend=backend, timeout=timeout, use_local_synchronization=True)

        replica = group(ranks)
        alone = replica if k == 1 else group([rank])
        mesh = DeviceMesh.from_group([replica, alone], device_type, mesh=torch.tensor(ranks).view(k, 1),
                                     mesh_dim_names=MESH_DIMS)
        slice_group = None if k == 1 else group(list(range(rank % k, world, k)))
        _MESHES[key] = (dist.group.WORLD, ReplicaMesh(mesh, slice_group))
    return _MESHES[key][1]


# ---------------------------------------------------------------- sharding and its checks


def _is_block(module: nn.Module, blocks: Sequence[Block]) -> bool:
    return any(type(module).__name__ == b if isinstance(b, str) else isinstance(module, b) for b in blocks)


def broadcast_whole(module: nn.Module, device: torch.device) -> None:
    """Every rank takes global rank 0's parameters and buffers, tensor by tensor (one broadcast each, through
    ``device``: a whole model is never copied at once), before the module is sharded; tensors on the meta
    device (``empty_init``) are left to be initialised where they land."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_meta or isinstance(tensor, DTensor):
                continue
            moved = tensor.detach().to(device)
            dist.broadcast(moved, src=0)
            if moved.data_ptr() != tensor.data_ptr():
                tensor.copy_(moved)


def auto_shard(module: nn.Module, mesh: Any, config: FSDPConfig, root_is_called: bool = False) -> None:
    """The automatic policy, for a module whose ``configure_model`` shards nothing: ``fully_shard``
    every submodule of a class in ``config.blocks`` (innermost first), then every direct child of
    ``module`` that still holds parameters of its own; a child that is an ``nn.Sequential`` is not one
    unit but its layers are (recursively), because a Sequential may end in a view (``Flatten``), whose
    pre-backward hook FSDP2 would drop, while a layer that holds parameters returns a new tensor.

    Parameters held by ``module`` itself: with ``root_is_called`` (a Fabric loop calls ``model(x)``)
    ``module`` becomes the last unit; otherwise they are refused, since Lightning calls
    ``training_step``, not the module, so FSDP2 could not gather them."""
    from torch.distributed.fsdp import fully_shard

    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own and not root_is_called:
        raise ValueError(
            f"replica_sharding='fsdp': the LightningModule holds parameters itself ({own[:3]}); FSDP2 shards "
            "submodules. Move them into a submodule, or shard them yourself in configure_model."
        )
    for sub in reversed(list(module.modules())):  # descendants before their ancestors
        if sub is not module and _is_block(sub, config.blocks):
            fully_shard(sub, mesh=mesh, **config.kwargs)
    for unit in _units(module):
        fully_shard(unit, mesh=mesh, **config.kwargs)
    if own:
        fully_shard(module, mesh=mesh, **config.kwargs)


def _units(module: nn.Module) -> Iterator[nn.Module]:
    """The automatic policy's units below ``module``: its children that hold unsharded parameters, with an
    ``nn.Sequential`` opened into its own children."""
    for child in module.children():
        if not any(not isinstance(p, DTensor) for p in child.parameters()):
            continue
        if isinstance(child, nn.Sequential) and not any(True for _ in child.parameters(recurse=False)):
            yield from _units(child)
        else:
            yield child


def reshard(module: nn.Module) -> None:
    """Drops the unsharded parameters FSDP2 may still hold (the root keeps them after a forward
    without backward), so that ``parameters()`` are the sharded ones and the next forward gathers
    what the shards hold now. Local: no collective."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def check_sharded(module: nn.Module, replica_ranks: Sequence[int]) -> None:
    """Every parameter must be a ``DTensor`` on this replica's ranks: a parameter no ``fully_shard``
    manages would not have its gradients averaged inside the replica, and a mesh beyond the replica
    would put FSDP's collectives across replicas."""
    loose = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
    if loose:
        raise ValueError(
            f"replica_sharding='fsdp': {len(loose)} parameter(s) are not sharded, e.g. {loose[:3]}: no fully_shard "
            "manages them, so the ranks of a replica would not average their gradients. In configure_model call "
            "fully_shard(module, mesh=self.device_mesh['data_parallel']) on every module that holds parameters "
            "(the outermost last), or write no configure_model and let the automatic policy (FSDPConfig.blocks) do it."
        )
    expected = sorted(replica_ranks)
    for name, p in module.named_parameters():
        ranks = sorted(cast(DTensor, p).device_mesh.mesh.flatten().tolist())
        if ranks != expected:
            raise ValueError(
                f"replica_sharding='fsdp': parameter {name!r} is sharded over ranks {ranks}, but this replica is "
                f"ranks {expected}: FSDP's collectives must stay inside the replica. Shard with "
                "mesh=self.device_mesh['data_parallel'] (the mesh the strategy gives the module)."
            )


def layout(module: nn.Module) -> list[tuple[str, tuple[int, ...], tuple[int, ...], str]]:
    """(name, local shape, global shape, placements) of every parameter: what rank j of each replica
    must hold alike for the outer step on local shards to pair equal parts."""
    out = []
    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        placements = str(tuple(p.placements)) if isinstance(p, DTensor) else "whole"
        out.append((name, tuple(local.shape), tuple(p.shape), placements))
    return out


def check_same_layout(module: nn.Module, group: Optional[Any], replica: int) -> None:
    """Compares this rank's :func:`layout` with the same rank of every replica (one
    ``all_gather_object`` over the slice ``group``) and raises ``ValueError`` naming the first
    difference: every replica must shard alike (same k, same placements). Every rank raises the same
    error (one more ``all_gather_object`` of the verdicts over all ranks), so that no rank goes on to
    wait for one that stopped. Both at setup only."""
    mine = layout(module)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    message = None
    for other, theirs in enumerate(every):
        if theirs != mine:
            diff = next((f"{a} here, {b} there" for a, b in zip(mine, theirs) if a != b),
                        f"{len(mine)} parameters here, {len(theirs)} there")
            low, high = sorted((replica, other))
            message = (
                f"replica_sharding='fsdp': replica {low} and replica {high} shard the model differently ({diff}, "
                f"seen from replica {replica}). Every replica must shard identically (the same fully_shard calls, "
                "placements and ranks_per_replica), since rank j of each replica exchanges its own shards with "
                "rank j of the others."
            )
            break
    message = consensus.first_error(message)
    if message is not None:
        raise ValueError(message)


# ---------------------------------------------------------------- the consensus


def consensus_parts(module: nn.Module, slice_group: Optional[Any]) -> list[tuple[list[Tensor], Optional[Any]]]:
    """The tensors the consensus averages, each list with its group: the local shards of the
    parameters over the slice group (the same part of every replica), and the tensors every rank
    holds whole (buffers) over all ranks."""
    reshard(module)
    tensors = list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]
    shards = [t.to_local() for t in tensors if isinstance(t, DTensor)]
    whole = [t for t in tensors if not isinstance(t, DTensor)]
    return [(shards, slice_group), (whole, None)]


def consensus_state_dict(
    state: Mapping[str, Any], device: torch.device, slice_group: Optional[Any], gather: bool, keep: bool
) -> Optional[dict[str, Any]]:
    """The replicas' average of a sharded state dict as full, unsharded CPU tensors (the consensus
    model of a checkpoint's main file). Every rank averages its local shards over ``slice_group`` and
    its whole tensors over all ranks; the ranks of one replica (``gather``) then assemble the full
    tensors, inside that replica, and the rank that writes the file (``keep``) keeps them. Returns
    ``None`` where ``keep`` is false."""
    shard_keys = [k for k, v in state.items() if isinstance(v, DTensor) and v.is_floating_point()]
    whole_keys = [k for k, v in state.items()
                  if torch.is_tensor(v) and not isinstance(v, DTensor) and v.is_floating_point()]
    averaged: dict[str, Tensor] = {}
    for keys, group, local in ((shard_keys, slice_group, True), (whole_keys, None, False)):
        if keys:
            flat, avg = consensus.mean([state[k].to_local() if local else state[k] for k in keys], device, group)
            averaged.update(zip(keys, flat.views(avg)))
    if not gather:
        return None
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            mine = averaged[key].to(value.dtype) if key in averaged else value.to_local()
            mine = mine.to(value.to_local().device)
            full = DTensor.from_local(mine, value.device_mesh, value.placements, shape=value.shape,
                                      stride=value.stride(), run_check=False).full_tensor()
            out[key] = full.cpu() if keep else None
        elif key in averaged:
            out[key] = averaged[key].to(value.dtype).cpu().clone()
        else:
            out[key] = value
    return out if keep else None


def broadcast_first_replica(module: nn.Module, device: torch.device, slice_group: Optional[Any], k: int) -> None:
    """Every replica takes replica 0's weights, as DDP takes rank 0's: rank j's local shards from
    global rank j over the slice group (one broadcast), the tensors held whole from rank 0."""
    reshard(module)
    tensors = list(module.parameters()) + list(module.buffers())
    shards = [t.to_local() for t in tensors if isinstance(t, DTensor)]
    whole = [t for t in tensors if not isinstance(t, DTensor)]
    for part, group, src in ((shards, slice_group, dist.get_rank() % k), (whole, None, 0)):
        floats = [t for t in part if t.is_floating_point()]
        if floats:
            flat = FlatParameters(floats, device)
            buf = flat.gather()
            dist.broadcast(buf, src=src, group=group)
            flat.scatter(buf)
        for t in (t for t in part if not t.is_floating_point()):
            moved = t.to(device)
            dist.broadcast(moved, src=src, group=group)
            t.copy_(moved)
    reshard(module)


# ---------------------------------------------------------------- state dicts in local form


def local_tree(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every ``DTensor`` replaced by this rank's local
    tensor: what a replica file of this rank keeps."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach()
    if isinstance(obj, dict):
        return type(obj)((k, local_tree(v)) for k, v in obj.items())  # an OrderedDict stays one
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tree(v) for v in obj)
    return obj


def _local_part(target: DTensor, value: Tensor, what: str) -> Tensor:
    """This rank's part of ``value`` for ``target``: ``value`` itself when it is the local shard (a
    replica file of this rank), the local chunk when it is the full tensor (a main file, a plain
    Lightning checkpoint)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    local = target.to_local()
    if value.shape == local.shape:
        return value
    if value.shape == target.shape:
        full = value.to(device=local.device, dtype=local.dtype)
        return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    raise ValueError(
        f"{what}: the checkpoint holds shape {tuple(value.shape)}, this rank's shard is {tuple(local.shape)} of "
        f"{tuple(target.shape)}: it was written with another sharding. Resume with the same ranks_per_replica "
        "and replica_sharding, or start a new run from the checkpoint's consensus model."
    )


def load_state_dict(module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Loads a state dict of local shards or of full tensors into a sharded module, shard by shard
    (no collective)."""
    reshard(module)
    targets = module.state_dict(keep_vars=True)
    missing = [k for k in targets if k not in state_dict]
    unexpected = [k for k in state_dict if k not in targets]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing}, unexpected keys "
            f"{unexpected}."
        )
    with torch.no_grad():
        for key, target in targets.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if isinstance(target, DTensor):
                target.to_local().copy_(_local_part(target, value, f"state_dict[{key!r}]"))
            else:
                target.copy_(value)


def optimizer_state_to_shards(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict of local shards or of full tensors made fit for ``optimizer`` over
    sharded parameters: each state tensor shaped like its parameter becomes a ``DTensor`` like it
    (FSDP2's inner optimizer state is sharded like the parameters); scalars (``step``) stay."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    by_id = dict(zip(ids, params))
    state: dict[Any, Any] = {}
    for pid, entry in saved["state"].items():
        p = by_id.get(pid)
        if not isinstance(p, DTensor):
            state[pid] = entry
            continue
        state[pid] = {}
        for name, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape in (p.to_local().shape, p.shape):
                local = _local_part(p, value, f"optimizer state {name!r}").to(p.to_local().device)
                value = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                           run_check=False)
            state[pid][name] = value
    return {**saved, "state": state}
