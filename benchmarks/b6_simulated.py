"""B6 part 3: N = 16 replicas of different speeds in the training simulator, on modelled step times.

    python -m benchmarks.b6_simulated            # 3 seeds, NoLoCo, GASLoC and DiLoCo: ~12 min on 2 cores
    python -m benchmarks.b6_simulated --quick    # seconds: 4 replicas, one tiny run of each mode
    python -m benchmarks.b6_simulated --noise    # a second: the event model with noisy step times

The small byte-level GPT of the simulator sweep (one layer, width 32, 32-byte context, batches of 8)
trains on Shakespeare as 16 replicas in one process (:class:`lightning_loco.simulator.TrainingSimulator`,
the strategies' own driver and outer step), 14 of them with a modelled step time of 1 s, one of 2 s and
one of 4 s (``step_seconds``): each replica's virtual clock moves by its step time at every step, and
at an exchange to the time the last member of its group posted. So the wall time is the modelled one,
whatever this machine's own speed, and every run is deterministic.

Three modes per algorithm, as in part 2: one H for all (``sync_every`` = H, R rounds); each replica
its own H_i (``sync_seconds`` = T = H × the fast step time, R rounds); and own H_i for 4R rounds, which
takes about as long as one H's R rounds (the 4x replica sets one H's pace). The learning-rate schedule
(warm-up over H nominal steps, cosine to a tenth) follows nominal progress under ``sync_seconds``, as on
the strategies. After every round all replicas are evaluated on the same validation batches (the mean
over replicas, as in part 2). Reported: the fast replicas' compute share (their modelled compute over
their modelled wall time), the loss after R rounds, the modelled seconds to a target loss (the highest
final loss of the R-round runs), one H's loss when the paced R rounds end and the 4R-round run's loss
when one H's run ends (equal wall time both ways), and the tokens trained.
Writes ``benchmarks/results/b6_simulated.json`` (``--quick``: a temporary folder, or ``$LOCO_BENCH_RESULTS``).

``--noise`` runs the event model of the schedules (no training, exchanges free) for part 2's case, 4
replicas of step times 1, 1, 2 and 4 with every step drawn around its mean (log-normal, σ), T short
enough that the 4x replica takes 2-5 steps a round as in part 2. It shows why DiLoCo's fast replicas
wait more than gossip's: each phase ends within half a step of T, and an all-reduce waits for the
latest of all arrivals where a pair waits for one partner. It also gives the shares under another
rule, a phase that never ends past T (``floor``), for comparison. Writes ``b6_event_noise.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Optional

from benchmarks.b2_time_to_loss import time_to
from benchmarks.b6_heterogeneous import columns, loss_by  # the processes' part: its curves, its table
from benchmarks.common import machine, pool_context, results_dir, table, write_json
from lightning_loco.replica.options import PacingConfig

ALGORITHMS = ("noloco", "gasloc", "diloco")
LONG = 4  # the third mode: own H_i for 4× the rounds, to compare losses at one H's wall time
MODEL = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
FULL = {"replicas": 16, "sync_every": 20, "rounds": 5, "batch_size": 8, "eval_batches": 4, "lr": 3e-3}
QUICK = {"replicas": 4, "sync_every": 4, "rounds": 2, "batch_size": 4, "eval_batches": 1, "lr": 3e-3}


def speeds_of(n: int) -> list[float]:
    """One replica 2× and one 4× slower than the rest (modelled step times in seconds)."""
    return [1.0] * (n - 2) + [2.0, 4.0]


def make_algorithm(name: str, seed: int) -> Any:
    from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo

    if name == "diloco":
        return DiLoCo()
    return NoLoCo(seed=seed) if name == "noloco" else GASLoC(seed=seed)


def run_one(name: str, mode: str, seed: int, settings: dict[str, Any], algorithm: Any = None,
            merge: str = "mean") -> dict[str, Any]:
    """One simulated run; its curve (loss after each round against modelled seconds) and shares.
    ``algorithm``: an outer step to run in place of ``name``'s (a variant another benchmark measures);
    ``merge``: the paced modes' merge of unequal H_i (``TrainingSimulator(merge=...)``)."""
    import torch

    from benchmarks.b5_convergence.runs import eval_batches
    from lightning_loco.examples.gpt import GPT
    from lightning_loco.examples.text import TokenBlocks, join, shakespeare_files, split_each_file
    from lightning_loco.simulator import TrainingSimulator, distributed_shards

    warnings.filterwarnings("ignore", message=".*batching rule.*")
    torch.set_num_threads(1)
    n, h = settings["replicas"], settings["sync_every"]
    rounds = settings["rounds"] * (LONG if mode == "paced_long" else 1)
    speeds = speeds_of(n)
    parts, val = split_each_file(shakespeare_files(), 0.05)
    probe = eval_batches(TokenBlocks(val, MODEL["block_size"]), settings["eval_batches"])
    shards = distributed_shards(TokenBlocks(join(parts), MODEL["block_size"]), n, settings["batch_size"],
                                shuffle=True, seed=seed)
    torch.manual_seed(seed)
    model = GPT(**MODEL, lr=settings["lr"], warmup_steps=h, max_steps=rounds * h)
    algorithm = make_algorithm(name, seed) if algorithm is None else algorithm
    sim = TrainingSimulator(model, shards, algorithm, sync_every=h, loss=lambda m, b: m.loss(b),
                            gradient_clip_val=1.0, max_steps=rounds * h, batched=False, step_seconds=speeds,
                            pacing=None if mode == "fixed" else PacingConfig(h * min(speeds), merge=merge),
                            track_norms=False)
    tokens_per_step = settings["batch_size"] * MODEL["block_size"]
    curve: list[dict[str, Any]] = []

    def measure(s: TrainingSimulator) -> None:
        ev = s.evaluate(probe)
        assert s.time is not None
        curve.append({"outer_step": s.rounds_done - 1, "train_seconds": s.time.wall_seconds,
                      "val_loss": ev.mean_replica_loss, "consensus_loss": ev.consensus_loss,
                      "tokens": tokens_per_step * sum(d.slots[0].inner_steps for d in s.drivers)})

    started = time.perf_counter()
    measure(sim)
    sim.run_rounds(callback=measure)
    sim.finish()
    assert sim.time is not None
    fast = [i for i, s in enumerate(speeds) if s == min(speeds)]
    return {"algorithm": name, "mode": mode, "seed": seed, "curve": curve,
            "fast_share": statistics.mean(sim.time.compute_share(i) for i in fast),
            "slowest_share": sim.time.compute_share(speeds.index(max(speeds))),
            "h_i": [statistics.median(r.phase_steps for r in d.reports) for d in sim.drivers],
            "steps": [d.slots[0].inner_steps for d in sim.drivers], "seconds": time.perf_counter() - started}


def run_in_pool(run: Callable[..., dict[str, Any]], jobs: list[tuple[str, str, int]], settings: dict[str, Any],
                workers: int, line: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """``run(algorithm, variant, seed, settings)`` for every job, in ``workers`` spawned processes; the runs in
    the jobs' order, each announced with ``line(run)`` as it comes in."""
    with ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
        futures = [pool.submit(run, a, m, s, settings) for a, m, s in jobs]
        runs = []
        for future in futures:
            runs.append(future.result())
            print(line(runs[-1]), flush=True)
    return runs


def summarise(runs: list[dict[str, Any]], algorithms: list[str]) -> tuple[list[dict[str, Any]], float]:
    """One row per algorithm (means over seeds) and the target loss."""
    by = {(r["algorithm"], r["mode"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    finals = [r["curve"][-1]["val_loss"] for r in runs if r["mode"] != "paced_long"]
    target = round(max(finals) + 0.005, 2)
    rows = []
    for name in algorithms:
        row: dict[str, Any] = {"algorithm": name}
        for mode in ("fixed", "paced", "paced_long"):
            chosen = [by[(name, mode, s)] for s in seeds]
            row[f"{mode}_fast_share"] = statistics.mean(r["fast_share"] for r in chosen)
            row[f"{mode}_final_loss"] = statistics.mean(r["curve"][-1]["val_loss"] for r in chosen)
            row[f"{mode}_seconds"] = statistics.mean(r["curve"][-1]["train_seconds"] for r in chosen)
            row[f"{mode}_tokens"] = statistics.mean(r["curve"][-1]["tokens"] for r in chosen)
            times = [time_to(r["curve"], target, "train_seconds") for r in chosen]
            row[f"{mode}_to_target_s"] = statistics.mean(times) if None not in times else None
            row[f"{mode}_h_i"] = chosen[0]["h_i"]
        fixed, paced, long = ([by[(name, m, s)] for s in seeds] for m in ("fixed", "paced", "paced_long"))
        row["fixed_loss_at_paced_end"] = statistics.mean(
            loss_by(f["curve"], p["curve"][-1]["train_seconds"]) for f, p in zip(fixed, paced))
        row["long_loss_at_fixed_end"] = statistics.mean(
            loss_by(g["curve"], f["curve"][-1]["train_seconds"]) for g, f in zip(long, fixed))
        ratios = [_ratio(time_to(f["curve"], target, "train_seconds"), time_to(p["curve"], target, "train_seconds"))
                  for f, p in zip(fixed, long)]
        row["speedup_to_target"] = statistics.mean(ratios) if None not in ratios else None
        rows.append(row)
    return rows, target


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


COLUMNS = columns(".0f", [("paced_long_to_target_s", "s to target, own H_i 4R", ".0f"),
                          ("speedup_to_target", "speed-up to target", ".2f")])


def noisy_shares(name: str, speeds: list[float], sync_every: int, sync_seconds: float, rounds: int, sigma: float,
                 seed: int, rule: str = "nearest") -> tuple[float, float]:
    """The fast replicas' mean compute share and the slowest one's, in the event model with noisy steps.
    ``rule``: "nearest" (the pacing's, :func:`lightning_loco.driver.pacing.phase_due`) or "floor" (stop before
    the step that would end past T)."""
    import random

    from benchmarks.b6_heterogeneous import schedule_of
    from lightning_loco.driver.pacing import phase_due

    rng, schedule, n = random.Random(seed), schedule_of(name), len(speeds)
    clock, compute = [0.0] * n, [0.0] * n
    for t in range(rounds):
        posted = []
        for i, mean in enumerate(speeds):
            k, seconds = 0, 0.0
            while True:
                k, seconds = k + 1, seconds + mean * rng.lognormvariate(0.0, sigma)
                if rule == "nearest" and phase_due(k, seconds, sync_every, sync_seconds):
                    break
                if rule == "floor" and (k >= sync_every or seconds * (1 + 1 / k) > sync_seconds):
                    break
            compute[i] += seconds
            posted.append(clock[i] + seconds)
        for group in schedule(t, n).groups:
            landed = max(posted[j] for j in group)
            for j in group:
                clock[j] = landed
    shares = [c / w for c, w in zip(compute, clock)]
    fast = [i for i, s in enumerate(speeds) if s == min(speeds)]
    return statistics.mean(shares[i] for i in fast), shares[speeds.index(max(speeds))]


def noise_model() -> list[dict[str, Any]]:
    speeds, rows = [1.0, 1.0, 2.0, 4.0], []
    for sigma in (0.0, 0.1, 0.3):
        for seconds in (10.0, 15.0, 20.0):
            row: dict[str, Any] = {"sigma": sigma, "sync_seconds": seconds}
            for name, rule in (("noloco", "nearest"), ("gasloc", "nearest"), ("diloco", "nearest"),
                               ("diloco", "floor")):
                runs = [noisy_shares(name, speeds, 50, seconds, 200, sigma, seed, rule) for seed in range(5)]
                key = name if rule == "nearest" else f"{name}_{rule}"
                row[f"{key}_fast"] = statistics.mean(f for f, _ in runs)
                row[f"{key}_slowest"] = statistics.mean(s for _, s in runs)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 replicas, one tiny NoLoCo run of each mode")
    parser.add_argument("--seeds", type=int, nargs="+", help="default 0 1 2 (quick: 0)")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--noise", action="store_true", help="only the event model with noisy step times")
    args = parser.parse_args()
    if args.noise:
        rows = noise_model()
        print("B6, the event model with noisy step times: 4 replicas of mean step times 1, 1, 2, 4 s, H = 50, "
              "200 rounds, 5 seeds; compute share of the fast replicas / of the 4x one")
        columns = [("sigma", "σ", ".1f"), ("sync_seconds", "T, s", ".0f")] + [
            (f"{k}_{w}", f"{k.replace('_', ' ')}, {w}", ".3f")
            for k in ("noloco", "gasloc", "diloco", "diloco_floor") for w in ("fast", "slowest")]
        print(table(rows, columns))
        path = write_json("b6_event_noise.json", {"benchmark": "B6 event model, noisy step times", "rows": rows,
                                                  "speeds": [1.0, 1.0, 2.0, 4.0], "sync_every": 50, "rounds": 200,
                                                  "seeds": 5}, results_dir(False))
        print(f"wrote {path}")
        return
    settings = QUICK if args.quick else FULL
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    algorithms = args.algorithms or (["noloco"] if args.quick else list(ALGORITHMS))
    jobs = [(a, m, s) for s in seeds for a in algorithms for m in ("paced_long", "fixed", "paced")]
    speeds = speeds_of(settings["replicas"])
    print(f"B6 part 3 (simulator): {settings['replicas']} replicas of step times {speeds} s, H = "
          f"{settings['sync_every']}, {settings['rounds']} rounds, seeds {seeds}; {len(jobs)} runs", flush=True)
    started = time.perf_counter()
    runs = run_in_pool(run_one, jobs, settings, args.workers, lambda run: (
        f"seed {run['seed']} {run['algorithm']:<7} {run['mode']:<10} loss {run['curve'][-1]['val_loss']:.4f} "
        f"at {run['curve'][-1]['train_seconds']:.0f} s (modelled)  fast share {run['fast_share']:.3f}  "
        f"H_i {run['h_i'][-3:]}  ({run['seconds']:.0f} s here)"))
    rows, target = summarise(runs, algorithms)
    wall = time.perf_counter() - started
    print(f"\nB6 part 3: {settings['replicas']} simulated GPT replicas, step times {speeds[-3:]} s (the rest 1 s), "
          f"H = {settings['sync_every']}, T = {settings['sync_every']} s, {settings['rounds']} rounds, seeds {seeds}, "
          f"target loss {target}; modelled seconds; {wall:.0f} s here on {machine()}")
    print(table(rows, COLUMNS))
    saved = {"benchmark": "B6 heterogeneous replicas, simulated", "settings": settings, "model": MODEL,
             "step_seconds": speeds, "sync_seconds": settings["sync_every"] * min(speeds), "seeds": seeds,
             "target": target, "rows": rows, "runs": runs, "wall_seconds": wall, "machine": machine()}
    path = write_json("b6_simulated.json", saved, results_dir(args.quick))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
