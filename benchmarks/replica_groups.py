"""Replicas of several ranks: one outer step with ``ranks_per_replica`` k = 1 and k = 2 at the same
number of processes.

    python -m benchmarks.replica_groups            # ~4 min; emulated where root, modelled otherwise
    python -m benchmarks.replica_groups --quick    # ~15 s: 0.1 M parameters, 1 round

Four processes on the slow network (100 Mbit/s, 50 ms one way). With k = 1 they are four replicas,
each on a site of its own. With k = 2 they are two replicas of two ranks, and the two ranks of a
replica share a site: a fast local link (``benchmarks.netem.links.LAN_MBIT``) that bypasses their
access links, as the GPUs of one machine would. Every process runs the strategies' outer-step code
(``algorithm.step`` over the transport, sliced when k = 2: each rank sends its half on the slow
link, then the replica all-gathers over the local one) on a flat float32 model; one warm-up round,
then ``--rounds`` rounds after a barrier; a round's time is the slowest rank's. Writes
``benchmarks/results/replica_groups.json`` and ``.png`` (a ``--quick`` run writes them to a temporary
folder instead, or to ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.b1_sync_latency import time_outer_steps
from benchmarks.common import grouped_bars, machine, results_dir, skip_final_collection, spread, table, write_json
from benchmarks.netem import launch, tun
from benchmarks.netem.links import uniform

ALGORITHMS = ("noloco", "diloco")
PROCESSES = 4


def worker(k: int, params: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.netem import modelled
    from lightning_loco.algorithms import ALGORITHMS as BY_NAME
    from lightning_loco.testing.launch import init_gloo_from_env
    from lightning_loco.transport import TorchDistributedTransport

    torch.set_num_threads(1)
    rank, world = init_gloo_from_env(timeout_s=900)
    try:
        groups: dict = {}
        if k > 1:  # every rank creates every group, in the same order
            for i in range(world // k):
                g = dist.new_group(list(range(i * k, (i + 1) * k)))
                groups["replica_group"] = g if i == rank // k else groups.get("replica_group")
            for j in range(k):
                g = dist.new_group(list(range(j, world, k)))
                groups["slice_group"] = g if j == rank % k else groups.get("slice_group")
        network = modelled.from_env()
        cls = modelled.ModelledTransport if network is not None else TorchDistributedTransport
        extra = {"network": network} if network is not None else {}
        transport = cls(torch.device("cpu"), ranks_per_replica=k, **groups, **extra)
        replica = rank // k
        delta = 1e-3 * torch.randn(params, generator=torch.Generator().manual_seed(replica))  # same on a replica
        results = {}
        for name in ALGORITHMS:
            sent = transport.stats.bytes_sent
            results[name] = time_outer_steps(BY_NAME[name](), delta, transport, rounds)
            results[f"{name}_bytes"] = (transport.stats.bytes_sent - sent) / (rounds + 1)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure(mode: str, k: int, params: int, rounds: int) -> dict:
    network = uniform(PROCESSES, mbit=100, one_way_ms=50).with_sites(k)
    with tempfile.TemporaryDirectory() as out:
        launch.run_workers(mode, network, lambda i: ["-m", "benchmarks.replica_groups", "--worker", str(k),
                                                     str(params), str(rounds), out])
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(PROCESSES)]
    row = {"mode": mode, "network": network.name, "ranks_per_replica": k, "replicas": PROCESSES // k,
           "params": params}
    for name in ALGORITHMS:
        row[name] = spread([max(rank[name][i] for rank in ranks) for i in range(rounds)])
        row[f"{name}_mb_per_rank"] = ranks[0][f"{name}_bytes"] / 1e6  # sent on the slow link per round
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    labels = [f"k={r['ranks_per_replica']}, {r['params'] / 1e6:g} M" for r in rows]
    grouped_bars(path, labels, {name: [r[name]["median"] for r in rows] for name in ALGORITHMS},
                 "seconds per outer step", title, size=(7, 3.6))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="0.1 M parameters, 1 round")
    parser.add_argument("--mode", choices=["emulated", "modelled"])
    parser.add_argument("--params", nargs="+", type=float)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), int(args.worker[1]), int(args.worker[2]), args.worker[3])
        skip_final_collection()
        return
    results = results_dir(args.quick)
    emulated_ok, why = tun.available()
    mode = args.mode or ("emulated" if emulated_ok else "modelled")
    if mode == "emulated" and not emulated_ok:
        sys.exit(f"emulated mode unavailable: {why}; use --mode modelled")
    sizes = [int(p) for p in (args.params or ([1e5] if args.quick else [1e6, 10e6]))]
    rounds = args.rounds or (1 if args.quick else 3)
    rows = []
    for params in sizes:
        for k in (1, 2):
            rows.append(measure(mode, k, params, rounds))
            r = rows[-1]
            print(f"k={k} {params / 1e6:g} M  noloco {r['noloco']['median']:.3f}s  diloco {r['diloco']['median']:.3f}s",
                  flush=True)
    for r in rows:
        r["noloco_s"], r["diloco_s"] = r["noloco"]["median"], r["diloco"]["median"]
        r["m_params"] = r["params"] / 1e6
    title = (f"{PROCESSES} processes, 100 Mbit/s, 50 ms one way ({mode}); k = 2: a replica's ranks share a site; "
             f"{machine()}")
    print(f"\nOuter step, seconds (slowest rank, median of {rounds} rounds); {title}")
    print(table(rows, [("ranks_per_replica", "ranks per replica", "d"), ("replicas", "replicas", "d"),
                       ("m_params", "M params", "g"), ("noloco_s", "NoLoCo", ".3f"), ("diloco_s", "DiLoCo", ".3f"),
                       ("noloco_mb_per_rank", "NoLoCo MB/rank", ".2f"),
                       ("diloco_mb_per_rank", "DiLoCo MB/rank (nominal)", ".2f")]))
    path = write_json("replica_groups.json", {"benchmark": "replica groups", "mode": mode, "rounds": rounds,
                                              "rows": rows}, results)
    plot(rows, results / "replica_groups.png", title)
    print(f"wrote {path} and {results / 'replica_groups.png'}")


if __name__ == "__main__":
    main()
