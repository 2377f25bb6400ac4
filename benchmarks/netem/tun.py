"""Packet-level WAN emulation with network namespaces and TUN devices (needs root).

``EmulatedNetwork(network)`` creates, for node i, a namespace ``loco<pid>n<i>`` holding a TUN device
with address ``10.<a>.<b>.<i+1>/24`` (a subnet chosen from the process id), brings it up, and starts a
forwarding thread in this process. The thread reads every IPv4 packet a node sends, computes its
delivery time with the node's and the destination's access links
(:class:`benchmarks.netem.links.Network`: serialisation at each end, one-way delays, optional
log-normal jitter that never reorders a flow), and writes it to the destination's TUN at that time, unless a
link's random loss drops it.

Only namespaces, devices and addresses of its own are created, nothing is routed anywhere else,
and ``close()`` (also called on exit, on SIGINT/SIGTERM and by the context manager) deletes the
namespaces, which removes their devices. Where the kernel has ``netem`` the usual tool would be
``tc qdisc ... netem delay 50ms rate 100mbit`` on veth pairs; this kernel has none, hence TUN.

``sysctls`` (e.g. ``{"net.ipv4.tcp_slow_start_after_idle": "0"}``) are set in every namespace
when it is created; they go with it, and the host's own settings are never touched. New namespaces
inherit the host's TCP congestion control; another one can be chosen with
``net.ipv4.tcp_congestion_control`` if the host lists it in ``net.ipv4.tcp_allowed_congestion_control``.

Workers are started with :meth:`EmulatedNetwork.popen`, which runs a command inside node i's
namespace with ``GLOO_SOCKET_IFNAME`` set to its device.
"""

from __future__ import annotations

import atexit
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

from benchmarks.netem.links import LAN_DELAY_MS, LAN_MBIT, Network

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 9000  # jumbo frames: fewer packets for a forwarder written in Python
LATE_S = 0.005
"""A packet written this much after its delivery time counts as late: the forwarder, not the link, held it."""


def available() -> tuple[bool, str]:
    """Whether packet-level emulation can run here, and if not, why."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return False, "no /dev/net/tun"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return False, "`ip netns` does not work here"
    return True, ""


def _ip(*args: str, check: bool = True) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _sysctl(namespace: str, key: str, value: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-q", "-w", f"{key}={value}"],
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sysctl {key}={value} in {namespace}: {proc.stderr.strip()}")


class EmulatedNetwork:
    """N nodes in their own namespaces, joined by the emulated links of ``network``."""

    def __init__(self, network: Network, seed: int = 0, sysctls: dict[str, str] | None = None) -> None:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"packet-level emulation unavailable: {why}")
        self.network = network
        self.sysctls = dict(sysctls or {})
        self.n = len(network.links)
        pid = os.getpid()
        self.prefix = f"loco{pid % 100000}n"
        self.subnet = f"10.{100 + pid % 100}.{(pid // 100) % 250}"
        self.namespaces: list[str] = []
        self.fds: list[int] = []
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.packets = 0
        self.bytes = 0
        self.dropped = 0
        self.late_s = 0.0  # summed over packets: how long after its delivery time each was written
        self.late_max_s = 0.0
        self.late_packets = 0  # written more than LATE_S after their delivery time
        self.busy_s = 0.0  # the forwarder's time outside its wait for packets
        self.run_s = 0.0
        self._previous_handlers: dict[int, Any] = {}
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            if threading.current_thread() is threading.main_thread():
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    # ------------------------------------------------------------------ set-up and tear-down

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def device(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def _create(self) -> None:
        for i in range(self.n):
            name, ns = self.device(i), self.device(i)
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            self.fds.append(fd)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("link", "set", name, "netns", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", name)
            _ip("-n", ns, "link", "set", name, "mtu", str(MTU), "up")
            for key, value in self.sysctls.items():  # per namespace: gone with it, nothing to restore
                _sysctl(ns, key, value)
        self._thread = threading.Thread(target=self._forward, name="netem-forwarder", daemon=True)
        self._thread.start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.close()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # removes the TUN device inside it too
        for sig, handler in self._previous_handlers.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, TypeError):
                pass

    def __enter__(self) -> "EmulatedNetwork":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def lateness(self) -> dict:
        """How far the forwarder kept to the link's timing: packets written, the mean and largest delay past
        each one's delivery time, and the share written more than :data:`LATE_S` late, and the share of
        its time the forwarder spent working rather than waiting for packets. Large shares mean the forwarder (one
        Python thread, sharing the host's cores with the workers) was the limit, not the emulated link."""
        n = max(self.packets, 1)
        return {"packets": self.packets, "mbytes": round(self.bytes / 1e6, 1),
                "late_mean_ms": round(1e3 * self.late_s / n, 3), "late_max_ms": round(1e3 * self.late_max_s, 1),
                "late_share": round(self.late_packets / n, 4),
                "busy_share": round(self.busy_s / self.run_s, 3) if self.run_s else 0.0}

    # ------------------------------------------------------------------ workers

    def popen(self, i: int, cmd: Sequence[str], env: Optional[dict[str, str]] = None,
              **kwargs: Any) -> subprocess.Popen:
        """Starts ``cmd`` inside node i's namespace; gloo is told to use the node's device."""
        full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.device(i)}
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], *cmd], env=full_env, **kwargs)

    # ------------------------------------------------------------------ the forwarder

    def _forward(self) -> None:
        links = self.network.links
        by_fd = {fd: i for i, fd in enumerate(self.fds)}
        index_of = {self.address(i): i for i in range(self.n)}
        tx_free = [0.0] * self.n  # when each node's uplink is free again
        rx_free = [0.0] * self.n  # when each node's downlink is free again
        lan_free = [0.0] * self.n  # when each node's link inside its site is free again
        lan_rate = LAN_MBIT * 1e6 / 8
        last = {}  # last delivery time per (src, dst): jitter must not reorder a flow
        queue: list[tuple[float, int, int, bytes]] = []
        seq = 0
        poller = select.epoll()
        for fd in self.fds:
            poller.register(fd, select.EPOLLIN)
        try:
            began = previous = time.monotonic()
            while not self._stop.is_set():
                now = time.monotonic()
                self.busy_s += now - previous
                timeout = 0.05 if not queue else max(0.0, min(0.05, queue[0][0] - now))
                events = poller.poll(timeout)
                previous = time.monotonic()
                self.run_s = previous - began
                for fd, _ in events:
                    src = by_fd[fd]
                    while True:
                        try:
                            packet = os.read(fd, 65535)
                        except BlockingIOError:
                            break
                        except OSError:
                            return
                        if len(packet) < 20 or packet[0] >> 4 != 4:
                            continue  # IPv4 only
                        dst = index_of.get("%d.%d.%d.%d" % tuple(packet[16:20]))
                        if dst is None or dst == src:
                            continue
                        now = time.monotonic()
                        size = len(packet)
                        if self.network.same_site(src, dst):  # the fast local link, not the access links
                            lan_free[src] = max(now, lan_free[src]) + size / lan_rate
                            deliver = max(lan_free[src] + LAN_DELAY_MS / 1000, last.get((src, dst), 0.0))
                            last[(src, dst)] = deliver
                            heapq.heappush(queue, (deliver, seq, dst, packet))
                            seq += 1
                            continue
                        if (links[src].loss or links[dst].loss) and \
                                self._rng.random() < links[src].loss + links[dst].loss:
                            self.dropped += 1
                            continue  # lost on the way: TCP must notice and send it again
                        tx_free[src] = max(now, tx_free[src]) + size / links[src].bytes_per_s
                        at_core = tx_free[src] + links[src].delay_ms / 1000
                        rx_free[dst] = max(at_core, rx_free[dst]) + size / links[dst].bytes_per_s
                        deliver = rx_free[dst] + links[dst].delay_ms / 1000
                        jitter = links[src].jitter_ms + links[dst].jitter_ms
                        if jitter:
                            deliver += self._rng.lognormvariate(0, 1) * jitter / 1000
                        deliver = max(deliver, last.get((src, dst), 0.0))
                        last[(src, dst)] = deliver
                        heapq.heappush(queue, (deliver, seq, dst, packet))
                        seq += 1
                now = time.monotonic()
                while queue and queue[0][0] <= now:
                    due, _, dst, packet = heapq.heappop(queue)
                    late = now - due
                    self.late_s += late
                    if late > self.late_max_s:
                        self.late_max_s = late
                    if late > LATE_S:
                        self.late_packets += 1
                    try:
                        os.write(self.fds[dst], packet)
                    except OSError:
                        pass  # the destination's queue is full or gone: dropped, as on a real link
                    self.packets += 1
                    self.bytes += len(packet)
        finally:
            poller.close()
