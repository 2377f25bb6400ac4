"""What the kernel says about TCP, for the benchmarks on emulated networks.

* :func:`ss_connections`, :func:`parse_ss`, :func:`tcp_connections`: the established connections of
  this network namespace as ``ss -tinH`` shows them (peer, congestion window, slow-start threshold,
  bytes sent);
* :func:`host_congestion`, :func:`check_congestion`: the host's TCP congestion control, and whether
  a network namespace may choose another one.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def ss_text() -> str:
    """``ss -tinH`` for this network namespace's established TCP connections ("" without ``ss``)."""
    try:
        return subprocess.run(["ss", "-tinH", "state", "established"], check=False, capture_output=True,
                              text=True).stdout
    except OSError:
        return ""


def tcp_connections() -> dict[str, dict[str, float]]:
    """This network namespace's established TCP connections: see :func:`parse_ss`."""
    return parse_ss(ss_text())


def parse_ss(text: str) -> dict[str, dict[str, float]]:
    """Per peer address (IPv4, without the port), the sender's congestion window ``cwnd`` (packets),
    slow-start threshold ``ssthresh`` and ``bytes_sent`` of the connection to it that has sent the
    most (the data connection, not an idle one beside it), from the output of ``ss -tinH``."""
    best: dict[str, dict[str, float]] = {}
    for peer, info in ss_connections(text):
        if info.get("bytes_sent", 0.0) >= best.get(peer, {}).get("bytes_sent", -1.0):
            best[peer] = info
    return best


def ss_connections(text: str) -> list[tuple[str, dict[str, float]]]:
    """Every connection in the output of ``ss -tinH``: its peer address and what :func:`parse_ss` reads
    (``bytes_sent`` is absent while nothing was sent)."""
    conns: list[tuple[str, dict[str, float]]] = []
    for line in text.splitlines():
        if line[:1].isspace():
            if conns:
                for key in ("cwnd", "ssthresh", "bytes_sent"):
                    found = re.search(rf"\b{key}:(\d+)", line)
                    if found:
                        conns[-1][1][key] = float(found.group(1))
        elif line.split():
            conns.append((line.split()[-1].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:"), {}))
    return conns


def host_congestion() -> str:
    """The host's default TCP congestion control (new network namespaces inherit it)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


def check_congestion(names: list[str]) -> None:
    """Exits with what to do when a congestion control cannot be chosen inside a namespace: there,
    only the host's ``net.ipv4.tcp_allowed_congestion_control`` (and its default) may be set."""
    proc = Path("/proc/sys/net/ipv4")
    try:
        available = (proc / "tcp_available_congestion_control").read_text().split()
        allowed = (proc / "tcp_allowed_congestion_control").read_text().split()
    except OSError:
        return
    for name in names:
        if name not in available:
            sys.exit(f"--congestion {name}: this kernel has {' '.join(available)}")
        if name not in allowed and name != host_congestion():
            sys.exit(f"--congestion {name}: network namespaces may only choose from "
                     f"net.ipv4.tcp_allowed_congestion_control ({' '.join(allowed)}); add it with "
                     f"sysctl -w net.ipv4.tcp_allowed_congestion_control='{' '.join(allowed)} {name}' "
                     f"(and set the list back afterwards)")
