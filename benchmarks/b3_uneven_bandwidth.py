"""B3, uneven bandwidth: one replica behind a link 10× slower and 4× farther than the others.

    python -m benchmarks.b3_uneven_bandwidth            # ~10 min; emulated where root, modelled otherwise
    python -m benchmarks.b3_uneven_bandwidth --quick    # ~15 s: part 1 only, 0.1 M params, 1 round, no DDP

Two parts, both on 4 replicas where node 3 has 10 Mbit/s and a 200 ms one-way latency to every
peer (the others: 100 Mbit/s, 50 ms):

1. Outer-step wall time per replica for NoLoCo, GASLoC and DiLoCo (B1's workers, 1 M parameters):
   in an all-reduce everybody waits for the slowest link; in a pair exchange only the slow
   replica's partner of the round does.
2. Time to the target validation loss on the Shakespeare example (B2's runs on this network).

Writes ``benchmarks/results/b3_uneven_bandwidth.json`` and ``.png`` (+ ``_time_to_loss.json`` and ``.png``;
a ``--quick`` run writes them to a temporary folder instead, or to ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import b1_sync_latency, b2_time_to_loss
from benchmarks.common import RESULTS, grouped_bars, machine, results_dir, table, write_json
from benchmarks.netem import tun
from benchmarks.netem.links import one_slow


def plot(saved: dict, path: Path) -> None:
    """Each replica's median outer-step time, per algorithm (the slow replica last)."""
    per = saved["raw"]["per_replica"]
    names = [r["algorithm"] for r in saved["rows"]]
    n = len(per[names[0]])
    series = {f"replica {k}" + (" (slow link)" if k == n - 1 else ""): [per[a][k] for a in names] for k in range(n)}
    grouped_bars(path, names, series, "seconds per outer step (median over rounds)",
                 f"B3 uneven bandwidth: {saved['network']['name']} ({saved['mode']}, "
                 f"{saved['raw']['params'] / 1e6:g} M params); {saved['machine']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="outer-step times only, 0.1 M parameters, 1 round, without B1's DDP step")
    parser.add_argument("--mode", choices=["emulated", "modelled"])
    parser.add_argument("--params", type=float, help="default 1e6; quick: 1e5")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON of an earlier run")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((RESULTS / "b3_uneven_bandwidth.json").read_text()), RESULTS / "b3_uneven_bandwidth.png")
        return
    results = results_dir(args.quick)
    emulated_ok, why = tun.available()
    mode = args.mode or ("emulated" if emulated_ok else "modelled")
    if mode == "emulated" and not emulated_ok:
        sys.exit(f"emulated mode unavailable: {why}; use --mode modelled")
    args.params = args.params or (1e5 if args.quick else 1e6)
    network = one_slow(4)
    # the full run also times B1's DDP step (kept in "raw"); the table leaves it out
    algorithms = ("noloco", "gasloc", "diloco") if args.quick else b1_sync_latency.ALGORITHMS
    row = b1_sync_latency.measure(mode, network, int(args.params), rounds=1 if args.quick else 4, algorithms=algorithms)
    rows = []
    for name in ("noloco", "gasloc", "diloco"):
        per = row["per_replica"][name]
        rows.append({"algorithm": name, "slowest_s": row[name]["median"], "fast_replicas_s": sorted(per[:3])[1],
                     "slow_replica_s": per[3], "fast_wait_share": sorted(per[:3])[1] / row[name]["median"]})
    print(f"\nB3: seconds per outer step with one slow replica ({network.name}; {mode}, "
          f"{args.params / 1e6:g} M params); {machine()}")
    print(table(rows, [("algorithm", "algorithm", "s"), ("fast_replicas_s", "fast replicas (median)", ".3f"),
                       ("slow_replica_s", "slow replica", ".3f"), ("slowest_s", "slowest", ".3f"),
                       ("fast_wait_share", "fast/slowest", ".2f")]))
    path = write_json("b3_uneven_bandwidth.json", {"benchmark": "B3 uneven bandwidth", "mode": mode,
                                                    "network": network.describe(), "rows": rows, "raw": row}, results)
    plot(json.loads(path.read_text()), results / "b3_uneven_bandwidth.png")
    print(f"wrote {path} and {results / 'b3_uneven_bandwidth.png'}")
    if not args.quick:
        b2_time_to_loss.main(["--network", "one_slow", "--mode", mode, "--methods", "diloco", "noloco", "gasloc"],
                             default_out="b3_uneven_bandwidth_time_to_loss",
                             benchmark="B3 uneven bandwidth, time to loss")


if __name__ == "__main__":
    main()
