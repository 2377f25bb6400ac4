"""The link itself: what fraction of an emulated long fat pipe one of our exchanges reaches, against plain TCP.

    python -m benchmarks.link_efficiency                  # 1 Gbit/s, 100 ms one way; no loss and 0.01 % loss
    python -m benchmarks.link_efficiency --quick          # seconds: 100 Mbit/s, 10 ms, 1 M floats, 1 repeat
    python -m benchmarks.link_efficiency --mbit 1000 --one-way-ms 100 --loss 0 1e-4 --params 50e6 --streams 1 4 8

Two nodes in their own network namespaces (``benchmarks/netem``, emulated: needs root), one access link each.
In every repeat, interleaved, each of the following moves ``--params`` float32 (50 M: 200 MB) in **each**
direction at once, since a replica's exchange is two-way:

* ``tcp×k`` for each k of ``--streams``: plain TCP, k connections per direction (so tcp×1 is two connections,
  one each way, where gloo carries both directions on one), the payload split evenly (as ``iperf -P k`` does in
  both directions), with the buffer sizes and congestion control the namespaces inherit from the host (recorded);
* ``noloco pair``: our NoLoCo pair exchange (``TorchDistributedTransport.group_sum`` over the pair: gloo's
  send and receive on one connection);
* ``diloco all-reduce``: our DiLoCo's all-reduce of the same payload (``all_reduce_sum``; with two replicas
  each sends the payload once: as one pair exchange on gloo, ``TorchDistributedTransport``'s two-replica path,
  fixed with ``all_reduce="p2p"``: the default ``"auto"`` tries the candidates in turn, so its rows would take a
  different all-reduce from one repeat to the next, as ``link_efficiency_wan_streams.json``'s did; B7 times the
  choice; the results written before the two-replica path, ``link_efficiency.json`` and
  ``link_efficiency*_streams*.json``, timed gloo's own all-reduce, in halves);
* ``gloo all-reduce``: ``torch.distributed.all_reduce`` of the same payload, what our two replicas' DiLoCo
  ran before;
* ``noloco pair ×s`` and ``diloco all-reduce ×s`` for each s of ``--transport-streams`` (default 4): the same
  over a transport with ``streams=s``, the payload spread over s process groups, s connections per pair; s =
  ``auto`` is the strategies' default (``WireConfig(streams="auto")``: one piece per 4 MB, at most 8, or for a pair
  exchange one connection where both sides measured it faster, :mod:`lightning_loco.transport.pair_streams`). Such a
  transport takes its trial exchanges before the timed repeats (untimed), and the results record, per node, the
  count it preferred, what each pair proposed and the trials' times (``pair_streams``).

Each is timed from a barrier to its end on both nodes (the slower counts; buffers are allocated before the
barrier), and reported as the rate it reached per direction (payload bits ÷ seconds) and that rate as a fraction
of the link's bandwidth. The payload is a model's, so TCP/IP headers are not counted in the fraction, and every
timing holds at least one one-way delay, so even a perfect sender stays a little under 100 %. Before the timed
repeats every connection carries one payload, and the namespaces set ``net.ipv4.tcp_slow_start_after_idle = 0``:
slow start is met once, as in a long run, not again after every other method's turn.

Writes ``benchmarks/results/link_efficiency.json`` (``--quick``: a temporary folder or ``$LOCO_BENCH_RESULTS``).
The emulator forwards packets in one Python thread; the rate it can carry at all is at most the best ``tcp×k``,
and the output says so when that is under 80 % of the configured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import load_average, machine, results_dir, skip_final_collection, spread, table, write_json
from benchmarks.netem import launch, tun
from benchmarks.netem.links import uniform
from lightning_loco.transport.pair_streams import PAIR_TRIALS

STORE = "gloo.store"
CHUNK = 1 << 20  # bytes per socket call


def _address(rank: int) -> str:
    return f"{os.environ['MASTER_ADDR'].rsplit('.', 1)[0]}.{rank + 1}"


def _send_all(sock: socket.socket, view: memoryview) -> None:
    for start in range(0, len(view), CHUNK):
        sock.sendall(view[start:start + CHUNK])


def _receive_all(sock: socket.socket, buffer: bytearray) -> None:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = sock.recv_into(view[got:], min(CHUNK, len(buffer) - got))
        if n == 0:
            raise ConnectionError(f"the peer closed its connection after {got} of {len(buffer)} bytes")
        got += n


class Streams:
    """k TCP connections from this node to its peer and k from the peer to it; :meth:`exchange` sends ``nbytes``
    split over this node's k while receiving as much over the peer's k, all at once."""

    def __init__(self, rank: int, k: int) -> None:
        import torch.distributed as dist

        self.k = k
        self.out: list[socket.socket] = []
        self.incoming: list[socket.socket] = []
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.settimeout(120)  # a peer that never dials ends this with an error, not a hang
        try:
            listener.bind((_address(rank), 0))
            listener.listen(k)
            ports = [None, None]
            dist.all_gather_object(ports, listener.getsockname()[1])
            peer = 1 - rank
            # this node's sending connections dial the peer's listener; its receiving ones are the peer's
            acceptor = threading.Thread(target=lambda: self.incoming.extend(listener.accept()[0] for _ in range(k)),
                                        daemon=True)
            acceptor.start()
            for _ in range(k):
                self.out.append(socket.create_connection((_address(peer), ports[peer]), timeout=120))
            acceptor.join(120)
            if len(self.incoming) != k:
                raise ConnectionError(f"{len(self.incoming)} of the peer's {k} connections arrived")
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        for sock in self.out + self.incoming:
            sock.settimeout(None)
        self.buffers: list[bytearray] = []

    def exchange(self, payload: bytes) -> None:
        share = len(payload) // self.k
        if not self.buffers:  # allocated once, before any timing
            self.buffers = [bytearray(share) for _ in range(self.k)]
        view = memoryview(payload)
        errors: list[BaseException] = []

        def run(fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001  (raised below, after every thread ended)
                errors.append(err)

        threads = [threading.Thread(target=run, args=(_send_all, s, view[i * share:(i + 1) * share]))
                   for i, s in enumerate(self.out)]
        threads += [threading.Thread(target=run, args=(_receive_all, s, b))
                    for s, b in zip(self.incoming, self.buffers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def close(self) -> None:
        for s in self.out + self.incoming:
            s.close()


def worker(options: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from lightning_loco.testing.launch import init_gloo
    from lightning_loco.transport import TorchDistributedTransport

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = options["out"]
    init_gloo(rank, 2, file=os.path.join(out, STORE), timeout_s=1800)
    streams: dict[int, Streams] = {}
    try:
        params = options["params"]
        transport = TorchDistributedTransport(torch.device("cpu"), all_reduce="p2p")  # see the module docstring
        payload = torch.randn(params, generator=torch.Generator().manual_seed(rank))
        raw = payload.numpy().tobytes()
        for k in options["streams"]:
            streams[k] = Streams(rank, k)
        work = torch.empty_like(payload)  # what the exchange sums into, filled before each barrier
        steps: dict[str, Any] = {f"tcp×{k}": (lambda s=s: s.exchange(raw)) for k, s in streams.items()}
        steps["noloco pair"] = lambda: transport.group_sum(work, (0, 1))
        steps["diloco all-reduce"] = lambda: transport.all_reduce_sum(work)
        steps["gloo all-reduce"] = lambda: dist.all_reduce(work)  # what our DiLoCo ran before its two-replica path
        learning: dict[str, Any] = {}  # streams="auto": each its own transport, so each learns its own pair counts
        for s in options["transport_streams"]:
            pair = TorchDistributedTransport(torch.device("cpu"), streams=s, all_reduce="p2p")
            everyone = TorchDistributedTransport(torch.device("cpu"), streams=s, all_reduce="p2p")
            steps[f"noloco pair ×{s}"] = lambda t=pair: t.group_sum(work, (0, 1))
            steps[f"diloco all-reduce ×{s}"] = lambda t=everyone: t.all_reduce_sum(work)
            if s == "auto":
                learning.update({f"noloco pair ×{s}": pair, f"diloco all-reduce ×{s}": everyone})
        seconds: dict[str, list[float]] = {name: [] for name in steps}
        # repeat 0 warms every connection; a transport that learns its pair counts first takes its trials
        # (pair_streams: two exchanges at each count, one more before what they showed is taken), untimed
        for _ in range(2 * PAIR_TRIALS - 1):
            for name in learning:
                work.copy_(payload)
                dist.barrier()
                steps[name]()
        for repeat in range(options["repeats"] + 1):
            for name, step in steps.items():
                work.copy_(payload)
                dist.barrier()
                start = time.perf_counter()
                step()
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
        counts = {name: {str(key): {"preferred": p.preferred(), "met": p.met, "seconds": p.seconds}
                         for key, p in t.pair_streams.items()} for name, t in learning.items()}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"seconds": seconds, "pair_streams": counts}, f)
    finally:
        for s in streams.values():
            s.close()
        dist.destroy_process_group()


def tcp_settings() -> dict[str, str]:
    """What the namespaces inherit from the host: the congestion control and the sockets' buffer limits."""
    settings = {}
    for key in ("tcp_congestion_control", "tcp_rmem", "tcp_wmem"):
        try:
            settings[key] = Path(f"/proc/sys/net/ipv4/{key}").read_text().split("\n")[0].strip()
        except OSError:
            settings[key] = "unknown"
    return settings


def measure(mbit: float, one_way_ms: float, loss: float, params: int, streams: list[int], repeats: int,
            wmem: str | None = None, transport_streams: tuple[int | str, ...] = (4,)) -> dict:
    network = uniform(2, mbit=mbit, one_way_ms=one_way_ms, loss=loss)
    sysctls = {"net.ipv4.tcp_slow_start_after_idle": "0"}
    if wmem:
        sysctls["net.ipv4.tcp_wmem"] = wmem
    options = {"params": params, "streams": streams, "repeats": repeats, "transport_streams": list(transport_streams)}
    with tempfile.TemporaryDirectory() as out:
        wall = launch.run_workers("emulated", network, lambda i: ["-m", "benchmarks.link_efficiency", "--worker",
                                                                  json.dumps({**options, "out": out})], timeout=3600,
                                  sysctls=sysctls)
        written = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    ranks = [w["seconds"] for w in written]
    bits = 32 * params  # per direction
    row: dict[str, Any] = {"network": network.name, "mbit": mbit, "one_way_ms": one_way_ms, "loss": loss,
                           "params": params, "wall_s": wall, "runs": {},
                           "tcp": {**tcp_settings(), **({"tcp_wmem": wmem} if wmem else {})},
                           "pair_streams": [w["pair_streams"] for w in written]}
    for name in ranks[0]:
        slower = [max(a, b) for a, b in zip(ranks[0][name], ranks[1][name])]
        rates = [bits / s / 1e6 for s in slower]
        row["runs"][name] = {"seconds": spread(slower), "mbit_s": spread(rates),
                             "fraction": spread([r / mbit for r in rates])}
    best_tcp = max(v["mbit_s"]["median"] for k, v in row["runs"].items() if k.startswith("tcp"))
    for run in row["runs"].values():
        run["of_best_tcp"] = run["mbit_s"]["median"] / best_tcp
    row["best_tcp_fraction"] = best_tcp / mbit
    return row


def _streams_arg(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="100 Mbit/s, 10 ms one way, no loss, 1 M floats, 1 repeat")
    parser.add_argument("--mbit", type=float, help="the link's bandwidth (default 1000)")
    parser.add_argument("--one-way-ms", type=float, help="one-way delay between the nodes (default 100)")
    parser.add_argument("--loss", nargs="+", type=float, help="packet loss between the nodes, each a run "
                        "(default 0 1e-4)")
    parser.add_argument("--params", type=float, help="float32 per direction (default 50e6)")
    parser.add_argument("--streams", nargs="+", type=int, help="TCP connections per direction (default 1 4 8)")
    parser.add_argument("--repeats", type=int, help="timed repeats (default 3)")
    parser.add_argument("--tcp-wmem", help="net.ipv4.tcp_wmem in the namespaces, 'MIN DEFAULT MAX' bytes (default: the "
                        "host's): a connection's send window is at most MAX, so one connection carries at most "
                        "MAX per round trip")
    parser.add_argument("--transport-streams", nargs="*", type=_streams_arg, default=[4],
                        help="s of our transport's streams= to time beside it, an integer or auto (the strategies' "
                        "default) (default 4; none: leave out)")
    parser.add_argument("--out", default="link_efficiency", help="the results' name (default link_efficiency)")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        skip_final_collection()
        return
    ok, why = tun.available()
    if not ok:
        sys.exit(f"the link benchmark needs the emulated network: {why}")
    mbit = args.mbit or (100.0 if args.quick else 1000.0)
    one_way = args.one_way_ms if args.one_way_ms is not None else (10.0 if args.quick else 100.0)
    losses = args.loss if args.loss is not None else ([0.0] if args.quick else [0.0, 1e-4])
    params = int(args.params or (1e6 if args.quick else 50e6))
    streams = args.streams or ([1, 4] if args.quick else [1, 4, 8])
    repeats = args.repeats or (1 if args.quick else 3)
    if any(k < 1 or params * 4 % k for k in streams):
        parser.error(f"--streams {streams}: each must be >= 1 and divide the payload's {params * 4} bytes")
    before = load_average()
    rows = []
    for loss in losses:
        rows.append(measure(mbit, one_way, loss, params, streams, repeats, args.tcp_wmem,
                            tuple(args.transport_streams)))
        print(f"link: {rows[-1]['network']} done in {rows[-1]['wall_s']:.0f} s", flush=True)
    flat = [{"network": row["network"], "what": name, "seconds": run["seconds"]["median"],
             "s_min": run["seconds"]["min"], "s_max": run["seconds"]["max"], "mbit_s": run["mbit_s"]["median"],
             "fraction": run["fraction"]["median"], "of_tcp": run["of_best_tcp"]}
            for row in rows for name, run in row["runs"].items()]
    print(f"\nThe link: {params / 1e6:g} M float32 ({4 * params / 1e6:g} MB) each way at once between two emulated "
          f"nodes, the slower node's time, median [min, max] of {repeats} repeats; rate = payload per direction; "
          f"of link = rate ÷ the configured bandwidth; of TCP = rate ÷ the best tcp×k's; {machine()}")
    print(table(flat, [("network", "network", "s"), ("what", "exchange", "s"), ("seconds", "s", ".2f"),
                       ("s_min", "min", ".2f"), ("s_max", "max", ".2f"), ("mbit_s", "Mbit/s", ".0f"),
                       ("fraction", "of link", ".0%"), ("of_tcp", "of TCP", ".0%")]))
    path = write_json(f"{args.out}.json", {"benchmark": "link efficiency", "repeats": repeats, "rows": rows,
                                               "uptime_before": before, "uptime_after": load_average()},
                      results_dir(args.quick))
    for row in rows:
        if row["best_tcp_fraction"] < 0.8:
            print(f"note: on {row['network']} the best plain TCP reached {row['best_tcp_fraction']:.0%} of the "
                  "configured bandwidth: the emulator's forwarding, or one connection's window (the buffers above), "
                  "may be the limit there, so read 'of TCP' before 'of link'")
    print(f"TCP in the namespaces (from the host): {rows[0]['tcp']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
