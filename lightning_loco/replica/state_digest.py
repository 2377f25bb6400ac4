"""Cheap digests of the state that must agree, so that a run can check it instead of trusting it.

A digest is two 64-bit integers per tensor, computed where the tensor lives (no copy to the host): the sum of its
words, and the sum of each word times its position (both modulo 2**64, so the order of the additions does not
matter and every device gets the same numbers). Any change of a bit changes the first; a swap of two words changes
the second. It is a check against mistakes (a wrong tensor loaded, a replica left behind), not against an
adversary.

* :func:`compare_over_world` all-gathers every rank's digests (one int64 tensor of 2 numbers per tensor, over the
  default group) and raises :class:`StateMismatchError` naming the first replica, tensor and step that differ from
  replica 0's (ranks holding the same part of the model are compared: rank j of each replica);
* :func:`first_difference` compares this rank's digests with saved ones (a checkpoint's, or those a heal's donor
  sent with its state: :mod:`lightning_loco.elastic.heal_digests`).

Lightning-free: the callback is :class:`lightning_loco.trainer.verify.VerifyState`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Scratch", "StateMismatchError", "compare_over_world", "digest", "digests", "first_difference"]

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK_WORDS = 2**18  # words digested at a time on a CPU: 2 MiB of int64, which its cache holds


class StateMismatchError(RuntimeError):
    """State that must agree (the replicas' weights after a DiLoCo round, a resumed run's against its checkpoint)
    does not."""


Scratch = dict[torch.device, tuple[Tensor, Tensor]]  # per device: positions 1, 2, ... and an int64 buffer


def digest(tensor: Tensor, scratch: Optional[Scratch] = None) -> tuple[int, int]:
    """The tensor's two numbers (see the module docstring), from its bytes as they are, whatever the dtype.

    Its words are taken ``CHUNK_WORDS`` at a time (16 × that on an accelerator), so the int64 temporaries stay
    that small whatever the tensor's size: on a CPU they stay in its cache (about 0.7-1 ns a word on one
    thread, where the whole tensor at once took 11). ``scratch`` (a dict, empty at first) keeps them for the
    next tensors of one pass (:func:`digests`): a fresh buffer's first touch would cost more than the sums.
    The numbers do not depend on the cut."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    flat = local.detach().contiguous().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0, 0
    words = flat.view(_WORDS.get(flat.element_size(), torch.uint8)) if flat.dtype != torch.bool else flat
    device, scratch = words.device, {} if scratch is None else scratch
    size = min(n, CHUNK_WORDS if device.type == "cpu" else 16 * CHUNK_WORDS)
    if device not in scratch or scratch[device][0].numel() < size:
        scratch[device] = (torch.arange(1, size + 1, dtype=torch.int64, device=device),
                           torch.empty(size, dtype=torch.int64, device=device))
    positions, buffer = scratch[device]
    total = weighted = 0  # Python's integers, brought back to int64 at the end: the same numbers modulo 2**64
    for start in range(0, n, size):  # positions start + 1, ...: the weighted sum gains start × the chunk's sum
        chunk = buffer[: min(size, n - start)].copy_(words[start : start + size])
        part = int(chunk.sum())
        total += part
        weighted += int(chunk.mul_(positions[: chunk.numel()]).sum()) + part * start
    return _int64(total), _int64(weighted)


def _int64(n: int) -> int:
    """``n`` modulo 2**64, as a signed 64-bit integer (what a sum of int64 tensors wraps to)."""
    return (n + 2**63) % 2**64 - 2**63


def digests(named: Iterable[tuple[str, Any]]) -> dict[str, tuple[int, int]]:
    """Each named tensor's digest (entries that are not tensors are left out), one tensor at a time."""
    scratch: Scratch = {}
    return {name: digest(value, scratch) for name, value in named if isinstance(value, Tensor)}


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
