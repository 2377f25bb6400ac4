"""Elastic replicas: goodput with a replica killed every M seconds against no failures, the time from a
replica's start to its first round, and what the membership costs on the healthy path.

    python -m benchmarks.elastic_goodput            # ~8 min on 2 cores: 3 variants × 3 repeats, interleaved
    python -m benchmarks.elastic_goodput --quick    # ~1.5 min: 1 repeat, shorter runs, a kill every 6 s

Each run is a Lighthouse process (``min_replicas=2``, heartbeat timeout 2 s) and four replica processes
of ``examples/elastic/replica.py`` (NoLoCo, a tiny regression model, H = 4, 20 ms of sleep per step standing
for a bigger model's compute, ``max_steps`` = 600, or 240 with ``--quick``). Variants:

* ``steady K=1``: no failure, a membership refresh requested at every outer step (the default);
* ``steady K=4``: no failure, ``membership_every=4``;
* ``kill every M s``: M seconds after training starts and every M seconds after (default 10; 6 with
  ``--quick``), until r0 is 60 % through, one replica (r1, r2, r3 in turn) is killed with SIGKILL and
  started again at once under the same id; it heals from a live replica. r0 is never killed.

``outer_step_timeout`` is 10 s. Goodput is inner steps per second summed over the live replicas, over
the training window: from r0's first round to r0's end (start-up, the same in every variant, is left
out; it is the "start → first round" column). The killed processes' steps up to their death count. A
replica still waiting to be admitted 20 s after r0 ended is killed and its steps counted. "outer steps/s" is
the run's progress over the same window (r0's rounds). "start → first round" is a replica process's
launch to its first round (imports, Lightning's setup, the Lighthouse's quorum and, for a restarted
replica, healing). "switch wait" is what the training thread waited for the next membership at a switch
(median and 95th percentile over all switches of the steady runs). Writes
``benchmarks/results/elastic_goodput.json`` (``--quick``: a temporary folder, or ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, results_dir, spread, table

REPLICA = ROOT / "examples" / "elastic" / "replica.py"
IDS = ("r0", "r1", "r2", "r3")


def run(variant: str, max_steps: int, kill_every: float, limit: float) -> dict[str, Any]:
    from lightning_loco.testing.elastic import Lighthouse, Replicas

    every = 4 if variant == "steady K=4" else 1
    kills = variant.startswith("kill")
    out = Path(tempfile.mkdtemp(prefix="elastic_goodput_"))
    with Lighthouse(min_replicas=2, heartbeat_timeout_ms=2000) as lighthouse:
        replicas = Replicas(REPLICA, out, lighthouse.address, limit_s=limit + 20, max_steps=max_steps, sync_every=4,
                            step_sleep=0.02, outer_step_timeout=10, membership_every=every)
        started = time.time()
        procs = {rid: replicas.start(rid) for rid in IDS}
        launches, killed_steps, n = 4, 0, 4
        victims = ["r1", "r2", "r3"]
        next_kill = None  # M seconds after training starts (r0's first step), then every M seconds
        leftover_steps = 0
        try:
            while procs["r0"].poll() is None:
                if time.time() - started > limit:
                    raise RuntimeError(f"{variant}: a run took longer than {limit} s; logs in {out}")
                if next_kill is None and replicas.progress("r0") > 0:
                    next_kill = time.time() + kill_every
                if kills and next_kill is not None and time.time() >= next_kill:
                    victim = victims[(n - 4) % 3]
                    proc = procs[victim]
                    early = replicas.progress("r0") < 0.6 * max_steps
                    if proc.poll() is None and replicas.progress(victim) > 0 and early:
                        replicas.kill(proc)
                        killed_steps += replicas.progress(victim)
                        procs[victim] = replicas.start(victim)
                        launches += 1
                    n += 1
                    next_kill = time.time() + kill_every
                time.sleep(0.05)
            # r0 (never killed) has finished: the others finish with it, except a replica restarted too late to
            # join before the end, which would wait for a membership until its join_timeout
            deadline = time.time() + 20
            for rid, proc in procs.items():
                try:
                    replicas.wait(proc, timeout_s=max(0.1, deadline - time.time()))
                except TimeoutError:
                    replicas.kill(proc)
                    leftover_steps += replicas.progress(rid)
        finally:
            replicas.close()
    wall = time.time() - started
    records = [replicas.record(rid) for rid in IDS if (out / f"{rid}.json").exists()]
    # The training window: r0's first round (every variant starts alike) to r0's end
    begin, end = records[0]["rounds"][0]["time"], records[0]["ended"]
    window = end - begin
    steps = killed_steps + leftover_steps + sum(1 for r in records for t, _, _ in r["losses"] if begin <= t <= end)
    rounds = [x for r in records for x in r["rounds"]]
    first_round = {r["replica_id"]: r["rounds"][0]["time"] - r["started"] for r in records}
    restarted = [first_round[r["replica_id"]] for r in records
                 if kills and launches > 4 and r["replica_id"] != "r0" and r["started"] > begin]
    outer = [x["outer_step"] for x in records[0]["rounds"] if begin <= x["time"] <= end]
    return {
        "variant": variant, "wall_s": wall, "window_s": window, "goodput": steps / window, "steps": steps,
        "finished": [r["replica_id"] for r in records],
        "outer_steps_per_s": (max(outer) - min(outer)) / window, "launches": launches,
        "alone_fraction": sum(x["alone"] for x in rounds) / len(rounds),
        "first_round_s": statistics.median(first_round.values()),
        "first_round_restarted_s": statistics.median(restarted) if restarted else None,
        "switch_waits": [w for r in records for w in r["quorum_waits"][1:]],  # the first is the start's quorum
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat, max_steps 240")
    parser.add_argument("--repeats", type=int, help="runs per variant (default 3; quick: 1)")
    parser.add_argument("--kill-every", type=float, help="M: seconds between kills (default 10; quick: 6)")
    parser.add_argument("--out", help="default: elastic_goodput.json in benchmarks/results (quick: a temporary folder)")
    args = parser.parse_args()
    max_steps = 240 if args.quick else 600
    repeats = args.repeats or (1 if args.quick else 3)
    args.kill_every = args.kill_every or (6.0 if args.quick else 10.0)
    variants = ["steady K=1", "steady K=4", f"kill every {args.kill_every:g} s"]
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for variant in variants:  # interleaved: the machine's load drifts alike over every variant
            result = run(variant, max_steps, args.kill_every, limit=300.0)
            runs.append({"repeat": repeat, **result})
            print(f"repeat {repeat} {variant}: {result['goodput']:.1f} steps/s, {result['wall_s']:.1f} s, "
                  f"{result['launches']} launches", flush=True)
    rows = []
    steady = statistics.median(r["goodput"] for r in runs if r["variant"] == "steady K=1")
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        waits = sorted(w for r in mine for w in r["switch_waits"])
        restarted = [r["first_round_restarted_s"] for r in mine if r["first_round_restarted_s"] is not None]
        rows.append({
            "variant": variant, "goodput": spread([r["goodput"] for r in mine]),
            "goodput_median": statistics.median(r["goodput"] for r in mine),
            "ratio": statistics.median(r["goodput"] for r in mine) / steady,
            "outer_steps_per_s": statistics.median(r["outer_steps_per_s"] for r in mine),
            "alone_pct": 100 * statistics.median(r["alone_fraction"] for r in mine),
            "first_round_s": statistics.median(r["first_round_s"] for r in mine),
            "first_round_restarted_s": statistics.median(restarted) if restarted else None,
            "wait_median_ms": 1000 * waits[len(waits) // 2] if waits else None,
            "wait_p95_ms": 1000 * waits[int(0.95 * (len(waits) - 1))] if waits else None,
        })
    print(f"\n4 elastic NoLoCo replicas on {machine()}, H = 4, max_steps {max_steps}, median of {repeats} run(s)")
    print(table(rows, [("variant", "variant", ""), ("goodput_median", "steps/s", ".1f"), ("ratio", "vs steady", ".2f"),
                       ("outer_steps_per_s", "outer steps/s", ".2f"), ("alone_pct", "rounds alone %", ".1f"),
                       ("first_round_s", "start → first round s", ".1f"),
                       ("first_round_restarted_s", "restarted → first round s", ".1f"),
                       ("wait_median_ms", "switch wait median ms", ".1f"), ("wait_p95_ms", "p95 ms", ".1f")]))
    out = Path(args.out or results_dir(args.quick) / "elastic_goodput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in runs:
        r["switch_waits"] = {"count": len(r["switch_waits"]),
                             "median_ms": 1000 * statistics.median(r["switch_waits"]) if r["switch_waits"] else None,
                             "max_ms": 1000 * max(r["switch_waits"]) if r["switch_waits"] else None}
    out.write_text(json.dumps({
        "machine": machine(), "replicas": 4, "sync_every": 4, "max_steps": max_steps, "kill_every_s": args.kill_every,
        "repeats": repeats, "seconds": round(time.perf_counter() - started, 1), "rows": rows, "runs": runs,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
