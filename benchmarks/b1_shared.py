"""What B1's parts share: the methods and wire formats they time, the networks, where their workers meet, how
every pair of replicas is warmed before timing, and how a method is built as the strategies build it.

The main and idle parts are :mod:`benchmarks.b1_sync_latency`, the fragments part :mod:`benchmarks.b1_fragments`
(which the main module runs with ``--parts fragments``); both import this module, and not each other's shared
pieces.
"""

from __future__ import annotations

from typing import Any

from benchmarks.netem.links import Network, uniform

ALGORITHMS = ("noloco", "gasloc", "diloco", "ddp")
# --codecs: the wire formats of lightning_loco.wire.codecs, as (wire_dtype, compression)
CODECS = ("float32", "bfloat16", "float16", "int8", "int4", "int2", "topk")  # topk: pseudo-gradients only (DiLoCo)
WARM_NUMEL = 1 << 20  # float32 per pair for warm_all_pairs: 4 MB is past TCP slow start on the emulated WAN
# The workers meet through this file in their shared output folder (a FileStore: no port, and no
# rendezvous connection beside gloo's on the emulated network), whatever their network namespaces.
STORE = "gloo.store"


def networks(n: int) -> dict[str, Network]:
    return {"loopback": Network("loopback", uniform(n).links), "wan": uniform(n, mbit=100, one_way_ms=50)}



def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``range(n)`` exactly once, in rounds of disjoint pairs (the circle method): n − 1
    rounds for even n, n rounds with one replica sitting out each for odd n."""
    players = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = [(players[k], players[m - 1 - k]) for k in range(m // 2)]
        rounds.append([tuple(sorted(p)) for p in pairs if None not in p])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def warm_all_pairs(transport: Any, numel: int) -> None:
    """One exchange of ``numel`` float32 on every pair of replicas, so that no timed round meets a
    connection that has never carried a model (see :mod:`benchmarks.b1_sync_latency`: a fresh connection's
    first transfer runs TCP slow start from its initial window)."""
    import torch

    buf = torch.ones(numel)
    for pairs in round_robin(transport.num_replicas):
        mine = next((p for p in pairs if transport.replica in p), None)
        if mine is not None:
            transport.group_sum(buf, mine)


def build(name: str, codec: str = "float32") -> tuple[Any, Any]:
    """The outer-step algorithm ``name`` with the strategies' defaults, and its wire format for the
    ``codec`` of :data:`CODECS` as the strategies build it (error feedback on for a lossy codec when
    the payload is a pseudo-gradient, as DiLoCo's). Options of the exchange itself belong here, so
    that every method is timed with the same ones."""
    from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
    from lightning_loco.replica.options import WireConfig

    algorithm = {"noloco": NoLoCo, "gasloc": GASLoC, "diloco": DiLoCo}[name]()
    return algorithm, WireConfig(codec).resolve(algorithm.payload_is_pseudo_gradient)
