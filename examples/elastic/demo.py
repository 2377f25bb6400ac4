"""Elastic replicas on one machine: a Lighthouse, four replicas, one killed and restarted.

    python examples/elastic/demo.py --out runs/elastic_demo

Starts a Lighthouse (``lightning-loco lighthouse`` on a free port) and four replica processes
(``replica.py``, NoLoCo on a tiny regression model, each its own Trainer). When r2 reaches step
``--kill-at`` it is killed with SIGKILL; ``--restart-after`` seconds later it is started again under the
same id, heals from a live replica and takes part again. Writes ``OUT/demo.png`` (every replica's loss
over time, and the members of r0's memberships) and ``OUT/demo.json``, and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from lightning_loco.testing.elastic import Lighthouse, Replicas  # noqa: E402

IDS = ("r0", "r1", "r2", "r3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/elastic_demo"))
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--kill-at", type=int, default=40, help="r2's step at which it is killed")
    parser.add_argument("--restart-after", type=float, default=3.0, help="seconds before r2 starts again")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds after which everything is killed")
    args = parser.parse_args()
    events = []
    with (
        Lighthouse(min_replicas=2, heartbeat_timeout_ms=2000) as lighthouse,
        Replicas(HERE / "replica.py", args.out, lighthouse.address, limit_s=args.limit, max_steps=args.max_steps,
                 sync_every=args.sync_every, step_sleep=args.step_sleep, outer_step_timeout=30) as replicas,
    ):
        t0 = time.time()
        procs = {rid: replicas.start(rid) for rid in IDS}
        try:
            replicas.wait_for_step("r2", args.kill_at, procs["r2"])
        except RuntimeError as err:
            raise SystemExit(f"r2 could not be killed at step {args.kill_at}: {err}") from None
        replicas.kill(procs["r2"])
        events.append({"time": time.time() - t0, "event": "r2 killed (SIGKILL)"})
        time.sleep(args.restart_after)
        procs["r2"] = replicas.start("r2")
        events.append({"time": time.time() - t0, "event": "r2 restarted"})
        for proc in procs.values():
            replicas.wait(proc)
        records = {rid: replicas.record(rid) for rid in IDS}
    summary = {"events": events, "replicas": {}}
    for rid, rec in records.items():
        first = rec["rounds"][0]
        summary["replicas"][rid] = {
            "outer_steps": rec["outer_steps"], "rounds": len(rec["rounds"]),
            "rounds_alone": sum(r["alone"] for r in rec["rounds"]),
            "first_round_after_start_s": first["time"] - rec["started"],
            "healed_from": rec["healed_from"][0]["donor"] if rec["healed_from"] else None,
            "final_loss": rec["losses"][-1][2],
        }
    memberships = [{"time": m["time"] - t0, "first_round": m["first_round"], "members": m["members"]}
                   for m in records["r0"]["memberships"] if not m["reused_group"]]
    summary["memberships_of_r0"] = memberships
    (args.out / "demo.json").write_text(json.dumps(summary, indent=2))
    print(f"{'replica':8}{'rounds':>8}{'alone':>7}{'first round (s)':>17}{'healed from':>13}{'final loss':>12}")
    for rid, row in summary["replicas"].items():
        print(f"{rid:8}{row['rounds']:>8}{row['rounds_alone']:>7}{row['first_round_after_start_s']:>17.1f}"
              f"{str(row['healed_from']):>13}{row['final_loss']:>12.4f}")
    for event in events:
        print(f"{event['time']:7.1f} s  {event['event']}")
    for m in memberships:
        print(f"{m['time']:7.1f} s  membership from outer step {m['first_round']}: {', '.join(m['members'])}")
    plot(records, events, memberships, t0, args.out / "demo.png")
    print(f"wrote {args.out / 'demo.png'} and {args.out / 'demo.json'}")


def plot(records: dict, events: list, memberships: list, t0: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    for rid, rec in records.items():
        times = [t - t0 for t, _, _ in rec["losses"]]
        top.plot(times, [loss for _, _, loss in rec["losses"]], label=rid, lw=1)
    top.set_yscale("log")
    top.set_ylabel("training loss")
    top.legend()
    for event in events:
        for ax in (top, bottom):
            ax.axvline(event["time"], color="grey", ls="--", lw=0.8)
        top.annotate(event["event"], (event["time"], top.get_ylim()[1]), fontsize=8, rotation=90, va="top")
    for i, rid in enumerate(IDS):
        spans = []
        for k, m in enumerate(memberships):
            end = memberships[k + 1]["time"] if k + 1 < len(memberships) else max(
                rec["ended"] for rec in records.values()) - t0
            if rid in m["members"]:
                spans.append((m["time"], end - m["time"]))
        bottom.broken_barh(spans, (i - 0.4, 0.8))
    bottom.set_yticks(range(len(IDS)), IDS)
    bottom.set_ylabel("member")
    bottom.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
