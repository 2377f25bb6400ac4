"""B1, sync latency: the wall time of one outer step, NoLoCo against GASLoC and DiLoCo, and DDP's
per-step gradient all-reduce, by number of replicas, model size and network.

    python -m benchmarks.b1_sync_latency                # full; emulated needs root
    python -m benchmarks.b1_sync_latency --quick        # ~20 s: N = 2, 0.1 M params, a coarser model
    python -m benchmarks.b1_sync_latency --modes loopback modelled --replicas 2 4 --params 1e6
    python -m benchmarks.b1_sync_latency --parts idle --congestion cubic bbr   # slow start after idle
    python -m benchmarks.b1_sync_latency --parts main --replicas 4 --params 50e6 --methods noloco diloco \
        --codecs float32 bfloat16 int8 --out b1_codecs_50m                   # wire formats
    python -m benchmarks.b1_sync_latency --parts fragments --params 10e6       # F = 1 against F = 4, overlapped

Each configuration starts N gloo processes (one per node; see ``benchmarks/netem``) that run the
strategies' own outer-step code (``algorithm.step`` over the transport) on a flat float32 model. A
round's time is that of the slowest replica; the table gives the median over rounds with [min, max].
DDP's step is one all-reduce of the whole gradient (DDP itself splits it into 25 MB buckets).

Like with like. gloo connects every pair of ranks when the process group is created, but a
connection that has never carried data starts TCP slow start from its initial window: on the
emulated WAN the first 4 MB exchange on a pair took 0.90 s, the next ones 0.44 s. NoLoCo (groups of
two) and GASLoC (random pairs) draw the same pairs from ``(seed, t)``, so whichever method was timed
first met every pair cold and the second one met them warm (NoLoCo 0.91 s against GASLoC 0.49 s at
N = 8; GASLoC 0.97 s against NoLoCo 0.46 s with the order swapped). Linux also changes a connection's
state after silence: CUBIC and Reno restart slow start after one retransmission timeout of
silence (``net.ipv4.tcp_slow_start_after_idle``), and BBR, which ignores that setting, probes its
minimum RTT again after 10 s. Hence, by default:

* before any timed round, every pair of replicas exchanges 4 MB once (``warm_all_pairs``; ``--cold``
  skips it), so no method meets a connection that never carried a model;
* rounds are interleaved: round r of every method, in turn, then round r + 1 (round 0 is a warm-up);
* every outer step follows ``--idle`` seconds of silence (default 11: the H inner steps of real
  training, and past both of Linux's idle thresholds, so that every method meets the connection
  state that real outer steps meet, whichever method used the pair last). DDP's all-reduces follow
  each other without the gap, as in training.

Wire formats (``--codecs``, default float32 only). Each (method, codec) is one more turn in every
round, with its own error-feedback residual where the strategies keep one (DiLoCo's pseudo-gradient
with a lossy codec); the codecs of one method share its outer state (one outer step each, in turn),
so that 50 M parameters fit in memory N times; the payload travels as :mod:`lightning_loco.wire.codecs`
encodes it. The table of wire formats gives float32's time over each codec's, taken round by round
(the same round r of both), and the payload bytes each replica sent (the transport's count, before
TCP/IP headers). On loopback the link costs almost nothing, so the same codecs there show what
encoding and decoding cost.

The ``idle`` part measures what that silence costs: two nodes, one pair, and rounds that alternate
``net.ipv4.tcp_slow_start_after_idle`` = 1 and 0 (set inside the emulated namespaces, deleted with
them) after a gap of silence, with the sender's congestion window before each exchange from ``ss``.

The ``fragments`` part (:mod:`benchmarks.b1_fragments`, not run by default) runs the strategies' driver
with overlap and streaming fragments, F = 1 against F = 4, with modelled compute between the rounds.

Then the paper's latency model (NoLoCo Eq. 5: a tree all-reduce ≈ 2·t·log2 N message times, a pair
exchange 2·t, with log-normal jitter) is fitted to the measured pair exchanges of the slow network,
compared with the measured all-reduces, and extended to N = 1024, beside the ring all-reduce model.

Writes ``benchmarks/results/b1_sync_latency.json`` and ``b1_sync_latency.png`` (a ``--quick`` run
writes them to a temporary folder instead, or to ``$LOCO_BENCH_RESULTS``).

This module holds the workers and the measurements; what it shares with the fragments part (the methods, the
networks, warming every pair, building a method) is :mod:`benchmarks.b1_shared`; ``ss`` and the congestion controls
are read by :mod:`benchmarks.netem.tcp`, the latency model is :mod:`benchmarks.latency_model`, and the tables and
the plot are :mod:`benchmarks.b1_report`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import b1_report
from benchmarks.b1_shared import ALGORITHMS, CODECS, STORE, WARM_NUMEL, build, networks, warm_all_pairs
from benchmarks.common import RESULTS, load_average, results_dir, skip_final_collection, spread, write_json
from benchmarks.latency_model import latency_model
from benchmarks.netem import launch, tun
from benchmarks.netem.links import Network, uniform
from benchmarks.netem.tcp import check_congestion, host_congestion, ss_connections, ss_text, tcp_connections
from lightning_loco.testing.launch import init_gloo

# ---------------------------------------------------------------- worker


def time_outer_steps(algorithm: Any, delta: Any, transport: Any, rounds: int) -> list[float]:
    """Seconds of one blocking outer step (``rounds.step``) over ``transport``: one warm-up round, then ``rounds`` timed
    rounds, each after a barrier, from live weights = anchor + ``delta`` (a flat float32 model)."""
    import torch
    import torch.distributed as dist

    from lightning_loco.driver.rounds import step as outer_step

    state = algorithm.init_state(torch.zeros(delta.numel()), [delta.shape])
    times = []
    for r in range(rounds + 1):
        dist.barrier()
        weights = state.anchor + delta
        start = time.perf_counter()
        outer_step(algorithm, state, weights, r, transport)
        if r > 0:
            times.append(time.perf_counter() - start)
    return times


def column(name: str, codec: str) -> str:
    """The result key of ``name`` with ``codec``: the method's name for float32 (as before codecs),
    else ``name+codec`` (``noloco+int8``)."""
    return name if codec == "float32" else f"{name}+{codec}"


def worker(params: int, rounds: int, out: str, algorithms: tuple[str, ...] = ALGORITHMS, warm_pairs: bool = False,
           idle: float = 0.0, codecs: tuple[str, ...] = ("float32",)) -> None:
    """Times every (method, codec) of ``algorithms`` × ``codecs`` round by round, interleaved: round r
    of each in turn (all codecs of a method, then the next method), each after ``idle`` seconds of
    silence (outer-step methods only: DDP's all-reduces follow each other back to back, in float32)
    and a barrier. Round 0 is a warm-up and is not timed. Also notes the payload bytes this replica
    sent in each timed round (the transport's count, before TCP/IP headers)."""
    import torch
    import torch.distributed as dist

    from benchmarks.netem import modelled
    from lightning_loco.driver.rounds import step as outer_step
    from lightning_loco.transport import TorchDistributedTransport

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_gloo(rank, world, file=os.path.join(out, STORE), timeout_s=900)
    try:
        network = modelled.from_env()
        transport = (
            modelled.ModelledTransport(torch.device("cpu"), network=network)
            if network is not None
            else TorchDistributedTransport(torch.device("cpu"))
        )
        if warm_pairs:
            warm_all_pairs(transport, min(params, WARM_NUMEL))
        delta = 1e-3 * torch.randn(params, generator=torch.Generator().manual_seed(rank))
        steps: dict[str, Callable[[int], None]] = {}
        for name in algorithms:
            if name == "ddp":  # one all-reduce of a gradient-sized buffer per round
                steps[name] = lambda r: transport.all_reduce_sum(delta.clone())
                continue
            state = None  # the codecs of one method take turns on one outer state (memory: 50 M × N replicas)
            for codec in codecs:
                algorithm, wire = build(name, codec)
                if codec == "topk" and not algorithm.payload_is_pseudo_gradient:
                    continue  # the strategies refuse topk for weights (rule topk-pseudo-gradient-only)
                if state is None:
                    state = algorithm.init_state(torch.zeros(params), [delta.shape])
                residual = torch.zeros(algorithm.payload_numel(state)) if wire.error_feedback else None
                steps[column(name, codec)] = (
                    lambda r, a=algorithm, s=state, w=(wire if wire.lossy else None), e=residual:
                    outer_step(a, s, s.anchor + delta, r, transport, wire=w, residual=e)
                )
        results: dict[str, list[float]] = {key: [] for key in steps}
        sent: dict[str, list[int]] = {key: [] for key in steps}
        for r in range(rounds + 1):
            for key, step in steps.items():
                if idle and r > 0 and key != "ddp":
                    time.sleep(idle)
                dist.barrier()
                before = transport.stats.bytes_sent
                start = time.perf_counter()
                step(r)
                if r > 0:
                    results[key].append(time.perf_counter() - start)
                    sent[key].append(transport.stats.bytes_sent - before)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"seconds": results, "bytes_sent": sent}, f)
    finally:
        dist.destroy_process_group()


def idle_worker(params: int, rounds: int, out: str, gaps: list[float]) -> None:
    """Two replicas, one pair. After one exchange that warms the connection, every round sets
    ``net.ipv4.tcp_slow_start_after_idle`` in this node's namespace (1 and 0 in turn), stays silent
    for a gap, and times one pair exchange; it also notes the congestion window towards the peer
    just before the exchange (after the barrier, whose few bytes already restarted it if it was to
    restart)."""
    import torch
    import torch.distributed as dist

    from lightning_loco.transport import TorchDistributedTransport

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the emulator gives node i the address <subnet>.<i + 1>, and MASTER_ADDR is node 0's
    peer_address = f"{os.environ['MASTER_ADDR'].rsplit('.', 1)[0]}.{2 - rank}"
    init_gloo(rank, world, file=os.path.join(out, STORE), timeout_s=900)
    try:
        transport = TorchDistributedTransport(torch.device("cpu"))
        buf = torch.ones(params)
        # did gloo connect when the process group was created? (the ranks meet through a file: every
        # connection between them is gloo's)
        first: dict[str, Any] = {"after_init": [c for peer, c in ss_connections(ss_text()) if peer == peer_address]}
        for label in ("cold", "warm"):  # the connection's first model, then at once a second one
            dist.barrier()
            start = time.perf_counter()
            transport.group_sum(buf, (0, 1))
            first[f"{label}_s"] = time.perf_counter() - start
            first[f"after_{label}"] = tcp_connections().get(peer_address)
        settings = [(gap, ssai) for _ in range(rounds) for gap in gaps for ssai in (1, 0)]
        rows = []
        for gap, ssai in settings:
            subprocess.run(["sysctl", "-q", "-w", f"net.ipv4.tcp_slow_start_after_idle={ssai}"], check=True)
            dist.barrier()
            time.sleep(gap)
            dist.barrier()
            cwnd = tcp_connections().get(peer_address, {}).get("cwnd")
            start = time.perf_counter()
            transport.group_sum(buf, (0, 1))
            rows.append({"gap_s": gap, "slow_start_after_idle": ssai, "seconds": time.perf_counter() - start,
                         "cwnd_before": cwnd})
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"first": first, "rounds": rows}, f)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def measure(mode: str, network: Network, params: int, rounds: int, algorithms: tuple[str, ...] = ALGORITHMS,
            warm_pairs: bool = False, idle: float = 0.0, congestion: str | None = None,
            codecs: tuple[str, ...] = ("float32",)) -> dict:
    """Times each of ``algorithms`` × ``codecs`` on ``network`` (keys: :func:`column`): per round the
    slowest replica, and per replica its median. ``warm_pairs``, ``idle``: see :func:`worker`;
    ``congestion``: the TCP congestion control in the emulated namespaces (default: theirs, inherited
    from the host). With float32 and another codec, ``speedup`` holds, per (method, codec), float32's
    time over the codec's, round by round (the same round r of both)."""
    options = {"params": params, "rounds": rounds, "algorithms": list(algorithms), "warm_pairs": warm_pairs,
               "idle": idle, "codecs": list(codecs)}
    sysctls = {"net.ipv4.tcp_congestion_control": congestion} if congestion else None
    with tempfile.TemporaryDirectory() as out:
        wall = launch.run_workers(
            mode, network,
            lambda i: ["-m", "benchmarks.b1_sync_latency", "--worker", json.dumps({**options, "out": out})],
            sysctls=sysctls,
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(len(network.links))]
    row: dict[str, Any] = {
        "mode": mode, "network": network.name, "replicas": len(network.links), "params": params, "wall_s": wall,
        "warm_pairs": warm_pairs, "idle_s": idle,
        "tcp": (congestion or host_congestion()) if mode == "emulated" else None,
        "codecs": list(codecs), "per_replica": {}, "bytes_sent": {}, "speedup": {},
    }
    slowest: dict[str, list[float]] = {}
    for key in ranks[0]["seconds"]:
        slowest[key] = [max(rank["seconds"][key][k] for rank in ranks) for k in range(rounds)]
        row[key] = spread(slowest[key])
        row["per_replica"][key] = [statistics.median(rank["seconds"][key]) for rank in ranks]
        row["bytes_sent"][key] = [statistics.mean(rank["bytes_sent"][key]) for rank in ranks]  # per replica and round
    for name in algorithms:
        for codec in codecs if name != "ddp" and "float32" in codecs else []:
            if codec != "float32" and column(name, codec) in slowest:
                key = column(name, codec)
                row["speedup"][key] = spread([a / b for a, b in zip(slowest[name], slowest[key])])
    if "noloco" in algorithms and "diloco" in algorithms:
        row["diloco_over_noloco"] = row["diloco"]["median"] / row["noloco"]["median"]
    return row


def measure_idle(
    network: Network, params: int, rounds: int, gaps: list[float], congestion: str | None
) -> tuple[list[dict], dict]:
    """The idle study (emulated, two nodes): per gap and setting of slow start after idle, the
    slowest replica's pair exchange per round, and the ratio on/off of consecutive rounds; and the
    connection's first exchange (cold) against the one right after it (warm), with ``ss``'s view of
    the connection after the process group's creation and after each."""
    sysctls = {"net.ipv4.tcp_congestion_control": congestion} if congestion else None
    with tempfile.TemporaryDirectory() as out:
        launch.run_workers(
            "emulated", network,
            lambda i: ["-m", "benchmarks.b1_sync_latency", "--idle-worker",
                       json.dumps({"params": params, "rounds": rounds, "out": out, "gaps": gaps})],
            sysctls=sysctls,
        )
        saved = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    ranks = [s["rounds"] for s in saved]
    cc = congestion or host_congestion()
    first = {"tcp": cc, "params": params, "cold_s": max(s["first"]["cold_s"] for s in saved),
             "warm_s": max(s["first"]["warm_s"] for s in saved), "per_rank": [s["first"] for s in saved]}
    rows = []
    for gap in gaps:
        picked = {ssai: [k for k, e in enumerate(ranks[0]) if e["gap_s"] == gap and e["slow_start_after_idle"] == ssai]
                  for ssai in (1, 0)}
        slowest = {ssai: [max(rank[k]["seconds"] for rank in ranks) for k in ks] for ssai, ks in picked.items()}
        ratios = [on / off for on, off in zip(slowest[1], slowest[0])]  # consecutive rounds: on, then off
        for ssai in (1, 0):
            cwnds = [rank[k]["cwnd_before"] for rank in ranks for k in picked[ssai]
                     if rank[k]["cwnd_before"] is not None]
            rows.append({"tcp": cc, "params": params, "gap_s": gap, "slow_start_after_idle": ssai,
                         "seconds": spread(slowest[ssai]), "cwnd_before": spread(cwnds) if cwnds else None,
                         "on_over_off": spread(ratios)})
    return rows, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: the worker's options
    parser.add_argument("--idle-worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="N = 2; 0.1 M parameters; 2 rounds; no idle gap; the latency model from 10 trials "
                        "(full: 100)")
    parser.add_argument("--parts", nargs="+", choices=("main", "idle", "fragments"),
                        help="main: the methods side by side; idle: the cost of slow start after idle (emulated); "
                             "fragments: the driver with overlap, F = 1 against F = 4 (benchmarks.b1_fragments). "
                             "Default: main, and idle where emulation runs (not with --quick)")
    parser.add_argument("--modes", nargs="+", choices=launch.MODES,
                        help="default: emulated where root, else modelled; and loopback")
    parser.add_argument("--replicas", nargs="+", type=int)
    parser.add_argument("--params", nargs="+", type=float)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--methods", nargs="+", choices=ALGORITHMS,
                        help="the methods and the order of their turns in every round (the table needs noloco and "
                             "diloco). Default: all four; the fragments part: noloco diloco")
    parser.add_argument("--idle", type=float,
                        help="emulated mode: seconds of silence before every timed outer step, the "
                        "H inner steps of real training (default 11; 0 with --quick)")
    parser.add_argument("--codecs", nargs="+", choices=tuple(CODECS), default=["float32"],
                        help="the wire formats of the outer-step methods (not DDP's): each (method, codec) takes its "
                             "own turn in every round; the table of wire formats gives float32's time over each "
                             "other codec's (float32 needed for that). Default: float32 only")
    parser.add_argument("--cold", action="store_true",
                        help="do not warm every pair before timing (how B1 ran before; first-timed methods pay "
                        "slow start)")
    parser.add_argument("--congestion", nargs="+",
                        help="emulated mode: the TCP congestion control(s) in the namespaces (default: the host's)")
    parser.add_argument("--idle-params", nargs="+", type=float, default=[1e6, 10e6], help="idle part: model sizes")
    parser.add_argument("--idle-gaps", nargs="+", type=float, default=[5.0], help="idle part: seconds of silence")
    parser.add_argument("--idle-rounds", type=int, default=6, help="idle part: rounds per gap and setting")
    parser.add_argument("--out", help="the results' name (default b1_sync_latency; the fragments part alone: "
                        "b1_fragments, beside other parts: <out>_fragments)")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON of an earlier run")
    from benchmarks import b1_fragments

    b1_fragments.add_arguments(parser)
    args = parser.parse_args()
    out = args.out or "b1_sync_latency"
    methods = args.methods or list(ALGORITHMS)
    if args.replot:
        saved = json.loads((RESULTS / f"{out}.json").read_text())
        b1_report.plot(saved["rows"], saved["latency_model"], RESULTS / f"{out}.png")
        return
    if args.worker:
        options = json.loads(args.worker)
        worker(options["params"], options["rounds"], options["out"], tuple(options["algorithms"]),
               options["warm_pairs"], options["idle"], tuple(options.get("codecs", ["float32"])))
        skip_final_collection()
        return
    if args.idle_worker:
        options = json.loads(args.idle_worker)
        idle_worker(options["params"], options["rounds"], options["out"], options["gaps"])
        skip_final_collection()
        return
    results = results_dir(args.quick)
    emulated_ok, why = tun.available()
    parts = args.parts or (["main"] + (["idle"] if emulated_ok and not args.quick else []))
    if "fragments" in parts:  # its own defaults (the slow link; loopback with --quick) and results file
        fragment_modes = args.modes or (["loopback", "modelled"] if args.quick else
                                        ["emulated" if emulated_ok else "modelled"])
        if "emulated" in fragment_modes and not emulated_ok:
            sys.exit(f"emulated mode unavailable: {why}; use --modes modelled")
        alone = parts == ["fragments"]
        b1_fragments.run(args, fragment_modes, networks, results,
                         (args.out or "b1_fragments") if alone else f"{args.out or 'b1'}_fragments")
        if alone:
            return
    modes = args.modes or ["loopback", "emulated" if emulated_ok else "modelled"]
    replicas = args.replicas or ([2] if args.quick else [2, 4, 8])
    sizes = [int(p) for p in (args.params or ([1e5] if args.quick else [1e6, 10e6, 50e6]))]
    rounds = args.rounds or (2 if args.quick else 3)
    idle = args.idle if args.idle is not None else (0.0 if args.quick else 11.0)
    if ("emulated" in modes or "idle" in parts) and not emulated_ok:
        sys.exit(f"emulated mode unavailable: {why}; use --modes loopback modelled and --parts main")
    congestion = args.congestion or [None]
    if args.congestion:
        check_congestion(args.congestion)
    # the methods' table and the latency model compare NoLoCo with DiLoCo; the wire formats' table
    # compares each method with itself, so with several codecs one method may run alone (memory at 50 M)
    both = {"noloco", "diloco"} <= set(methods)
    if "main" in parts and not both and len(args.codecs) < 2:
        parser.error(f"--methods {' '.join(methods)}: the table and the latency model need noloco and diloco "
                     "(or give several --codecs to compare the wire formats of one method)")
    uptime_before = load_average()
    rows: list[dict] = []
    for mode in modes if "main" in parts else []:
        for cc in congestion if mode == "emulated" else [None]:
            for n in replicas:
                for params in sizes:
                    net = networks(n)["loopback" if mode == "loopback" else "wan"]
                    # loopback and the modelled network have no slow connection to go idle
                    row = measure(mode, net, params, rounds, tuple(methods), warm_pairs=not args.cold,
                                  idle=idle if mode == "emulated" else 0.0, congestion=cc, codecs=tuple(args.codecs))
                    rows.append(row)
                    print(f"{mode:>9} {net.name:<28} {row['tcp'] or '':<6} N={n:<3} {params / 1e6:>5g} M  "
                          + "  ".join(f"{k} {row[k]['median']:.3f}s" for k in row["per_replica"]), flush=True)
    idle_rows: list[dict] = []
    first_rows: list[dict] = []
    for cc in congestion if "idle" in parts else []:
        for params in args.idle_params:
            measured, first = measure_idle(uniform(2, mbit=100, one_way_ms=50), int(params), args.idle_rounds,
                                           args.idle_gaps, cc)
            idle_rows += measured
            first_rows.append(first)
            print(f"idle part: {first['tcp']} {params / 1e6:g} M done", flush=True)
    model = latency_model(rows, trials=10 if args.quick else 100) if both else {}
    if rows and both:
        b1_report.print_methods(rows, methods, rounds, not args.cold, idle)
    if rows and args.codecs != ["float32"]:
        b1_report.print_codecs(rows, rounds)
    if model:
        b1_report.print_latency_model(model)
    if idle_rows:
        b1_report.print_idle(idle_rows, first_rows, args.idle_rounds)
    labels = sorted({r["mode"] for r in rows})
    path = write_json(f"{out}.json", {"benchmark": "B1 sync latency", "modes": labels, "rounds": rounds,
                                      "warm_pairs": not args.cold, "idle_s": idle,
                                      "modelled_note": "rows with mode 'modelled' are modelled, not measured",
                                      "rows": rows, "latency_model": model, "idle_rows": idle_rows,
                                      "first_exchange": first_rows, "uptime_before": uptime_before,
                                      "uptime_after": load_average()}, results)
    if rows and both:
        b1_report.plot(rows, model, results / f"{out}.png")
    print(f"wrote {path}" + (f" and {results / (out + '.png')}" if rows and both else ""))


if __name__ == "__main__":
    main()
