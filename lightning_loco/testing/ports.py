"""Free ports for tests, benchmarks and examples: drawn at random below the kernel's ephemeral range, never a
fixed one (:func:`free_port`)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_BELOW_EPHEMERAL = 10000  # the lowest port free_port draws from, above the well-known services


def free_port(host: str = "127.0.0.1") -> int:
    """A free port on ``host`` drawn at random from below the kernel's ephemeral range, so that no
    process's outgoing connection can be given it between this call and the bind that uses it.

    A port the kernel hands out for ``bind(("", 0))`` comes from the ephemeral range, the same range every
    outgoing connection's local port comes from; once released, it can be the local port of another
    process's next connection (gloo opens many) before the rendezvous binds it, which then fails with
    ``EADDRINUSE``. Drawn below that range, only another caller of this function could take the port, one
    chance in several thousand per pair of calls. Where the range leaves no room below it, port 0 is used."""
    low, _ = _ephemeral_range()
    candidates = range(_BELOW_EPHEMERAL, low)
    for _ in range(64 if len(candidates) >= 1000 else 0):
        port = random.SystemRandom().choice(candidates)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
