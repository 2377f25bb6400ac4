"""Elastic replicas: goodput with a replica killed and restarted every M seconds against no failures, the
survivors' pace apart from the run's, the time from a replica's start to its first round, and what the
membership costs on the healthy path.

    python -m benchmarks.elastic_goodput            # ~11 min on 2 cores: 2 variants × 3 repeats, interleaved
    python -m benchmarks.elastic_goodput --heartbeat-ms 2000 1000   # ~17 min: the kill runs under both timeouts
    python -m benchmarks.elastic_goodput --quick    # ~1.5 min: 1 repeat, shorter runs, a kill every 6 s

Each run is a Lighthouse process (``min_replicas=2``, heartbeat timeout 2 s) and four replica processes
of ``examples/elastic/replica.py`` (NoLoCo, a tiny regression model, H = 4, 20 ms of sleep per step standing
for a bigger model's compute, ``max_steps`` = 3000, about 100 s of training; 480 with ``--quick``). Variants:

* ``steady K=1``: no failure, a membership refresh requested at every outer step (the default);
* ``steady K=4`` (with ``--k4``): no failure, ``membership_every=4``;
* ``kill every M s``: M seconds after training starts and every M seconds after (default 30; 6 with
  ``--quick``), until r0 is 90 % through, r3 is killed with SIGKILL and started again at once under the
  same id; it heals from a live replica. r0, r1 and r2, the *survivors*, are never killed;
* ``kill every M s, heartbeat T s`` (with ``--heartbeat-ms``): the same under a Lighthouse whose heartbeat
  timeout is T (a dead replica holds the survivors' next quorum until its heartbeats count as stopped).

``outer_step_timeout`` is 10 s. The training window is r0's first round to r0's end (start-up, the same in
every variant, is left out; it is the "start → first round" column). Reported:

* ``goodput``: inner steps per second summed over all replicas over the window (the run as a whole). The
  killed processes' steps up to their death count. A replica still waiting to be admitted 20 s after r0
  ended is killed and its steps counted;
* ``survivors``: the survivors' inner steps per second (per replica) over the window, against the same
  replicas' in the steady runs: what a death and a restart cost the replicas that go on; split into
  the stretches while r3 restarts (its kill to its first step: the Lighthouse's heartbeat timeout, and
  the new process's start competing for the cores) and the rest of the window (``outside restarts``);
  ``switch wait s``: what a survivor waited for memberships in all, over the run;
* ``while up``: the run's steps per replica-second that a replica was up, so with the restarted process's
  start-up (its kill to its first step: imports, Lightning's setup on the shared cores, the quorum and
  healing) counted apart; that start-up is the "restart → first step" column;
* "outer steps/s": the run's progress over the window (r0's rounds); "heal s": the restarted replica's
  heal as its log line says; "switch wait": what the training thread waited for the next membership at a
  switch (median and 95th percentile over all switches of the steady runs).

Writes ``benchmarks/results/elastic_goodput.json`` (``--quick``: a temporary folder, or ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, results_dir, spread, table

REPLICA = ROOT / "examples" / "elastic" / "replica.py"
IDS = ("r0", "r1", "r2", "r3")
VICTIM, SURVIVORS = "r3", ("r0", "r1", "r2")


def run(variant: str, max_steps: int, kill_every: float, limit: float, heartbeat_ms: int = 2000) -> dict[str, Any]:
    from lightning_loco.testing.elastic import Lighthouse, Replicas

    every = 4 if variant == "steady K=4" else 1
    kills = variant.startswith("kill")
    out = Path(tempfile.mkdtemp(prefix="elastic_goodput_"))
    with Lighthouse(min_replicas=2, heartbeat_timeout_ms=heartbeat_ms) as lighthouse:
        replicas = Replicas(REPLICA, out, lighthouse.address, limit_s=limit + 20, max_steps=max_steps, sync_every=4,
                            step_sleep=0.02, outer_step_timeout=10, membership_every=every)
        started = time.time()
        procs = {rid: replicas.start(rid) for rid in IDS}
        launches, killed_steps, leftover_steps = 4, 0, 0
        next_kill = None  # M seconds after training starts (r0's first step), then every M seconds
        restarts: list[tuple[float, float]] = []  # per restart: its kill, the new process's first step
        killed_at: float | None = None
        try:
            while procs["r0"].poll() is None:
                if time.time() - started > limit:
                    raise RuntimeError(f"{variant}: a run took longer than {limit} s; logs in {out}")
                if next_kill is None and replicas.progress("r0") > 0:
                    next_kill = time.time() + kill_every
                if killed_at is not None and replicas.progress(VICTIM) > 0:
                    restarts.append((killed_at, time.time()))
                    killed_at = None
                if kills and next_kill is not None and time.time() >= next_kill and killed_at is None:
                    proc = procs[VICTIM]
                    if proc.poll() is None and replicas.progress("r0") < 0.9 * max_steps:
                        steps = replicas.progress(VICTIM)
                        replicas.kill(proc)
                        killed_steps += steps
                        killed_at = time.time()
                        procs[VICTIM] = replicas.start(VICTIM)
                        launches += 1
                    next_kill = time.time() + kill_every
                time.sleep(0.05)
            # r0 (never killed) has finished: the others finish with it, except a replica restarted too late to
            # join before the end, which would wait for a membership until its join_timeout: one that has not
            # taken its first step when the survivors are done has nobody left to join, and is stopped at once
            deadline = time.time() + 20
            for rid, proc in sorted(procs.items(), key=lambda item: item[0] == VICTIM):
                if rid == VICTIM and killed_at is not None and replicas.progress(VICTIM) == 0:
                    replicas.kill(proc)
                    continue
                try:
                    replicas.wait(proc, timeout_s=max(0.1, deadline - time.time()))
                except TimeoutError:
                    replicas.kill(proc)
                    leftover_steps += replicas.progress(rid)
        finally:
            replicas.close()
    wall = time.time() - started
    records = {rid: replicas.record(rid) for rid in IDS if (out / f"{rid}.json").exists()}
    # The training window: r0's first round (every variant starts alike) to r0's end
    begin, end = records["r0"]["rounds"][0]["time"], records["r0"]["ended"]
    window = end - begin

    def steps_of(rids: Any) -> int:
        return sum(1 for rid in rids if rid in records for t, _, _ in records[rid]["losses"] if begin <= t <= end)

    steps = killed_steps + leftover_steps + steps_of(IDS)
    if killed_at is not None:  # restarted and not up when r0 ended
        restarts.append((killed_at, end))
    downs = [up - down for down, up in restarts]
    # the survivors' steps while r3 restarts (its kill to its first step) and the rest of the window
    spans = [(max(begin, down), min(end, up)) for down, up in restarts if min(end, up) > max(begin, down)]
    during = sum(1 for rid in SURVIVORS for t, _, _ in records[rid]["losses"] if any(a <= t <= b for a, b in spans))
    span_s = sum(b - a for a, b in spans)
    rounds = [x for r in records.values() for x in r["rounds"]]
    first_round = {rid: r["rounds"][0]["time"] - r["started"] for rid, r in records.items()}
    outer = [x["outer_step"] for x in records["r0"]["rounds"] if begin <= x["time"] <= end]
    heals = [float(m.group(1)) for log in sorted(out.glob(f"{VICTIM}.*.log"))[1:]
             for m in re.finditer(r"took its state from .*? in ([0-9.]+) s", log.read_text())]
    return {
        "variant": variant, "heartbeat_timeout_ms": heartbeat_ms, "wall_s": wall, "window_s": window,
        "goodput": steps / window, "steps": steps,
        "survivors": steps_of(SURVIVORS) / window / len(SURVIVORS),
        "survivors_outside_restarts": (steps_of(SURVIVORS) - during) / (window - span_s) / len(SURVIVORS),
        "survivors_during_restarts": during / span_s / len(SURVIVORS) if span_s else None,
        "restart_share": span_s / window,
        "survivors_switch_wait_s": statistics.mean(sum(records[rid]["quorum_waits"][1:]) for rid in SURVIVORS),
        "while_up": steps / (len(IDS) * window - sum(downs)),
        "finished": sorted(records), "outer_steps_per_s": (max(outer) - min(outer)) / window, "launches": launches,
        "restart_to_first_step_s": downs, "heal_s": heals,
        "alone_fraction": sum(x["alone"] for x in rounds) / len(rounds),
        "first_round_s": statistics.median(first_round.values()),
        "switch_waits": [w for r in records.values() for w in r["quorum_waits"][1:]],  # the first: the start's
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat, max_steps 480, a kill every 6 s")
    parser.add_argument("--repeats", type=int, help="runs per variant (default 3; quick: 1)")
    parser.add_argument("--kill-every", type=float, help="M: seconds between kills (default 30; quick: 6)")
    parser.add_argument("--max-steps", type=int, help="the run's max_steps (default 3000; quick: 480)")
    parser.add_argument("--k4", action="store_true", help="also the steady runs with membership_every=4")
    parser.add_argument("--heartbeat-ms", type=int, nargs="+", default=[2000],
                        help="the Lighthouse's heartbeat timeouts of the kill runs, each a variant (default 2000; "
                             "the steady runs keep 2000)")
    parser.add_argument("--out", help="default: elastic_goodput.json in benchmarks/results (quick: a temporary folder)")
    args = parser.parse_args()
    max_steps = args.max_steps or (480 if args.quick else 3000)
    repeats = args.repeats or (1 if args.quick else 3)
    args.kill_every = args.kill_every or (6.0 if args.quick else 30.0)
    kill = f"kill every {args.kill_every:g} s"
    beats = {kill if ms == 2000 else f"{kill}, heartbeat {ms / 1000:g} s": ms for ms in args.heartbeat_ms}
    variants = ["steady K=1"] + (["steady K=4"] if args.k4 else []) + list(beats)
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for variant in variants:  # interleaved: the machine's load drifts alike over every variant
            result = run(variant, max_steps, args.kill_every, limit=120.0 + max_steps / 5,
                         heartbeat_ms=beats.get(variant, 2000))
            runs.append({"repeat": repeat, **result})
            print(f"repeat {repeat} {variant}: {result['goodput']:.1f} steps/s, survivors {result['survivors']:.1f} "
                  f"steps/s each, {result['wall_s']:.1f} s, {result['launches']} launches", flush=True)
    steady = {r["repeat"]: r for r in runs if r["variant"] == "steady K=1"}  # each run against its repeat's steady

    def ratios(mine: list[dict[str, Any]], key: str) -> dict[str, float]:
        return spread([r[key] / steady[r["repeat"]][key] for r in mine])

    def kills_in(mine: list[dict[str, Any]]) -> bool:
        return any(r["survivors_during_restarts"] is not None for r in mine)

    rows = []
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        waits = sorted(w for r in mine for w in r["switch_waits"])
        downs = [d for r in mine for d in r["restart_to_first_step_s"]]
        heals = [h for r in mine for h in r["heal_s"]]
        rows.append({
            "variant": variant, "goodput": spread([r["goodput"] for r in mine]),
            "goodput_median": statistics.median(r["goodput"] for r in mine),
            "ratio": ratios(mine, "goodput"), "survivors": spread([r["survivors"] for r in mine]),
            "survivors_ratio": ratios(mine, "survivors"), "while_up_ratio": ratios(mine, "while_up"),
            "outside_ratio": spread([r["survivors_outside_restarts"] / steady[r["repeat"]]["survivors"] for r in mine]),
            "during_ratio": spread([r["survivors_during_restarts"] / steady[r["repeat"]]["survivors"] for r in mine
                                    if r["survivors_during_restarts"] is not None]) if kills_in(mine) else None,
            "restart_share": statistics.median(r["restart_share"] for r in mine),
            "survivors_switch_wait_s": statistics.median(r["survivors_switch_wait_s"] for r in mine),
            "kills": statistics.median(r["launches"] - 4 for r in mine),
            "outer_steps_per_s": statistics.median(r["outer_steps_per_s"] for r in mine),
            "alone_pct": 100 * statistics.median(r["alone_fraction"] for r in mine),
            "first_round_s": statistics.median(r["first_round_s"] for r in mine),
            "restart_to_first_step_s": spread(downs) if downs else None,
            "heal_s": spread(heals) if heals else None,
            "wait_median_ms": 1000 * waits[len(waits) // 2] if waits else None,
            "wait_p95_ms": 1000 * waits[int(0.95 * (len(waits) - 1))] if waits else None,
        })
    flat = [{**r, **{f"{k}_m": r[k]["median"] for k in ("ratio", "survivors_ratio", "while_up_ratio", "outside_ratio")},
             "during_m": r["during_ratio"]["median"] if r["during_ratio"] else None,
             "range": f"{r['survivors_ratio']['min']:.2f}-{r['survivors_ratio']['max']:.2f}",
             "down_m": r["restart_to_first_step_s"]["median"] if r["restart_to_first_step_s"] else None,
             "heal_m": r["heal_s"]["median"] if r["heal_s"] else None} for r in rows]
    print(f"\n4 elastic NoLoCo replicas on {machine()}, H = 4, max_steps {max_steps}, median of {repeats} run(s); "
          "ratios against the same repeat's steady K=1 run")
    print(table(flat, [("variant", "variant", ""), ("kills", "kills", ".0f"), ("goodput_median", "steps/s", ".1f"),
                       ("ratio_m", "vs steady", ".2f"), ("survivors_ratio_m", "survivors vs steady", ".3f"),
                       ("range", "range", ""), ("outside_ratio_m", "outside restarts", ".3f"),
                       ("during_m", "during restarts", ".2f"), ("restart_share", "restart share", ".2f"),
                       ("survivors_switch_wait_s", "switch wait s", ".1f"),
                       ("while_up_ratio_m", "while up vs steady", ".2f"),
                       ("outer_steps_per_s", "outer steps/s", ".2f"), ("alone_pct", "rounds alone %", ".1f"),
                       ("first_round_s", "start → first round s", ".1f"),
                       ("down_m", "restart → first step s", ".1f"),
                       ("heal_m", "heal s", ".3f"), ("wait_median_ms", "switch wait median ms", ".1f"),
                       ("wait_p95_ms", "p95 ms", ".1f")]))
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
