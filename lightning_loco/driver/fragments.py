"""Streaming fragments: each optimizer's parameters as F fragments with rounds of their own.

With ``fragments=F`` the driver (:mod:`lightning_loco.driver.driver`) keeps F outer slots per optimizer
instead of one. The layout (:func:`layout`) is contiguous and in parameter order: fragment f holds
parameters ``[a_f, a_{f+1})`` of the optimizer's list, whole parameters only (a parameter is never
split across fragments), with the boundaries chosen so that the largest fragment is as small as a
contiguous split of whole parameters allows. Every fragment has:

* its own rounds, at inner steps f·H/F + kH (fragment 0 at H, 2H, ...; fragment f first at f·H/F),
  so that one fragment's round starts every H/F steps, cycling through the fragments;
* its own outer state (anchor, momentum or outer optimizer, error-feedback residual, round in flight),
  since each fragment is an ordinary :class:`~lightning_loco.driver.slots.OuterSlot` over its parameters;
* its own round counter t and, for algorithms whose schedule draws from a ``seed`` (NoLoCo, GASLoC's
  random pairs), its own peer schedule, seeded with (seed, t, f): fragment f's algorithm is a copy
  whose seed is :func:`fragment_seed` of (seed, f). Fragment 0 keeps the seed as it is, so F = 1 is
  exactly the unfragmented schedule.

F = 1 is the unfragmented path: the optimizer's own parameters, the algorithm itself, offset 0.
See docs/fragments.md for the design, what composes and what is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.algorithms.schedules import _MASK64, _splitmix64
from lightning_loco.driver.flat import FlatParameters


def too_few_parameters(fragments: int, parameters: int) -> str:
    """Why ``fragments`` fragments cannot be cut from an optimizer's ``parameters`` parameters."""
    return (f"fragments={fragments} needs at least {fragments} parameters per optimizer (a parameter is never "
            f"split across fragments), got {parameters}. Use fragments <= {parameters}.")


def layout(numels: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """The fragments of a list of parameters of ``numels`` values each: F ranges ``(a, b)`` of parameter
    indices, contiguous, in order, non-empty, whole parameters only, and with the largest fragment's
    size as small as such a split allows (the smallest capacity that a greedy packing fits in F
    fragments, found by bisection). Raises ``ValueError`` with fewer parameters than fragments."""
    if len(numels) < fragments:
        raise ValueError(too_few_parameters(fragments, len(numels)))
    low, high = max(numels), sum(numels)
    while low < high:  # the smallest capacity that fits in F fragments
        middle = (low + high) // 2
        if _count(numels, middle) <= fragments:
            high = middle
        else:
            low = middle + 1
    ranges: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, n in enumerate(numels):
        left = fragments - len(ranges)  # fragments still to close, the current one included
        if i > start and (size + n > low or len(numels) - i < left):
            ranges.append((start, i))  # full, or every later parameter must start a fragment of its own
            start, size = i, 0
        size += n
    ranges.append((start, len(numels)))
    assert len(ranges) == fragments, (ranges, fragments)
    return ranges


def _count(numels: Sequence[int], capacity: int) -> int:
    """How many fragments a greedy packing of ``numels`` in order needs at ``capacity`` values each."""
    count, size = 1, 0
    for n in numels:
        if size + n > capacity:
            count, size = count + 1, 0
        size += n
    return count


def split(flat: FlatParameters, fragments: int) -> list[FlatParameters]:
    """``flat``'s parameters as the fragments of :func:`layout`, each a ``FlatParameters`` of its own on
    the same device. F = 1 returns ``[flat]`` itself."""
    if fragments == 1:
        return [flat]
    if type(flat) is not FlatParameters:
        raise ValueError(f"fragments={fragments} works on plain FlatParameters, got {type(flat).__name__}.")
    return [FlatParameters(flat.params[a:b], flat.device) for a, b in layout(flat.numels, fragments)]


def fragment_seed(seed: int, fragment: int) -> int:
    """The seed of fragment f's peer schedule: ``seed`` for f = 0 (F = 1 draws today's peers), a
    splitmix64 mix of (seed, f) otherwise. The schedule then draws from (this seed, t)."""
    if fragment == 0:
        return seed
    return _splitmix64(_splitmix64(seed & _MASK64) ^ _splitmix64(fragment)) & ((1 << 63) - 1)


def fragment_algorithm(algorithm: OuterAlgorithm, fragment: int) -> OuterAlgorithm:
    """The algorithm that runs fragment f: ``algorithm`` itself for f = 0 or one whose schedule draws
    nothing (``seeded_schedule`` False); otherwise a shallow copy with the fragment's seed (the maths is
    the same, the peers differ)."""
    if fragment == 0 or not algorithm.seeded_schedule:
        return algorithm
    twin = copy.copy(algorithm)
    twin.seed = fragment_seed(algorithm.seed, fragment)  # type: ignore[attr-defined]
    return twin


def offset(fragment: int, sync_every: int, fragments: int) -> int:
    """f·H/F: the inner step of fragment f's first round (0 for fragment 0: its first is at H)."""
    return fragment * (sync_every // fragments)


def next_round_step(offset: int, outer_steps: int, sync_every: int) -> int:
    """The inner step (the optimizer's count) at which the next round of a slot starts, H-paced: a slot
    whose first round is at inner step ``offset`` and that has started ``outer_steps`` rounds."""
    return offset + sync_every * (outer_steps + (1 if offset == 0 else 0))


def check_saved(saved: Sequence[dict[str, Any]], fragments: int) -> None:
    """Raises ``ValueError`` when a checkpoint's outer state was saved with another number of fragments."""
    had = saved[0].get("fragments", 1)
    if had != fragments:
        raise ValueError(
            f"The checkpoint's outer state was saved with fragments={had}, this run has fragments={fragments}. "
            f"Resume with fragments={had}, or start a new run from the checkpoint's consensus model."
        )
