"""A small sweep of GASLoC's outer hyper-parameters on a real model, beside NoLoCo and DiLoCo.

    python -m benchmarks.gasloc_sweep [--steps 400] [--sync-every 25] [--devices 4]
    python -m benchmarks.gasloc_sweep --quick    # a smoke run: two configurations, 8 steps on 2 replicas

Each configuration is one run of ``examples/quickstart.py`` (the byte-level GPT on Shakespeare,
4 CPU replicas, one seed): same data, seed and token budget; only the strategy's arguments differ.
Prints the final validation loss (mean over replicas) per configuration and writes
``benchmarks/results/gasloc_sweep.json`` (``--quick``: a temporary folder, or ``$LOCO_BENCH_RESULTS``).
One seed at this scale separates configurations only when the gaps exceed the run-to-run noise: read
small differences as ties.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, results_dir, run_python


def run(strategy: str, kwargs: dict, args: argparse.Namespace, tmp: str, seed: int = 0) -> dict:
    out = Path(tmp) / "result.json"
    cmd = [str(ROOT / "examples" / "quickstart.py"), "--strategy", strategy,
           "--strategy-args", json.dumps(kwargs), "--steps", str(args.steps), "--devices", str(args.devices),
           "--sync-every", str(args.sync_every), "--seed", str(seed), "--out", str(out)]
    proc = run_python(cmd)
    if proc.returncode != 0:
        return {"strategy": strategy, "strategy_args": kwargs, "val_loss": float("nan"), "error": proc.stderr[-2000:]}
    return json.loads(out.read_text())


def key(strategy: str, kwargs: dict, seed: int) -> str:
    return json.dumps([strategy, kwargs, seed], sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="NoLoCo and one GASLoC configuration, 8 steps, H = 4, "
                                                             "2 replicas (a smoke run; its losses mean nothing)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--sync-every", type=int)
    parser.add_argument("--devices", type=int)
    parser.add_argument("--out", help="default: gasloc_sweep.json in benchmarks/results (quick: a temporary folder)")
    parser.add_argument("--only-new", action="store_true", help="reuse rows already in --out")
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.quick else 400)
    args.sync_every = args.sync_every or (4 if args.quick else 25)
    args.devices = args.devices or (2 if args.quick else 4)
    args.out = args.out or str(results_dir(args.quick) / "gasloc_sweep.json")
    previous = {}
    if args.only_new and Path(args.out).exists():
        for row in json.loads(Path(args.out).read_text())["rows"]:
            previous[key(row["strategy"], row["strategy_args"], row.get("seed", 0))] = row
    configs = [("noloco", {}), ("diloco", {})]
    configs += [("gasloc", {"outer_lr": 0.7, "gossip_step": a, "outer_momentum": g})
                for a, g in itertools.product([0.25, 0.5], [0.5, 0.7, 0.9])]
    configs += [("gasloc", {"outer_lr": 1.0, "gossip_step": 0.25, "outer_momentum": g}) for g in (0.5, 0.7)]
    configs += [("gasloc", {"outer_lr": 0.7, "gossip_step": 0.25, "outer_momentum": 0.5, "topology": "ring"})]
    configs += [("gasloc", {"outer_lr": 0.7, "gossip_step": 0.25, "outer_momentum": g}) for g in (0.0, 0.3)]
    # a second seed for the leading configurations and the baselines, to see the run-to-run noise
    seeded = [(s, k, 1) for s, k in [("noloco", {}), ("diloco", {})]]
    seeded += [("gasloc", {"outer_lr": 0.7, "gossip_step": a, "outer_momentum": 0.5}, 1) for a in (0.25, 0.5)]
    seeded += [("gasloc", {"outer_lr": 0.7, "gossip_step": 0.25, "outer_momentum": 0.3}, 1)]
    configs = [(s, k, 0) for s, k in configs] + seeded
    if args.quick:
        configs = [("noloco", {}, 0), ("gasloc", {"outer_lr": 0.7, "gossip_step": 0.25, "outer_momentum": 0.5}, 0)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, kwargs, seed in configs:
            if key(strategy, kwargs, seed) in previous:
                rows.append(previous[key(strategy, kwargs, seed)])
            else:
                rows.append(run(strategy, kwargs, args, tmp, seed))
            print(f"{strategy:<7} seed {seed} {json.dumps(kwargs):<75} val loss {rows[-1]['val_loss']:.4f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": "example GPT, byte-level Shakespeare", "replicas": args.devices, "steps": args.steps,
                   "sync_every": args.sync_every, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
