"""The host's TCP send buffers, which bound what one connection carries per round trip.

A TCP connection has at most its send buffer in flight, so it carries at most that many bytes per round trip:
with Linux's usual largest send buffer (the third number of ``net.ipv4.tcp_wmem``, 4 MB) and 100 ms each way,
4 MB per 0.2 s, 168 Mbit/s, whatever the link (``benchmarks/link_efficiency.py``: 105 Mbit/s for our pair
exchange on a 1 Gbit/s long fat pipe, 533 with 32 MB buffers). The kernel grows each connection's buffer
up to that limit by itself, and only the host can raise it: gloo sets no socket buffer of its own and its
options (``ProcessGroupGloo.Options``) offer none, and a buffer asked for with ``SO_SNDBUF`` would be capped
by ``net.core.wmem_max`` and stop the kernel's growing. Streams (:mod:`~lightning_loco.transport.streams`)
spread an exchange over more connections; the host's limit is the other half.

:func:`check_send_buffer` is called by the transport with the bytes of each exchange it posts on gloo. The
first exchange of :data:`LARGE_BYTES` or more on a host whose limit is :data:`SMALL_BUFFER` or less warns,
once per process, with the setting to change: on a long round trip such an exchange is bound by the windows,
not the link. (On a short link the same exchange is not, and the warning says so.)
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

__all__ = ["LARGE_BYTES", "SMALL_BUFFER", "SendBufferWarning", "check_send_buffer", "host_max_send_buffer"]

TCP_WMEM = "/proc/sys/net/ipv4/tcp_wmem"
LARGE_BYTES = 32 << 20
"""An exchange that sends this many bytes or more is large enough for the host's send buffers to matter."""
SMALL_BUFFER = 4 << 20
"""A host's largest send buffer at or under this (Linux's default) bounds a connection on a long round trip."""


class SendBufferWarning(UserWarning):
    """The host's largest TCP send buffer may bound a large exchange on a long round trip."""


_state: dict[str, Optional[int]] = {}  # "limit": the host's, once read; "warned": 1 once warned


def host_max_send_buffer(path: str = TCP_WMEM) -> Optional[int]:
    """The host's largest TCP send buffer in bytes (the third number of ``net.ipv4.tcp_wmem``), or ``None``
    where it cannot be read (not Linux)."""
    try:
        return int(Path(path).read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return None


def check_send_buffer(nbytes: int, path: str = TCP_WMEM) -> bool:
    """Warns once per process when an exchange of ``nbytes`` sent is large and the host's send buffers small
    (see the module docstring); returns whether it warned now."""
    if nbytes < LARGE_BYTES or _state.get("warned"):
        return False
    if "limit" not in _state:
        _state["limit"] = host_max_send_buffer(path)
    limit = _state["limit"]
    if limit is None or limit > SMALL_BUFFER:
        return False
    _state["warned"] = 1
    warnings.warn(
        f"This exchange sends {nbytes / 2**20:.0f} MB, and this host's TCP connections have at most "
        f"{limit / 2**20:.1f} MB in flight (the third number of net.ipv4.tcp_wmem): on a long round trip each "
        f"connection carries at most that per round trip (at 200 ms, {8 * limit / 0.2 / 1e6:.0f} Mbit/s), "
        "whatever the link. On every host of the run, as root: sysctl -w net.ipv4.tcp_wmem='4096 16384 33554432' "
        "net.ipv4.tcp_rmem='4096 131072 33554432' (docs/launching.md). On a short link it does not matter.",
        SendBufferWarning, stacklevel=3)
    return True
