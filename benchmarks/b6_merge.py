"""B6 part 4: merging unequal H_i, the plain mean against a mean weighted by each replica's steps.

    python -m benchmarks.b6_merge               # N = 4, DiLoCo and NoLoCo, 3 seeds: 3-5 min on 2 cores
    python -m benchmarks.b6_merge --replicas 8  # N = 8 (six replicas of 1 s, one of 2 s, one of 4 s): ~9 min
    python -m benchmarks.b6_merge --replicas 16 # N = 16 (fourteen of 1 s, as B6 part 3): ~9 min
    python -m benchmarks.b6_merge --seeds 3 4 --out b6_merge_seeds34.json  # more seeds, another file
    python -m benchmarks.b6_merge --quick       # seconds: N = 4, two tiny rounds of each merge, DiLoCo

Under ``sync_seconds`` every replica takes its own number of inner steps H_i per round, so the
pseudo-gradients that meet at an exchange are of different lengths. The algorithms merge them with a
plain mean (DiLoCo: Δ̄ = (1/N)·Σ_i Δ_i; NoLoCo: the pair's mean live weights). The alternative, as
Decoupled DiLoCo's token-weighted merge does it, weights each replica by the steps it took:
Δ̄ = Σ_i H_i·Δ_i / Σ_j H_j (NoLoCo: Σ_j H_j·θ_j / Σ_j H_j over the pair). This benchmark measures
the two on part 3's simulated GPT (:mod:`benchmarks.b6_simulated`, whose run it reuses): replicas of
modelled step times 1, 1, 2 and 4 s, T = H × the fast step time, the same rounds for every merge.

Weighting by steps also lengthens the outer step: were every inner step alike (Δ_i = H_i·u), the
weighted Δ̄ would be N·Σ H_i² / (Σ H_i)² times the plain one (1.22 for H_i = 20, 20, 10, 5). A third
merge, ``plain_lr``, is the control: the plain mean with the outer learning rate times that factor.
Where "steps" beats "plain" but not "plain_lr", the gain is the longer step, not the weighting.

The weighted merge is the package's ``merge="steps"`` (:mod:`lightning_loco.algorithms.step_weighted`):
each replica sends H_i·Δ_i with H_i appended as one more value, so that the group's sum carries
Σ H_i·Δ_i and Σ H_j together and the outer step divides one by the other. GASLoC is not measured:
``merge="steps"`` refuses it (its mix must stay mean-preserving).

Every merge sees the same schedule (each H_i depends on the replica's clock only), so their rounds end
at the same modelled seconds: losses at equal rounds are losses at equal modelled wall time and at
equal tokens. Reported per algorithm and merge, over seeds: the final validation loss of the mean
replica and of the consensus model (mean ± standard deviation over seeds), the loss halfway through
the run, and the per-seed difference weighted − plain (mean, min, max; negative: weighting is better).
Writes ``benchmarks/results/b6_merge.json`` (``--replicas 8``: ``b6_merge_n8.json``, and so on;
``--quick``: a temporary folder, or ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.b6_simulated import loss_by, make_algorithm, run_in_pool, run_one, speeds_of
from benchmarks.common import machine, results_dir, table, write_json
from lightning_loco.algorithms import DiLoCo, NoLoCo
from lightning_loco.driver.pacing import phase_steps

ALGORITHMS = ("diloco", "noloco")
MERGES = ("plain", "steps", "plain_lr")
FULL = {"replicas": 4, "sync_every": 20, "rounds": 20, "batch_size": 8, "eval_batches": 4, "lr": 3e-3}
QUICK = {"replicas": 4, "sync_every": 4, "rounds": 2, "batch_size": 4, "eval_batches": 1, "lr": 3e-3}


def lr_factor(speeds: list[float], sync_every: int, sync_seconds: float) -> float:
    """N·Σ H_i² / (Σ H_i)²: how much longer the step-weighted Δ̄ is than the plain mean when every inner
    step moves the weights alike (Δ_i = H_i·u), with each replica's H_i as its step time gives it."""
    h = [phase_steps(s, sync_every, sync_seconds) for s in speeds]
    return len(h) * sum(k * k for k in h) / sum(h) ** 2


def algorithm_of(name: str, merge: str, seed: int, factor: float = 1.0) -> tuple[Any, str]:
    """The outer step of ``name`` and the package's merge for the benchmark's ``merge``: "plain" (the
    plain mean, ``merge="mean"``), "steps" (weighted by steps, ``merge="steps"``) or "plain_lr" (the
    plain mean with the outer learning rate × ``factor``, the control that lengthens the outer step as
    much as weighting does, without leaning towards the fast replicas; for NoLoCo γ = β follows it, as
    by default)."""
    if merge == "plain_lr":
        lr = factor * (DiLoCo() if name == "diloco" else NoLoCo()).outer_lr
        return (DiLoCo(outer_lr=lr) if name == "diloco" else NoLoCo(outer_lr=lr, seed=seed)), "mean"
    return make_algorithm(name, seed), "steps" if merge == "steps" else "mean"


def run_merge(name: str, merge: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """One paced run (part 3's, ``sync_seconds`` = H × the fast step time) with the given merge."""
    speeds, h = speeds_of(settings["replicas"]), settings["sync_every"]
    algorithm, package_merge = algorithm_of(name, merge, seed, lr_factor(speeds, h, h * min(speeds)))
    run = run_one(name, "paced", seed, settings, algorithm=algorithm, merge=package_merge)
    return {**run, "merge": merge}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(runs: list[dict[str, Any]], algorithms: list[str]) -> list[dict[str, Any]]:
    """One row per algorithm and merge: means and standard deviations over seeds, and the per-seed
    difference weighted − plain."""
    by = {(r["algorithm"], r["merge"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for name in algorithms:
        for merge in MERGES:
            chosen = [by[(name, merge, s)] for s in seeds]
            plain = [by[(name, "plain", s)] for s in seeds]
            end = [p["curve"][-1]["train_seconds"] for p in plain]  # the same for both merges
            row: dict[str, Any] = {"algorithm": name, "merge": merge, "seconds": statistics.mean(end),
                                   "tokens": statistics.mean(r["curve"][-1]["tokens"] for r in chosen)}
            finals = [r["curve"][-1]["val_loss"] for r in chosen]
            row["final_loss"], row["final_loss_sd"] = _mean_sd(finals)
            row["consensus_loss"], row["consensus_loss_sd"] = _mean_sd(
                [r["curve"][-1]["consensus_loss"] for r in chosen])
            halves = [loss_by(r["curve"], e / 2) for r, e in zip(chosen, end)]
            row["half_time_loss"], row["half_time_loss_sd"] = _mean_sd(halves)
            diffs = [f - p["curve"][-1]["val_loss"] for f, p in zip(finals, plain)]
            row["diff_vs_plain"] = statistics.mean(diffs)
            row["diff_min"], row["diff_max"] = min(diffs), max(diffs)
            row["h_i"] = chosen[0]["h_i"]
            rows.append(row)
    return rows


COLUMNS = [("algorithm", "algorithm", "s"), ("merge", "merge", "s"), ("final_loss", "final loss", ".4f"),
           ("final_loss_sd", "± sd", ".4f"), ("consensus_loss", "consensus loss", ".4f"),
           ("consensus_loss_sd", "± sd", ".4f"), ("half_time_loss", "loss at half time", ".4f"),
           ("half_time_loss_sd", "± sd", ".4f"), ("diff_vs_plain", "Δ final vs plain", "+.4f"),
           ("diff_min", "Δ min", "+.4f"), ("diff_max", "Δ max", "+.4f"), ("seconds", "modelled s", ".0f")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 4, two tiny rounds of each merge, DiLoCo")
    parser.add_argument("--replicas", type=int, default=4, help="N: 4 (step times 1, 1, 2, 4 s) or more")
    parser.add_argument("--seeds", type=int, nargs="+", help="default 0 1 2 (quick: 0)")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", help="the results file's name (default b6_merge.json; N = 8: b6_merge_n8.json)")
    args = parser.parse_args()
    if args.replicas < 4:
        parser.error(f"--replicas must be at least 4 (one replica 2x and one 4x slower), got {args.replicas}")
    settings = {**(QUICK if args.quick else FULL), "replicas": args.replicas}
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    algorithms = args.algorithms or (["diloco"] if args.quick else list(ALGORITHMS))
    jobs = [(a, m, s) for s in seeds for a in algorithms for m in MERGES]
    speeds = speeds_of(settings["replicas"])
    h = settings["sync_every"]
    print(f"B6 part 4 (merge of unequal H_i): {settings['replicas']} replicas of step times {speeds} s, H = {h}, "
          f"T = {h * min(speeds):.0f} s, {settings['rounds']} rounds, seeds {seeds}; {len(jobs)} runs; plain_lr: "
          f"outer lr × {lr_factor(speeds, h, h * min(speeds)):.3f}", flush=True)
    started = time.perf_counter()
    runs = run_in_pool(run_merge, jobs, settings, args.workers, lambda run: (
        f"seed {run['seed']} {run['algorithm']:<7} {run['merge']:<6} loss {run['curve'][-1]['val_loss']:.4f} "
        f"(consensus {run['curve'][-1]['consensus_loss']:.4f}) at {run['curve'][-1]['train_seconds']:.0f} s "
        f"(modelled)  H_i {run['h_i']}  ({run['seconds']:.0f} s here)"))
    rows = summarise(runs, algorithms)
    wall = time.perf_counter() - started
    print(f"\nB6 part 4: {settings['replicas']} simulated GPT replicas, step times {speeds} s, H = {h}, "
          f"T = {h * min(speeds):.0f} s, {settings['rounds']} rounds, seeds {seeds}; validation loss, mean "
          f"replica unless said; {wall:.0f} s here on {machine()}")
    print(table(rows, COLUMNS))
    saved = {"benchmark": "B6 merge of unequal H_i, simulated", "settings": settings,
             "plain_lr_factor": lr_factor(speeds, h, h * min(speeds)),
             "step_seconds": speeds, "sync_seconds": h * min(speeds), "seeds": seeds, "rows": rows, "runs": runs,
             "wall_seconds": wall}
    name = args.out or ("b6_merge.json" if settings["replicas"] == 4 else f"b6_merge_n{settings['replicas']}.json")
    path = write_json(name, saved, results_dir(args.quick))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
