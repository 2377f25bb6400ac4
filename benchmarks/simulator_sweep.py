"""Choosing H, β and α for 64 NoLoCo replicas on one machine, with the training simulator.

    python -m benchmarks.simulator_sweep            # 64 replicas, 12 configurations, ~5 min on 2 cores
    python -m benchmarks.simulator_sweep --quick    # 8 replicas, 3 configurations, a few seconds

A small byte-level GPT (one layer, width 32, 32-byte context) trains on Shakespeare as N replicas in
one process (:class:`lightning_loco.simulator.TrainingSimulator`, the strategies' own outer step), for
every combination of H (``sync_every``), β (``outer_lr``) and α (``outer_momentum``) below, all at the
same tokens. It prints the consensus and mean-replica validation losses, the replicas' spread and the
bytes each replica sent, and writes ``simulator_sweep.json``. ``docs/simulator.md`` walks through a
result.
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.b5_convergence import Job, Settings, run_job, tuned
from benchmarks.common import machine, pool_context, results_dir, table, write_json

SETTINGS = Settings(steps=300, sync_every=10, batch_size=4, block_size=32, n_layer=1, n_embd=32, n_head=2, lr=3e-3,
                    warmup_steps=20, eval_every=60, eval_batches=4, final_eval_batches=32)
QUICK = Settings(steps=40, sync_every=10, batch_size=4, block_size=32, n_layer=1, n_embd=32, n_head=2, lr=3e-3,
                 warmup_steps=5, eval_every=20, eval_batches=2, final_eval_batches=4)
SYNC_EVERY = (10, 30)
OUTER = ((0.7, 0.5), (0.7, 0.0), (0.9, 0.25), (1.0, 0.0), (0.5, 0.5), (0.9, 0.5))  # (β, α); (0.7, 0.5) is the paper's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replicas", type=int, default=None, help="default 64 (quick: 8)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    settings = QUICK if args.quick else SETTINGS
    n = args.replicas or (8 if args.quick else 64)
    grid = [(10, 0.7, 0.5), (10, 1.0, 0.0), (30, 0.7, 0.5)] if args.quick else [
        (h, b, a) for h, (b, a) in itertools.product(SYNC_EVERY, OUTER)]
    folder = results_dir(args.quick)
    runs = folder / ("simulator_sweep_runs_quick" if args.quick else "simulator_sweep_runs")
    runs.mkdir(parents=True, exist_ok=True)
    jobs = [Job(tuned("noloco", b, a), n, "iid", 0, h, "sweep") for h, b, a in grid]
    print(f"simulator sweep on {machine()}: NoLoCo, N={n}, {len(jobs)} configurations", flush=True)
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers, mp_context=pool_context()) as pool:
        futures = [pool.submit(run_job, j, settings, str(runs / f"{j.name}.json"), 1) for j in jobs]
        records = [f.result() for f in futures]
    rows = []
    for (h, b, a), r in zip(grid, records):
        rows.append({"H": h, "beta": b, "alpha": a, "consensus": r["final"]["consensus"],
                     "mean_replica": r["final"]["mean_replica"], "plain_outer_end": r["final"]["outer_consensus"],
                     "spread": r["final"]["spread"], "mb_per_replica": r["final"]["bytes_per_replica"] / 1e6,
                     "seconds": r["seconds"], "paper_default": (b, a) == (0.7, 0.5)})
    print(table(rows, [("H", "H", "d"), ("beta", "β", ".2f"), ("alpha", "α", ".2f"), ("consensus", "consensus", ".3f"),
                       ("mean_replica", "mean replica", ".3f"), ("plain_outer_end", "plain outer end", ".3f"),
                       ("spread", "spread", ".3f"), ("mb_per_replica", "MB/replica", ".2f"), ("seconds", "s", ".0f")]))
    best = min(rows, key=lambda r: r["consensus"])
    print(f"best: H={best['H']}, β={best['beta']}, α={best['alpha']} (consensus {best['consensus']:.3f})")
    path = write_json("simulator_sweep.json", {"replicas": n, "settings": settings.__dict__, "rows": rows,
                                               "seconds": time.perf_counter() - started}, folder)
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
