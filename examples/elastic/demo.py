"""Elastic replicas on one machine: a Lighthouse, four replicas, one killed and restarted.

    python examples/elastic/demo.py --out runs/elastic_demo

Starts torchft's Lighthouse in this process (a free port) and four replica processes
(``replica.py``, NoLoCo on a tiny regression model, each its own Trainer). When r2 reaches step
``--kill-at`` it is killed with SIGKILL; ``--restart-after`` seconds later it is started again under the
same id, heals from a live replica and takes part again. Writes ``OUT/demo.png`` (every replica's loss
over time, and the members of r0's memberships) and ``OUT/demo.json``, and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from lightning_loco.elastic.lighthouse import public_address, start_lighthouse  # noqa: E402

IDS = ("r0", "r1", "r2", "r3")


def start(replica_id: str, lighthouse: str, out: Path, args: argparse.Namespace, n: int) -> subprocess.Popen:
    cmd = [sys.executable, str(HERE / "replica.py"), "--lighthouse", lighthouse, "--replica-id", replica_id,
           "--out", str(out), "--max-steps", str(args.max_steps), "--sync-every", str(args.sync_every),
           "--step-sleep", str(args.step_sleep), "--outer-step-timeout", "30", "--launched-at", str(time.time())]
    log = open(out / f"{replica_id}.{n}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def progress(out: Path, replica_id: str) -> int:
    try:
        return int((out / f"{replica_id}.progress").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


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
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob("*.progress"):
        stale.unlink()
    server = start_lighthouse("127.0.0.1:0", min_replicas=2, heartbeat_timeout_ms=2000)
    lighthouse = public_address(server, "127.0.0.1:0")
    t0 = time.time()
    procs = {rid: start(rid, lighthouse, args.out, args, 0) for rid in IDS}
    events = []
    try:
        while progress(args.out, "r2") < args.kill_at:
            if procs["r2"].poll() is not None or time.time() - t0 > args.limit:
                raise SystemExit("r2 ended before it could be killed; see its log in " + str(args.out))
            time.sleep(0.02)
        os.killpg(procs["r2"].pid, signal.SIGKILL)
        events.append({"time": time.time() - t0, "event": "r2 killed (SIGKILL)"})
        procs["r2"].wait()
        (args.out / "r2.progress").unlink()
        time.sleep(args.restart_after)
        procs["r2"] = start("r2", lighthouse, args.out, args, 1)
        events.append({"time": time.time() - t0, "event": "r2 restarted"})
        for rid, proc in procs.items():
            proc.wait(timeout=max(1.0, args.limit - (time.time() - t0)))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        server.shutdown()
    records = {rid: json.loads((args.out / f"{rid}.json").read_text()) for rid in IDS}
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
