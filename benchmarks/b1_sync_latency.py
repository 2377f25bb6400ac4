"""B1, sync latency: the wall time of one outer step, NoLoCo against GASLoC and DiLoCo, and DDP's
per-step gradient all-reduce, by number of replicas, model size and network.

    python -m benchmarks.b1_sync_latency                # full: ~30 min; emulated needs root
    python -m benchmarks.b1_sync_latency --quick        # ~10 s: N = 2, 0.1 M params, a coarser model
    python -m benchmarks.b1_sync_latency --modes loopback modelled --replicas 2 4 --params 1e6

Each configuration starts N gloo processes (one per node; see ``benchmarks/netem``) that run the
strategies' own outer-step code (``algorithm.step`` over the transport) on a flat float32 model, one
warm-up round and then ``--rounds`` timed rounds, each after a barrier. A round's time is that of the
slowest replica; the table gives the median over rounds with [min, max]. DDP's step is one
all-reduce of the whole gradient (DDP itself splits it into 25 MB buckets).

Then the paper's latency model (NoLoCo Eq. 5: a tree all-reduce ≈ 2·t·log2 N message times, a pair
exchange 2·t, with log-normal jitter) is fitted to the measured pair exchanges of the slow network,
compared with the measured all-reduces, and extended to N = 1024, beside the ring all-reduce model.

Writes ``benchmarks/results/b1_sync_latency.json`` and ``b1_sync_latency.png`` (a ``--quick`` run
writes them to a temporary folder instead, or to ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, machine, results_dir, skip_final_collection, spread, table, write_json
from benchmarks.netem import launch, tun
from benchmarks.netem.links import Network, uniform

ALGORITHMS = ("noloco", "gasloc", "diloco", "ddp")


def networks(n: int) -> dict[str, Network]:
    return {"loopback": Network("loopback", uniform(n).links), "wan": uniform(n, mbit=100, one_way_ms=50)}


# ---------------------------------------------------------------- worker


def time_outer_steps(algorithm: Any, delta: Any, transport: Any, rounds: int) -> list[float]:
    """Seconds of ``algorithm.step`` over ``transport``: one warm-up round, then ``rounds`` timed
    rounds, each after a barrier, from live weights = anchor + ``delta`` (a flat float32 model)."""
    import torch
    import torch.distributed as dist

    state = algorithm.init_state(torch.zeros(delta.numel()), [delta.shape])
    times = []
    for r in range(rounds + 1):
        dist.barrier()
        weights = state.anchor + delta
        start = time.perf_counter()
        algorithm.step(state, weights, r, transport)
        if r > 0:
            times.append(time.perf_counter() - start)
    return times


def worker(params: int, rounds: int, out: str, algorithms: tuple[str, ...] = ALGORITHMS) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.netem import modelled
    from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
    from lightning_loco.transport import TorchDistributedTransport

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    try:
        network = modelled.from_env()
        transport = (
            modelled.ModelledTransport(torch.device("cpu"), network=network)
            if network is not None
            else TorchDistributedTransport(torch.device("cpu"))
        )
        delta = 1e-3 * torch.randn(params, generator=torch.Generator().manual_seed(rank))
        results: dict[str, list[float]] = {}
        for name in algorithms:
            algorithm = {"noloco": NoLoCo, "gasloc": GASLoC, "diloco": DiLoCo}.get(name)
            if algorithm is not None:
                results[name] = time_outer_steps(algorithm(), delta, transport, rounds)
                continue
            times = []  # DDP: one all-reduce of a gradient-sized buffer per round
            for r in range(rounds + 1):
                dist.barrier()
                grad = delta.clone()
                start = time.perf_counter()
                transport.all_reduce_sum(grad)
                if r > 0:
                    times.append(time.perf_counter() - start)
            results[name] = times
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def measure(mode: str, network: Network, params: int, rounds: int, algorithms: tuple[str, ...] = ALGORITHMS) -> dict:
    """Times each of ``algorithms`` on ``network``: per round the slowest replica, and per replica its median."""
    with tempfile.TemporaryDirectory() as out:
        wall = launch.run_workers(
            mode, network,
            lambda i: ["-m", "benchmarks.b1_sync_latency", "--worker", str(params), str(rounds), out, *algorithms],
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(len(network.links))]
    row = {"mode": mode, "network": network.name, "replicas": len(network.links), "params": params, "wall_s": wall}
    for name in algorithms:
        slowest = [max(rank[name][k] for rank in ranks) for k in range(rounds)]
        row[name] = spread(slowest)
        row.setdefault("per_replica", {})[name] = [statistics.median(rank[name]) for rank in ranks]
    row["diloco_over_noloco"] = row["diloco"]["median"] / row["noloco"]["median"]
    return row


def latency_model(rows: list[dict], sigma: float = 0.3, trials: int = 100) -> dict:
    """The paper's latency model, fitted to our measurements and extended to N = 1024.

    A message time m = t·LN(σ) (log-normal jitter with mean t). t is fitted as half the measured
    pair exchange on the slow network at the smallest model (the paper counts a pair exchange as
    2·t: a send and a receive). A pair exchange costs two message times and waits for nobody else.
    A tree all-reduce has 2·log2 N levels (reduce, then broadcast), each waiting for the slowest of
    its N/2^(k+1) parallel messages. A ring all-reduce (what gloo and NCCL use for large buffers) has
    2(N−1) steps, each waiting for the slowest of N parallel chunk transfers of 1/N of the model
    (link latency plus chunk at the link's bandwidth).
    """
    slow = [r for r in rows if r["network"] != "loopback"]
    if not slow:
        return {}
    params = min(r["params"] for r in slow)
    points = [r for r in slow if r["params"] == params]
    t = statistics.median(r["noloco"]["median"] for r in points) / 2
    link = uniform(2, mbit=100, one_way_ms=50)
    latency, rate = link.one_way_s(0, 1), link.links[0].bytes_per_s
    rng = random.Random(0)

    def slowest(k: int, scale: float) -> float:  # the slowest of k jittered messages
        return scale * max(rng.lognormvariate(-sigma**2 / 2, sigma) for _ in range(k))

    predictions = []
    for n in [2**k for k in range(1, 11)]:
        pair = statistics.mean(slowest(1, t) + slowest(1, t) for _ in range(trials))
        tree = statistics.mean(
            2 * sum(slowest(max(1, n >> (level + 1)), t) for level in range(int(math.log2(n)))) for _ in range(trials)
        )
        chunk = latency + 4 * params / n / rate
        ring = statistics.mean(sum(slowest(n, chunk) for _ in range(2 * (n - 1))) for _ in range(max(1, trials // 10)))
        predictions.append({"replicas": n, "pair_s": pair, "tree_allreduce_s": tree, "ring_allreduce_s": ring,
                            "tree_over_pair": tree / pair, "ring_over_pair": ring / pair})
    measured = [{"replicas": r["replicas"], "noloco_s": r["noloco"]["median"], "diloco_s": r["diloco"]["median"],
                 "mode": r["mode"]} for r in points]
    return {"params": params, "message_s": t, "jitter_sigma": sigma, "link": link.name,
            "predictions": predictions, "measured": measured}


def plot(rows: list[dict], model: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (mode, net, params), style in zip(
        sorted({(r["mode"], r["network"], r["params"]) for r in rows}), ["o-", "s-", "^-", "v-", "d-", "x-", "+-", "*-"] * 4
    ):
        sub = sorted((r for r in rows if (r["mode"], r["network"], r["params"]) == (mode, net, params)),
                     key=lambda r: r["replicas"])
        ns = [r["replicas"] for r in sub]
        where = mode if mode == "loopback" else f"{mode}, {net}"
        axes[0].plot(ns, [r["diloco"]["median"] / r["noloco"]["median"] for r in sub], style,
                     label=f"{where}, {params / 1e6:g} M params")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("replicas N")
    axes[0].set_ylabel("DiLoCo / NoLoCo outer-step time")
    axes[0].axhline(1, color="grey", lw=0.5)
    axes[0].legend(fontsize=7)
    axes[0].set_title("measured")
    if model:
        ns = [p["replicas"] for p in model["predictions"]]
        axes[1].plot(ns, [p["pair_s"] for p in model["predictions"]], "-", label="pair exchange (model)")
        axes[1].plot(ns, [p["tree_allreduce_s"] for p in model["predictions"]], "-", label="tree all-reduce (model)")
        axes[1].plot(ns, [p["ring_allreduce_s"] for p in model["predictions"]], "--", label="ring all-reduce (model)")
        for m in model["measured"]:
            axes[1].plot(m["replicas"], m["noloco_s"], "ko")
            axes[1].plot(m["replicas"], m["diloco_s"], "rs")
        axes[1].plot([], [], "ko", label="NoLoCo measured")
        axes[1].plot([], [], "rs", label="DiLoCo measured")
        axes[1].set_xscale("log", base=2)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("replicas N")
        axes[1].set_ylabel("seconds per outer step")
        axes[1].set_title(f"latency model, {model['params'] / 1e6:g} M params, σ = {model['jitter_sigma']}")
        axes[1].legend(fontsize=7)
    fig.suptitle(f"B1 sync latency; {machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)  # params rounds out algorithm...
    parser.add_argument("--quick", action="store_true",
                        help="N = 2; 0.1 M parameters; 2 rounds; the latency model from 10 trials (full: 100)")
    parser.add_argument("--modes", nargs="+", choices=launch.MODES, help="default: emulated where root, else modelled; and loopback")
    parser.add_argument("--replicas", nargs="+", type=int)
    parser.add_argument("--params", nargs="+", type=float)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--out", default="b1_sync_latency")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON of an earlier run")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        plot(saved["rows"], saved["latency_model"], RESULTS / f"{args.out}.png")
        return
    if args.worker:
        worker(int(float(args.worker[0])), int(args.worker[1]), args.worker[2], tuple(args.worker[3:]) or ALGORITHMS)
        skip_final_collection()
        return
    results = results_dir(args.quick)
    emulated_ok, why = tun.available()
    modes = args.modes or ["loopback", "emulated" if emulated_ok else "modelled"]
    replicas = args.replicas or ([2] if args.quick else [2, 4, 8])
    sizes = [int(p) for p in (args.params or ([1e5] if args.quick else [1e6, 10e6, 50e6]))]
    rounds = args.rounds or (2 if args.quick else 3)
    if "emulated" in modes and not emulated_ok:
        sys.exit(f"emulated mode unavailable: {why}; use --modes loopback modelled")
    rows = []
    for mode in modes:
        for n in replicas:
            for params in sizes:
                net = networks(n)["loopback" if mode == "loopback" else "wan"]
                row = measure(mode, net, params, rounds)
                rows.append(row)
                print(f"{mode:>9} {net.name:<28} N={n:<3} {params / 1e6:>5g} M  "
                      + "  ".join(f"{a} {row[a]['median']:.3f}s" for a in ALGORITHMS), flush=True)
    model = latency_model(rows, trials=10 if args.quick else 100)
    flat = [{**r, **{a: r[a]["median"] for a in ALGORITHMS}, "params_m": r["params"] / 1e6} for r in rows]
    print(f"\nB1: seconds per outer step (slowest replica, median of {rounds} rounds); {machine()}")
    print(table(flat, [("mode", "mode", "s"), ("network", "network", "s"), ("replicas", "N", "d"),
                       ("params_m", "M params", "g"), ("noloco", "NoLoCo", ".3f"), ("gasloc", "GASLoC", ".3f"),
                       ("diloco", "DiLoCo", ".3f"), ("ddp", "DDP step", ".3f"),
                       ("diloco_over_noloco", "DiLoCo/NoLoCo", ".2f")]))
    if model:
        print(f"\nlatency model: message time t = {model['message_s']:.3f} s (fitted: half the measured pair "
              f"exchange, {model['params'] / 1e6:g} M params), log-normal jitter σ = {model['jitter_sigma']}")
        print(table(model["predictions"], [("replicas", "N", "d"), ("pair_s", "pair s", ".3f"),
                                           ("tree_allreduce_s", "tree all-reduce s", ".3f"),
                                           ("tree_over_pair", "tree/pair", ".1f"),
                                           ("ring_allreduce_s", "ring all-reduce s", ".3f"),
                                           ("ring_over_pair", "ring/pair", ".1f")]))
    labels = sorted({r["mode"] for r in rows})
    path = write_json(f"{args.out}.json", {"benchmark": "B1 sync latency", "modes": labels, "rounds": rounds,
                                           "modelled_note": "rows with mode 'modelled' are modelled, not measured",
                                           "rows": rows, "latency_model": model}, results)
    plot(rows, model, results / f"{args.out}.png")
    print(f"wrote {path} and {results / (args.out + '.png')}")


if __name__ == "__main__":
    main()
