"""Peer schedules: who meets whom at outer step ``t``.

Every rank computes the same schedule from ``(seed, t)`` alone, so choosing peers costs no message.
The generator is private to the schedule: the global RNG is never touched (dropout and data loading
consume it, and a rank that drew one extra number would pick different peers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def round_generator(seed: int, outer_step: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, outer_step)``, identical on every rank and platform."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (outer_step & _MASK64))
    return torch.Generator().manual_seed(mixed & ((1 << 63) - 1))


@dataclass(frozen=True)
class Round:
    """The communication pattern of one outer step.

    Attributes:
        groups: a partition of ``range(num_replicas)``; each group's members combine their payloads.
            A group of one communicates with nobody.
        collective: ``True`` when the single group is everyone and the combination is an all-reduce
            (DiLoCo); ``False`` for point-to-point exchanges inside each group.
    """

    groups: tuple[tuple[int, ...], ...]
    collective: bool = False

    def group_of(self, replica: int) -> tuple[int, ...]:
        for group in self.groups:
            if replica in group:
                return group
        raise ValueError(f"replica {replica} is in no group of this round: {self.groups}")

    def peers_of(self, replica: int) -> tuple[int, ...]:
        return tuple(j for j in self.group_of(replica) if j != replica)


def everyone(num_replicas: int) -> Round:
    """One group of all replicas, combined with an all-reduce (DiLoCo)."""
    _check_num_replicas(num_replicas)
    return Round(groups=(tuple(range(num_replicas)),), collective=True)


def random_groups(num_replicas: int, group_size: int, seed: int, outer_step: int) -> Round:
    """NoLoCo's groups: consecutive chunks of a permutation drawn from ``(seed, outer_step)``.

    When ``num_replicas`` is not a multiple of ``group_size`` the last group takes the remainder
    (5 replicas in pairs: sizes 2 and 3), so nobody is ever left alone unless ``num_replicas == 1``.
    """
    _check_num_replicas(num_replicas)
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    perm = torch.randperm(num_replicas, generator=round_generator(seed, outer_step)).tolist()
    num_groups = max(1, num_replicas // group_size)
    groups = [perm[k * group_size : (k + 1) * group_size] for k in range(num_groups - 1)]
    groups.append(perm[(num_groups - 1) * group_size :])
    # Members in ascending order: every member then sums the group's payloads in the same order,
    # which keeps the result bitwise identical on all of them.
    return Round(groups=tuple(tuple(sorted(g)) for g in groups), collective=False)


def _check_num_replicas(num_replicas: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")


# ---------------------------------------------------------------- matchings (GASLoC's topologies)
# A matching pairs some replicas and leaves the others alone for the round (groups of one).


def _matching(num_replicas: int, pairs: list[tuple[int, int]]) -> Round:
    paired = {i for p in pairs for i in p}
    alone = [(i,) for i in range(num_replicas) if i not in paired]
    return Round(groups=tuple(tuple(sorted(p)) for p in pairs) + tuple(alone), collective=False)


def random_matching(num_replicas: int, seed: int, outer_step: int) -> Round:
    """A random perfect matching drawn from ``(seed, outer_step)``; with odd N one replica sits out."""
    _check_num_replicas(num_replicas)
    perm = torch.randperm(num_replicas, generator=round_generator(seed, outer_step)).tolist()
    return _matching(num_replicas, [(perm[k], perm[k + 1]) for k in range(0, num_replicas - 1, 2)])


def ring_matching(num_replicas: int, outer_step: int) -> Round:
    """Ring edges (2k, 2k+1) on even rounds and (2k+1, 2k+2) on odd rounds, wrapping around.

    With odd N one replica sits out each round (N − 1 on even rounds, 0 on odd rounds)."""
    _check_num_replicas(num_replicas)
    pairs = []
    for a in range(outer_step % 2, num_replicas, 2):
        b = a + 1
        if b == num_replicas:
            if num_replicas % 2 == 1:
                break  # odd N: the last replica sits out
            b = 0  # even N, odd round: the edge that closes the ring
        pairs.append((a, b))
    return _matching(num_replicas, pairs)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def exponential_matching(num_replicas: int, outer_step: int) -> Round:
    """Hypercube rounds: replica i meets i XOR 2^(t mod log2 N). N must be a power of two."""
    _check_num_replicas(num_replicas)
    if not is_power_of_two(num_replicas):
        raise ValueError(
            f"The exponential topology needs a power-of-two number of replicas, got {num_replicas}. "
            "Use 2, 4, 8, ... replicas, or topology='random_pairs' or 'ring'."
        )
    if num_replicas == 1:
        return _matching(1, [])
    bit = 1 << (outer_step % (num_replicas.bit_length() - 1))
    return _matching(num_replicas, [(i, i ^ bit) for i in range(num_replicas) if i < i ^ bit])
