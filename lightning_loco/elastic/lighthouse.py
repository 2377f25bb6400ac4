"""A Lighthouse: torchft's membership and quorum server, for elastic replicas.

``lightning-loco lighthouse --min-replicas 2 --bind 0.0.0.0:29510`` runs one in the foreground and prints
the address the replicas give as ``lighthouse=HOST:PORT``. Tests, benchmarks and the demo run that command
on a free port through ``lightning_loco.testing.elastic.Lighthouse``; :func:`start_lighthouse` starts one
in this process.

Nothing of the package is imported at the top of this module, so that a process can serve a Lighthouse from
this file alone (``python lightning_loco/elastic/lighthouse.py --min-replicas 2``) without the seconds that
importing Lightning costs: the test helper starts many.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Optional

# torchft's own defaults are 60 s to wait for stragglers and 5 s of silence before a replica counts as
# dead; ours are the same except where noted in the CLI help.
DEFAULT_JOIN_TIMEOUT_MS = 60_000
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5_000


def start_lighthouse(
    bind: str = "127.0.0.1:0",
    min_replicas: int = 1,
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS,
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
    quorum_tick_ms: Optional[int] = None,
) -> Any:
    """Starts torchft's ``LighthouseServer`` in this process and returns it (``address()``, ``shutdown()``)."""
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(
            f"min_replicas must be an integer >= 1, got {min_replicas!r}: the fewest live replicas that may go on "
            "training. 2 lets any pair continue."
        )
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        from lightning_loco.elastic.config import require_torchft

        require_torchft()  # raises, naming the extra to install
        raise

    return LighthouseServer(
        bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms, quorum_tick_ms=quorum_tick_ms,
    )


def public_address(server: Any, bind: str) -> str:
    """``HOST:PORT`` for the replicas: torchft reports its host name; a loopback bind stays loopback."""
    url = server.address()
    host, _, port = url.split("://", 1)[-1].rstrip("/").rpartition(":")
    bind_host = bind.rpartition(":")[0]
    if bind_host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        host = bind_host
    return f"{host}:{port}"


def main(argv: list[str]) -> None:
    """``lightning-loco lighthouse``: runs a Lighthouse until interrupted."""
    parser = argparse.ArgumentParser(
        prog="lightning-loco lighthouse",
        description="Run torchft's Lighthouse, which agrees on the live replicas of an elastic run. Each replica "
        "then runs with --trainer.strategy.init_args.elastic.lighthouse=HOST:PORT (printed at start).",
    )
    parser.add_argument("--min-replicas", type=int, required=True,
                        help="the fewest live replicas that may form a membership and go on training")
    parser.add_argument("--bind", default="0.0.0.0:29510",
                        help="HOST:PORT to listen on (default 0.0.0.0:29510; port 0 picks a free one)")
    parser.add_argument("--join-timeout-ms", type=int, default=DEFAULT_JOIN_TIMEOUT_MS,
                        help="how long a membership waits for a live replica that has not asked yet (default 60000)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_MS,
                        help="silence after which a replica counts as dead (default 5000)")
    args = parser.parse_args(argv)
    try:
        server = start_lighthouse(args.bind, args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    print(f"lighthouse {public_address(server, args.bind)} (min_replicas={args.min_replicas})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
