"""A network as the benchmarks see it: every node has an access link to a core.

A packet from node i to node j is serialised at i's bandwidth, travels i's one-way delay to the core
and j's from it, and is serialised again at j's bandwidth (queues are unbounded: nothing is dropped but what a
link's random ``loss`` drops).
The one-way latency between i and j is therefore ``delay[i] + delay[j]``.

Nodes may share a *site* (``sites``): nodes of one site reach each other over a fast local link
(``LAN_MBIT``, ``LAN_DELAY_MS``) that bypasses their access links, as the GPUs of one machine do.
By default every node is a site of its own.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Link:
    """One node's access link."""

    mbit: float = 100.0  # bandwidth, both directions
    delay_ms: float = 25.0  # one-way delay to the core
    jitter_ms: float = 0.0  # standard deviation of a per-packet extra delay (log-normal)
    loss: float = 0.0  # the probability that a packet through this link is dropped (emulated network only)

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8


LAN_MBIT = 10_000.0  # inside a site (the emulator forwards far less than this: it is never the limit)
LAN_DELAY_MS = 0.05


@dataclass(frozen=True)
class Network:
    """A name for the output, one access link per node, and optionally each node's site."""

    name: str
    links: tuple[Link, ...] = field(default_factory=tuple)
    sites: Optional[tuple[int, ...]] = None

    def same_site(self, i: int, j: int) -> bool:
        return self.sites is not None and self.sites[i] == self.sites[j]

    def with_sites(self, ranks_per_site: int) -> "Network":
        """The same links with consecutive blocks of ``ranks_per_site`` nodes sharing a site."""
        sites = tuple(i // ranks_per_site for i in range(len(self.links)))
        name = self.name if ranks_per_site == 1 else f"{self.name}; {ranks_per_site} nodes per site"
        return Network(name, self.links, sites)

    def one_way_s(self, i: int, j: int) -> float:
        if self.same_site(i, j):
            return LAN_DELAY_MS / 1000
        return (self.links[i].delay_ms + self.links[j].delay_ms) / 1000

    def transfer_s(self, i: int, j: int, nbytes: int) -> float:
        """Time for ``nbytes`` from i to j on an idle network: latency plus the slower link's
        serialisation (the TCP handshake, slow start and headers are not modelled)."""
        if self.same_site(i, j):
            return self.one_way_s(i, j) + nbytes / (LAN_MBIT * 1e6 / 8)
        rate = min(self.links[i].bytes_per_s, self.links[j].bytes_per_s)
        return self.one_way_s(i, j) + nbytes / rate

    def describe(self) -> dict:
        out: dict = {"name": self.name, "links": [asdict(link) for link in self.links]}
        if self.sites is not None:
            out["sites"] = list(self.sites)
        return out


def uniform(n: int, mbit: float = 100.0, one_way_ms: float = 50.0, jitter_ms: float = 0.0,
            loss: float = 0.0) -> Network:
    """n nodes, every pair ``one_way_ms`` apart at ``mbit``; ``loss``: the probability that a packet between two
    nodes is dropped (half of it on each end's link)."""
    link = Link(mbit=mbit, delay_ms=one_way_ms / 2, jitter_ms=jitter_ms, loss=loss / 2)
    lossy = f", {100 * loss:g} % loss" if loss else ""
    return Network(f"{mbit:g} Mbit/s, {one_way_ms:g} ms one way{lossy}", (link,) * n)


def one_slow(n: int, mbit: float = 100.0, one_way_ms: float = 50.0, slower: float = 10.0,
             farther: float = 4.0) -> Network:
    """Like :func:`uniform`, but node n−1 has ``slower``× less bandwidth and is ``farther``× more distant
    from every other node (its one-way latency to any peer is ``farther·one_way_ms``)."""
    base = one_way_ms / 2
    slow = Link(mbit=mbit / slower, delay_ms=farther * one_way_ms - base)
    return Network(
        f"{mbit:g} Mbit/s, {one_way_ms:g} ms; node {n - 1} at {mbit / slower:g} Mbit/s, {farther * one_way_ms:g} ms",
        (Link(mbit=mbit, delay_ms=base),) * (n - 1) + (slow,),
    )


# ---------------------------------------------------------------- the modelled network's environment variable

# The launcher hands the modelled network to its workers in this variable. Kept here, away from
# :mod:`benchmarks.netem.modelled`, so that the launching process need not import torch and Lightning.
ENV = "LOCO_MODELLED_NETWORK"


def to_env(network: Network) -> str:
    if any(link.loss for link in network.links):
        raise ValueError(f"{network.name}: the modelled network has no packets to lose; run a lossy network "
                         "emulated (mode 'emulated')")
    return json.dumps(network.describe())


def from_env() -> Network | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    spec = json.loads(raw)
    return Network(spec["name"], tuple(Link(**link) for link in spec["links"]))


# ---------------------------------------------------------------- the paper's latency model (NoLoCo Eq. 5)


def tree_allreduce_s(n: int, message_s: float) -> float:
    """A tree all-reduce: reduce up and broadcast down a binary tree, 2·log2(N) message times."""
    return 2 * message_s * math.ceil(math.log2(n)) if n > 1 else 0.0


def ring_allreduce_s(n: int, message_s: float, chunk_s: float) -> float:
    """A ring all-reduce: 2(N−1) steps, each a latency plus one chunk of 1/N of the model."""
    return 2 * (n - 1) * (message_s + chunk_s) if n > 1 else 0.0


def pair_exchange_s(message_s: float) -> float:
    """A pair exchange as the paper counts it: 2·t (a send and a receive)."""
    return 2 * message_s
