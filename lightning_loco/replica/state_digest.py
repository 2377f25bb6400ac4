"""Cheap digests of the state that must agree, so that a run can check it instead of trusting it.

A digest is two 64-bit integers per tensor, computed where the tensor lives (no copy to the host): the sum of its
words, and the sum of each word times its position (both modulo 2**64, so the order of the additions does not
matter and every device gets the same numbers). Any change of a bit changes the first; a swap of two words changes
the second. It is a check against mistakes (a wrong tensor loaded, a replica left behind), not against an
adversary.

* :func:`compare_over_world` all-gathers every rank's digests (one int64 tensor of 2 numbers per tensor, over the
  default group) and raises :class:`StateMismatchError` naming the first replica, tensor and step that differ from
  replica 0's (ranks holding the same part of the model are compared: rank j of each replica);
* :func:`first_difference` compares this rank's digests with saved ones (a checkpoint's).

Lightning-free: the callback is :class:`lightning_loco.trainer.verify.VerifyState`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["StateMismatchError", "compare_over_world", "digest", "digests", "first_difference"]

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class StateMismatchError(RuntimeError):
    """State that must agree (the replicas' weights after a DiLoCo round, a resumed run's against its checkpoint)
    does not."""


def digest(tensor: Tensor) -> tuple[int, int]:
    """The tensor's two numbers (see the module docstring), from its bytes as they are, whatever the dtype."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    flat = local.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0, 0
    words = flat.view(_WORDS.get(flat.element_size(), torch.uint8)) if flat.dtype != torch.bool else flat
    values = words.to(torch.int64)
    positions = torch.arange(1, values.numel() + 1, dtype=torch.int64, device=values.device)
    return int(values.sum()), int((values * positions).sum())


def digests(named: Iterable[tuple[str, Any]]) -> dict[str, tuple[int, int]]:
    """Each named tensor's digest (entries that are not tensors are left out)."""
    return {name: digest(value) for name, value in named if isinstance(value, Tensor)}


def first_difference(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> Optional[str]:
    """The first name (in ``expected``'s order) whose digest differs or is missing in ``actual``; ``None`` when they
    agree. Names only in ``actual`` count too, after those."""
    for name, value in expected.items():
        if name not in actual or tuple(actual[name]) != tuple(value):
            return name
    extra = [name for name in actual if name not in expected]
    return extra[0] if extra else None


def compare_over_world(mine: Mapping[str, tuple[int, int]], device: torch.device, ranks_per_replica: int,
                       step: int, what: str = "weights") -> None:
    """All-gathers every rank's digests and raises :class:`StateMismatchError` on every rank if a replica's differ
    from replica 0's (each rank against rank ``r % k`` of replica 0). Collective over the default group: every rank
    must call it, with digests of the same names in the same order."""
    names = list(mine)
    flat = torch.tensor([n for name in names for n in mine[name]], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    for rank, theirs in enumerate(everyone):
        reference = everyone[rank % ranks_per_replica]
        if torch.equal(theirs, reference):
            continue
        index = int((theirs != reference).nonzero()[0, 0]) // 2
        got, want = (tuple(t[2 * index:2 * index + 2].tolist()) for t in (theirs, reference))
        raise StateMismatchError(
            f"Replica {rank // ranks_per_replica} (rank {rank}) holds {what} that differ from replica 0's at step "
            f"{step}: tensor {names[index]!r} is not the same (digests {got} against {want}). After a DiLoCo round "
            "every replica holds the same weights; look for a replica that loaded other state or missed a round."
        )
