"""What holds a survivor's membership back after a replica dies: torchft's Lighthouse, three replicas.

    python -m benchmarks.elastic_quorum_hold           # ~25 s; prints one line per case
    python -m benchmarks.elastic_quorum_hold --quick   # ~8 s: the last case only

a, b and c form a quorum; c is killed (its heartbeats stop), a and b ask for the next quorum at once (they
are at a switch) and c is restarted under the same id, heartbeating ``beat_after`` seconds after its kill
and asking for a quorum ``ask_after`` seconds after its kill (its start-up). The survivors' wait shows the
Lighthouse's rules: a quorum whose previous members are not all asking waits for every replica that
heartbeats but has not asked (up to the join timeout), and a dead replica counts as alive until its
heartbeat timeout. Writes ``benchmarks/results/elastic_quorum_hold.json`` (``--quick``: a temporary folder, or
``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from datetime import timedelta
from typing import Any, Optional

from benchmarks.common import machine, results_dir

HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS = 2000, 20_000


def _beat(url: str, rid: str, stop: threading.Event, delay: float = 0.0) -> None:
    from torchft.coordination import LighthouseClient

    if stop.wait(delay):
        return
    client = LighthouseClient(url, connect_timeout=timedelta(seconds=10))
    while True:
        client.heartbeat(rid)
        if stop.wait(0.2):
            return


def _ask(url: str, rid: str, out: dict[str, Any], delay: float = 0.0) -> None:
    from torchft.coordination import LighthouseClient

    client = LighthouseClient(url, connect_timeout=timedelta(seconds=10))
    time.sleep(delay)
    asked = time.perf_counter()
    quorum = client.quorum(replica_id=rid, timeout=timedelta(seconds=30), address=rid, store_address=f"{rid}:1",
                           step=1, world_size=1, shrink_only=False, data={})
    out[rid] = (time.perf_counter() - asked, sorted(m.replica_id for m in quorum.participants))


def case(beat_after: Optional[float], ask_after: float) -> dict[str, Any]:
    """The survivors' wait (s) and the quorum they get, with c restarted as described in the module docstring."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=JOIN_TIMEOUT_MS,
                              heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    url, stops, out = server.address(), {r: threading.Event() for r in "abc"}, {}
    try:
        for rid in "abc":
            threading.Thread(target=_beat, args=(url, rid, stops[rid]), daemon=True).start()
        time.sleep(0.5)
        first = [threading.Thread(target=_ask, args=(url, rid, {})) for rid in "abc"]
        [t.start() for t in first]
        [t.join() for t in first]
        stops["c"].set()  # c is killed
        stops["c2"] = threading.Event()
        if beat_after is not None:
            threading.Thread(target=_beat, args=(url, "c", stops["c2"], beat_after), daemon=True).start()
        asks = [threading.Thread(target=_ask, args=(url, rid, out)) for rid in "ab"]
        asks.append(threading.Thread(target=_ask, args=(url, "c", out, ask_after), daemon=True))
        [t.start() for t in asks]
        [t.join() for t in asks[:2]]
        return {"a": out["a"], "b": out["b"]}
    finally:
        for stop in stops.values():
            stop.set()
        server.shutdown()


CASES = (
    (None, 6.0, "restart heartbeats only when it asks, 6 s after the kill"),
    (4.0, 6.0, "restart heartbeats 4 s after the kill (after the old heartbeats expired), asks at 6 s"),
    (1.0, 6.0, "restart heartbeats 1 s after the kill (before they expired), asks at 6 s"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the last case only")
    args = parser.parse_args()
    print(f"Lighthouse: heartbeat timeout {HEARTBEAT_TIMEOUT_MS / 1000:g} s, join timeout {JOIN_TIMEOUT_MS / 1000:g} s")
    rows = []
    for beat_after, ask_after, what in CASES[-1:] if args.quick else CASES:
        got = case(beat_after, ask_after)
        rows.append({"case": what, "beat_after_s": beat_after, "ask_after_s": ask_after,
                     "waits_s": [got["a"][0], got["b"][0]], "quorum": got["a"][1]})
        print(f"{what}: survivors waited {got['a'][0]:.2f} s and {got['b'][0]:.2f} s for {got['a'][1]}", flush=True)
    out = results_dir(args.quick) / "elastic_quorum_hold.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                               "join_timeout_ms": JOIN_TIMEOUT_MS, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
