"""B8, time to loss in the papers' regime: B5's long configuration (the byte-level GPT, H = 50, 60 outer steps)
weighed in wall time on the emulated WAN, where DiLoCo's all-reduce of the model costs about H inner steps of
compute (the regime Streaming DiLoCo targets).

    python -m benchmarks.b7_torchft --modes emulated --replicas 8 16 --params 120576 --fragments 1 \\
        --overlap 0 --rounds 5 --out b8_exchange                        # 1. the exchanges, measured (~10 min)
    python -m benchmarks.b8_time_to_loss                               # 2. the curves (~40 min) and 3. the table
    python -m benchmarks.b8_time_to_loss --quick                       # seconds: the same code on a tiny run

Three parts:

1. **The exchanges, measured** in real processes on the emulated WAN (100 Mbit/s, 50 ms one way): B7
   (:mod:`benchmarks.b7_torchft`) on a flat model of the GPT's 120,576 parameters, N = 8 and 16, every sync
   blocking. Per method, the slowest replica's exposed seconds of one outer step (median over the rounds): our
   DiLoCo's all-reduce, NoLoCo's and GASLoC's pair exchanges, and torchft's DiLoCo (its quorum included).
2. **The loss curves**, in the training simulator (:class:`lightning_loco.simulator.TrainingSimulator`, the
   strategies' own driver and outer step; B5 checked it against real processes): B5's long part for N = 8
   without overlap (``b5_long.json``: DDP, DiLoCo, NoLoCo, GASLoC, 3 seeds), and run here: N = 8 with overlap
   τ = H/2 = 25 for the three methods, and N = 16 without overlap for the four (one seed each). The loss is the
   consensus model's (the replicas' average: what a run keeps) on held-out text, every 5 outer steps.
3. **The time model.** Every replica's inner step takes X seconds of modelled compute, the same for every
   method (compute belongs to the model): X = our DiLoCo's measured all-reduce at N = 8 ÷ H, so that the
   all-reduce costs H inner steps. After s inner steps a method has spent s·X + ⌊s/H⌋·e, where e is what one
   outer step exposes: the measured exchange when it blocks, max(0, exchange − τ·X) when it overlaps τ steps of
   compute. DDP all-reduces the same payload at every step: s·(X + DiLoCo's all-reduce), none of it hidden
   (its backward pass, about 2/3 of X, could hide at most that much). torchft's DiLoCo takes our DiLoCo's curve
   (the same outer step, Nesterov 0.9 at 0.7) at its own measured exchange.

Reported per N: the final loss and wall time, the wall time to DiLoCo's final loss and to DDP's loss at 60 % of
its run, and every method's loss at equal wall time (when the fastest method's run ends). Losses between
evaluations are interpolated in time; a target a curve never reaches is "—".

What the wall times are not: a real run's, where overlap also changes what the exchanges contend with, and
where the last round of a run lands fully (counted here like every other). The losses are the simulator's, at
the same tokens; only the clock is composed. This machine cannot run the regime in real processes: 8 Lightning
processes of the GPT on its 2 cores take 0.089 s a step (B5's long part), and the WAN's all-reduce of the GPT's
0.48 MB took 1.50 s (part 1), about 17 such steps, not 50.

Writes ``benchmarks/results/b8_time_to_loss.json`` (``--quick``: a temporary folder, or
``$LOCO_BENCH_RESULTS``); the runs of part 2 go to ``benchmarks/results/b8_runs/``.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from benchmarks.b2_time_to_loss import time_to
from benchmarks.b5_convergence.fidelity import LONG, LONG_QUICK
from benchmarks.b5_convergence.grid import Job, Settings
from benchmarks.b5_convergence.runs import run_job
from benchmarks.common import RESULTS, machine, pool_context, results_dir, table, write_json

METHODS = ("ddp", "diloco", "noloco", "gasloc_pairs")
EXCHANGE_OF = {"diloco": "diloco F=1", "noloco": "noloco F=1", "gasloc_pairs": "gasloc F=1",
               "torchft": "torchft F=1", "torchft_buckets": "torchft_buckets F=1"}
TORCHFT_LABELS = {"torchft": "torchft DiLoCo (its defaults)", "torchft_buckets": "torchft DiLoCo, bucketed"}
OVERLAPPED = ("diloco", "noloco", "gasloc_pairs")
DDP_SHARE = 0.6  # the second target: DDP's loss at 60 % of its run


# ---------------------------------------------------------------- part 1: the measured exchanges


def exchanges(path: Path) -> dict[int, dict[str, float]]:
    """Per N, per method, the slowest replica's exposed seconds of one blocking outer step (median over rounds),
    from a B7 results file (its emulated WAN rows), and the payload (``params``)."""
    rows = json.loads(path.read_text())["rows"]
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        if row["overlap_steps"] != 0 or row["mode"] != "emulated":
            continue
        out[row["replicas"]] = {m: row["runs"][k]["exposed_s"]["median"] for m, k in EXCHANGE_OF.items()
                                if k in row["runs"]}
        out[row["replicas"]]["params"] = row["params"]
    return out


# ---------------------------------------------------------------- part 2: the curves


def jobs(settings: Settings, replicas: tuple[int, ...], quick: bool) -> list[Job]:
    """What part 2 runs here: overlap τ = H/2 at the first N, every method without overlap at the others (and at
    the first N too in a quick run, which has no B5 records to take)."""
    h, first = settings.sync_every, replicas[0]
    out = [Job(m, first, "iid", 0, h, "b8", overlap=h // 2) for m in OVERLAPPED]
    for n in replicas[1:] if not quick else replicas:
        out += [Job(m, n, "iid", 0, h, "b8") for m in METHODS]
    return out


def curve_of(record: dict[str, Any]) -> list[dict[str, float]]:
    return [{"step": p["step"], "loss": p["consensus"]} for p in record["curve"]]


def published_curves(path: Path) -> dict[str, list[dict[str, float]]]:
    """B5's long part (N = 8, τ = 0): each method's consensus loss, the mean over its seeds."""
    curves = json.loads(path.read_text())["curves"]
    return {m: [{"step": p["step"], "loss": p["consensus"]} for p in curves[m]] for m in METHODS}


# ---------------------------------------------------------------- part 3: the time model


def seconds_at(step: int, h: int, x: float, exchange: float, overlap: int, every_step: bool = False) -> float:
    """Wall seconds after ``step`` inner steps: compute, and what the outer steps (or DDP's per-step all-reduces,
    ``every_step``) expose."""
    if every_step:
        return step * (x + exchange)
    return step * x + (step // h) * max(0.0, exchange - overlap * x)


def timed(curve: list[dict[str, float]], h: int, x: float, exchange: float, overlap: int,
          every_step: bool) -> list[dict[str, float]]:
    """A loss curve on the modelled clock, in :func:`benchmarks.b2_time_to_loss.time_to`'s form."""
    return [{"train_seconds": seconds_at(int(p["step"]), h, x, exchange, overlap, every_step),
             "val_loss": p["loss"], "step": p["step"]} for p in curve]


def loss_at(curve: list[dict[str, float]], seconds: float) -> Optional[float]:
    """The loss at ``seconds``, interpolated between evaluations (None past the curve's end)."""
    for a, b in zip(curve, curve[1:]):
        if a["train_seconds"] <= seconds <= b["train_seconds"]:
            span = b["train_seconds"] - a["train_seconds"]
            frac = (seconds - a["train_seconds"]) / span if span else 1.0
            return a["val_loss"] + frac * (b["val_loss"] - a["val_loss"])
    return None


def at_step(curve: list[dict[str, float]], step: float) -> float:
    """The loss at ``step``, interpolated between evaluations."""
    for a, b in zip(curve, curve[1:]):
        if a["step"] <= step <= b["step"]:
            return a["loss"] + (step - a["step"]) / (b["step"] - a["step"]) * (b["loss"] - a["loss"])
    raise ValueError(f"step {step} is outside the curve")


def compose(n: int, curves: dict[str, list[dict[str, float]]], exchange: dict[str, float], h: int, x: float,
            overlap: int) -> list[dict[str, Any]]:
    """One N's rows: every (method, τ) on the modelled clock, with the targets and the loss at equal wall time."""
    cases = []  # (label, method, curve key, exchange, τ, every step)
    for key in curves:
        method, _, tau = key.partition("@")
        if method == "ddp":
            cases.append(("DDP", method, key, exchange["diloco"], 0, True))
            continue
        cases.append((f"{method}" + (f", τ = {tau}" if tau else ""), method, key, exchange[method],
                      int(tau or 0), False))
        if method == "diloco" and not tau:
            cases += [(label, m, key, exchange[m], 0, False) for m, label in TORCHFT_LABELS.items() if m in exchange]
    diloco_final = curves["diloco"][-1]["loss"]
    ddp_target = at_step(curves["ddp"], DDP_SHARE * curves["ddp"][-1]["step"]) if "ddp" in curves else None
    rows = []
    for label, _method, key, e, tau, every_step in cases:
        clock = timed(curves[key], h, x, e, tau, every_step)
        rows.append({"replicas": n, "payload": exchange.get("params"), "method": label, "overlap_steps": tau,
                     "exchange_s": e,
                     "exposed_per_round_s": e if every_step else max(0.0, e - tau * x),
                     "final_loss": clock[-1]["val_loss"], "wall_s": clock[-1]["train_seconds"],
                     "to_diloco_final_s": time_to(clock, diloco_final, "train_seconds"),
                     "to_ddp_60_s": time_to(clock, ddp_target, "train_seconds") if ddp_target else None,
                     "clock": clock})
    equal = min(r["wall_s"] for r in rows)
    for r in rows:
        r["loss_at_equal_wall"] = loss_at(r["clock"], equal)
        r["equal_wall_s"] = equal
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    shown = [{**r, **{k: (r[k] if r[k] is not None else float("nan")) for k in ("to_diloco_final_s", "to_ddp_60_s")},
              "payload": f"{r['payload'] / 1e6:g} M" if r["payload"] else "-"} for r in rows]
    print(table(shown, [
        ("replicas", "N", "d"), ("payload", "exchanges of", "s"), ("method", "method", "s"),
        ("exposed_per_round_s", "exposed/round s", ".2f"), ("wall_s", "wall s", ".0f"),
        ("final_loss", "final loss", ".3f"), ("to_diloco_final_s", "to DiLoCo's final s", ".0f"),
        ("to_ddp_60_s", "to DDP@60% s", ".0f"), ("loss_at_equal_wall", "loss at equal wall", ".3f")]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny run of every part but the measured exchanges")
    parser.add_argument("--exchange", default=str(RESULTS / "b8_exchange.json"),
                        help="B7's results on the GPT's payload (part 1; default benchmarks/results/b8_exchange.json)")
    parser.add_argument("--bandwidth-bound", default=str(RESULTS / "b7_torchft_n8.json"),
                        help="B7's results on a larger payload (10 M at N = 8: exchanges bound by bandwidth, as a "
                        "real model's are), composed with the same curves on a clock of their own (a missing file "
                        "skips it)")
    parser.add_argument("--replicas", nargs="+", type=int, default=[8, 16], help="N (default 8 16; the first gets "
                        "the overlap runs, and its τ = 0 curves from B5's long part)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs-only", action="store_true", help="part 2 alone (its runs need no exchanges)")
    args = parser.parse_args()
    settings = replace(LONG_QUICK, steps=16, eval_every=8) if args.quick else LONG
    replicas = tuple([2, 4] if args.quick else args.replicas)
    folder = results_dir(args.quick)
    runs_dir = folder / "b8_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    h = settings.sync_every
    if args.runs_only:
        measured = {}
    elif args.quick:  # no WAN here: exchanges of a plausible shape (an all-reduce twice a pair's), to run the code
        measured = {n: {"diloco": 1.0 + 0.1 * n, "noloco": 0.5, "gasloc_pairs": 0.55, "torchft": 1.1 + 0.1 * n}
                    for n in replicas}
    else:
        measured = exchanges(Path(args.exchange))
        missing = [n for n in replicas if n not in measured]
        if missing:
            parser.error(f"{args.exchange} has no exchanges for N = {missing}: run part 1 (see --help)")
    x = measured[replicas[0]]["diloco"] / h if measured else float("nan")
    started = time.perf_counter()
    todo = [j for j in jobs(settings, replicas, args.quick) if not (runs_dir / f"{j.name}.json").exists()]
    print(f"B8 on {machine()}: X = {x * 1000:.1f} ms per inner step; {len(todo)} simulator runs to do", flush=True)
    with ProcessPoolExecutor(args.workers, mp_context=pool_context()) as pool:
        futures = [pool.submit(run_job, j, settings, str(runs_dir / f"{j.name}.json"), 1) for j in todo]
        for k, future in enumerate(futures):
            record = future.result()
            print(f"[{k + 1}/{len(todo)} {time.perf_counter() - started:6.0f} s] {record['name']}: consensus "
                  f"{record['final']['consensus']:.3f} ({record['seconds']:.0f} s)", flush=True)
    if args.runs_only:
        return
    larger = {} if args.quick or not Path(args.bandwidth_bound).exists() else exchanges(Path(args.bandwidth_bound))
    rows = []
    for i, n in enumerate(replicas):
        curves: dict[str, list[dict[str, float]]] = {}
        if i == 0 and not args.quick:
            curves.update(published_curves(RESULTS / "b5_long.json"))
        for job in jobs(settings, replicas, args.quick):
            if job.replicas == n:
                record = json.loads((runs_dir / f"{job.name}.json").read_text())
                curves[job.method + (f"@{job.overlap}" if job.overlap else "")] = curve_of(record)
        rows += compose(n, curves, measured[n], h, x, h // 2)
        if n in larger:  # the same curves on the larger payload's clock: X from its own DiLoCo all-reduce
            rows += compose(n, curves, larger[n], h, larger[n]["diloco"] / h, h // 2)
    print_rows(rows)
    path = write_json("b8_time_to_loss.json", {
        "benchmark": "B8 time to loss in the papers' regime", "settings": settings.__dict__,
        "step_seconds": x, "exchange": {str(n): measured[n] for n in replicas},
        "bandwidth_bound": {str(n): {**larger[n], "step_seconds": larger[n]["diloco"] / h} for n in larger},
        "exchange_source": "quick: made up" if args.quick else args.exchange,
        "seconds": time.perf_counter() - started, "rows": rows}, folder)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
