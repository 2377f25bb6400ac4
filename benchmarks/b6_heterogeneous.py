"""B6, replicas of different speeds: one H for every replica against each replica's own H_i (``sync_seconds``).

    python -m benchmarks.b6_heterogeneous            # ~8 min a seed on 2 cores: the event model, then 4 GPT replicas
    python -m benchmarks.b6_heterogeneous --quick    # ~1 min: the event model and a tiny NoLoCo run of each mode

Two parts:

1. **The event model** of the schedules alone (no training, exchanges take no time): N replicas of
   given step times post round t after their inner phase (H steps each, or their own H_i under
   ``sync_seconds``) and go on when the last member of their group of the round has posted (the
   groups are the algorithms' own schedules). It gives each replica's compute share (compute over
   wall time) for N = 4 (speeds 1, 1, 2, 4), N = 8 with one replica 2× slower, and N = 16 with one
   2× and one 4× slower replica.
2. **Processes**: the Shakespeare GPT example on N = 4 replicas (CPU processes, gloo), replica 2
   made 2× slower and replica 3 4× slower by sleeping after every step for 1× and 3× the time that
   step's own compute took. NoLoCo, GASLoC and DiLoCo, fixed H against ``sync_seconds`` with
   T = 0.8 × H × the example's step time measured alone (so that even the fast replicas, slowed by
   sharing the cores, are paced by T), the same number of rounds R; and ``sync_seconds`` again for
   4R rounds, which takes about as long as fixed H's R rounds. Every replica keeps its weights
   after each round and evaluates them on the same validation batches after training (validation
   during a paced fit is not possible: docs/heterogeneous.md), so the curve costs training nothing.
   Reported: the fast replicas' compute share (their compute over their wall time, from the
   driver's reports), the validation loss (mean over replicas) after R rounds, the time to a target
   loss (the highest final loss of the R-round runs, so that every run reaches it), fixed H's loss
   when the paced run of R rounds ends, and the 4R-round paced run's loss when fixed H's run ends
   (equal wall time, both ways).

Part 3, N = 16 replicas in the training simulator on modelled step times, is
:mod:`benchmarks.b6_simulated` (``python -m benchmarks.b6_simulated``).

The machine these numbers come from has 2 cores shared by 4 replicas: runs are short (R = 5 rounds of
H = 50, the example's H) and the fast replicas' steps are slowed by sharing the cores.
Writes ``benchmarks/results/b6_heterogeneous.json`` and ``docs/img/b6_heterogeneous.png`` (a
``--quick`` run writes both to a temporary folder instead, or to ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.b2_time_to_loss import time_to
from benchmarks.common import ROOT, machine, results_dir, run_python, table, write_json

ALGORITHMS = ("noloco", "gasloc", "diloco")
LONG = 4  # the third mode: own H_i for 4× the rounds, to compare losses at the fixed-H run's wall time
SPEEDS = (1, 1, 2, 4)  # replica i takes SPEEDS[i] times the fast replicas' step time


# ---------------------------------------------------------------------------- 1. the event model


def schedule_of(name: str):
    from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo

    return {"noloco": NoLoCo, "gasloc": GASLoC, "diloco": DiLoCo}[name]().schedule


def modelled_shares(name: str, step_times: list[float], sync_every: int, sync_seconds: Optional[float],
                    rounds: int) -> list[float]:
    """Each replica's compute share over ``rounds`` rounds of the algorithm's schedule, exchanges free."""
    from lightning_loco.driver.pacing import phase_steps

    schedule, n = schedule_of(name), len(step_times)
    clock, compute = [0.0] * n, [0.0] * n
    for t in range(rounds):
        posted = []
        for i, s in enumerate(step_times):
            k = sync_every if sync_seconds is None else phase_steps(s, sync_every, sync_seconds)
            compute[i] += k * s
            posted.append(clock[i] + k * s)
        for group in schedule(t, n).groups:
            landed = max(posted[j] for j in group)
            for j in group:
                clock[j] = landed
    return [c / w for c, w in zip(compute, clock)]


EVENT_CASES = {"N=4 (1, 1, 2, 4)": [1.0, 1.0, 2.0, 4.0], "N=8, one 2x": [1.0] * 7 + [2.0],
               "N=16, one 2x, one 4x": [1.0] * 14 + [2.0, 4.0]}


def event_model(sync_every: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for case, steps in EVENT_CASES.items():
        fast = [i for i, s in enumerate(steps) if s == 1.0]
        for name in ALGORITHMS:
            row: dict[str, Any] = {"case": case, "algorithm": name}
            for mode, seconds in (("fixed", None), ("paced", float(sync_every))):  # T = H × the fast step time
                shares = modelled_shares(name, steps, sync_every, seconds, rounds)
                row[f"{mode}_fast"] = statistics.mean(shares[i] for i in fast)
                row[f"{mode}_slowest"] = shares[steps.index(max(steps))]
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------- 2. processes (one run per subprocess)


def model_kwargs(quick: bool) -> dict[str, int]:
    if quick:
        return {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
    return {"block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64}  # examples/shakespeare/*.yaml


def measure_step(quick: bool, batch_size: int) -> float:
    """The example's step time in this process alone (median of 10 after 5 to warm up), one thread."""
    import torch

    from lightning_loco.examples.gpt import GPT

    torch.set_num_threads(1)
    kwargs = model_kwargs(quick)
    model = GPT(**kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 256, (batch_size, kwargs["block_size"]))
    times = []
    for i in range(15):
        started = time.perf_counter()
        loss = model.loss((x, x))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i >= 5:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def worker(spec: dict[str, Any]) -> None:
    """One training run of 4 replicas (forked ranks); each rank writes ``rank<r>.json``."""
    import lightning as L
    import torch

    from lightning_loco.examples.gpt import GPT
    from lightning_loco.examples.text import ByteTextDataModule
    from lightning_loco.testing.launch import strategy_class

    torch.set_num_threads(1)
    out, slowdown = Path(spec["out"]), spec["slowdown"]

    class Slowdown(L.Callback):
        """Sleeps after every step for (factor − 1) × that step's own compute (its round's time left out)."""

        def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.started, self.seen = time.perf_counter(), len(trainer.strategy.outer_step_reports)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            factor = slowdown[trainer.global_rank]
            if factor > 1:
                rounds = sum(r.seconds for r in trainer.strategy.outer_step_reports[self.seen :])
                time.sleep((factor - 1) * max(0.0, time.perf_counter() - self.started - rounds))

    class Curve(L.Callback):
        """Keeps the weights after every round with the wall time; evaluates them after training."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.points = [(-1, 0.0, self.weights(pl_module))]
            self.seen, self.start = 0, time.time()  # the ranks start together: setup broadcast rank 0's weights

        @staticmethod
        def weights(pl_module: Any) -> Any:
            return torch.nn.utils.parameters_to_vector(pl_module.parameters()).detach().clone()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            reports = trainer.strategy.outer_step_reports
            for report in reports[self.seen :]:
                self.points.append((report.outer_step, time.time() - self.start, self.weights(pl_module)))
            self.seen = len(reports)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            data = trainer.datamodule
            batches = [data.val_set[k] for k in range(spec["val_batches"] * spec["batch_size"])]
            curve = []
            with torch.no_grad():
                for t, seconds, vector in self.points:
                    model = GPT(**spec["model"])
                    torch.nn.utils.vector_to_parameters(vector, model.parameters())
                    losses = []
                    for k in range(0, len(batches), spec["batch_size"]):
                        chunk = batches[k : k + spec["batch_size"]]
                        x = torch.stack([c[0] for c in chunk])
                        y = torch.stack([c[1] for c in chunk])
                        losses.append(model.loss((x, y)).item())
                    curve.append({"outer_step": t, "train_seconds": seconds, "val_loss": statistics.mean(losses)})
            record = {"curve": curve, "steps": trainer.global_step,
                      "reports": [dataclasses.asdict(r) for r in trainer.strategy.outer_step_reports]}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    L.seed_everything(spec["seed"], verbose=False)
    kwargs = {"sync_every": spec["sync_every"], "pacing": spec["sync_seconds"], "start_method": "fork"}
    if spec["algorithm"] != "diloco":
        kwargs["seed"] = spec["seed"]
    strategy = strategy_class(spec["algorithm"])(**kwargs)
    steps = spec["rounds"] * spec["sync_every"]
    model = GPT(**spec["model"], lr=3e-3, warmup_steps=spec["sync_every"], max_steps=steps)
    data = ByteTextDataModule(block_size=spec["model"]["block_size"], batch_size=spec["batch_size"])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=len(slowdown), max_steps=steps,
                        gradient_clip_val=1.0, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Slowdown(), Curve()])
    trainer.fit(model, datamodule=data)


def run(algorithm: str, sync_seconds: Optional[float], seed: int, quick: bool, sync_every: int, rounds: int,
        batch_size: int) -> dict[str, Any]:
    """One run in a subprocess; returns each rank's record."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"algorithm": algorithm, "sync_seconds": sync_seconds, "seed": seed, "sync_every": sync_every,
                "rounds": rounds, "slowdown": list(SPEEDS), "model": model_kwargs(quick), "out": tmp,
                "batch_size": batch_size, "val_batches": 2 if quick else 8}
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = run_python(["-m", "benchmarks.b6_heterogeneous", "--worker", json.dumps(spec)], env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{algorithm} (sync_seconds={sync_seconds}) failed:\n{proc.stderr[-4000:]}")
        return {"ranks": [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(len(SPEEDS))]}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """The curve of the mean replica loss against the slowest replica's time at each round, and shares."""
    ranks = result["ranks"]
    curve = [{"outer_step": points[0]["outer_step"], "train_seconds": max(p["train_seconds"] for p in points),
              "val_loss": statistics.mean(p["val_loss"] for p in points)}
             for points in zip(*(r["curve"] for r in ranks))]

    def share(rank: dict[str, Any]) -> float:
        compute = sum(r["compute_seconds"] for r in rank["reports"])
        return compute / sum(r["compute_seconds"] / r["compute_share"] for r in rank["reports"])

    fast = [i for i, s in enumerate(SPEEDS) if s == 1]
    return {"curve": curve, "fast_share": statistics.mean(share(ranks[i]) for i in fast),
            "slowest_share": share(ranks[SPEEDS.index(max(SPEEDS))]),
            "h_i": [statistics.median(r["phase_steps"] for r in rank["reports"]) for rank in ranks],
            "steps": [rank["steps"] for rank in ranks]}


def loss_by(curve: list[dict[str, Any]], seconds: float) -> float:
    """The validation loss ``seconds`` into training: interpolated between rounds, the final loss of a
    run that had ended by then."""
    for a, b in zip(curve, curve[1:]):
        if a["train_seconds"] <= seconds <= b["train_seconds"]:
            span = b["train_seconds"] - a["train_seconds"]
            frac = (seconds - a["train_seconds"]) / span if span > 0 else 1.0
            return a["val_loss"] + frac * (b["val_loss"] - a["val_loss"])
    return curve[-1]["val_loss"]


def columns(seconds: str, to_target: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """B6's table (part 2 here, part 3 in :mod:`benchmarks.b6_simulated`): its columns, with the times written
    as ``seconds`` says and the times to the target loss as ``to_target`` gives them (each part has its own)."""
    return [("algorithm", "algorithm", "s"), ("fixed_fast_share", "fast share, one H", ".3f"),
            ("paced_fast_share", "fast share, own H_i", ".3f"), ("fixed_final_loss", "loss, one H", ".3f"),
            ("paced_final_loss", "loss, own H_i", ".3f"), ("fixed_seconds", "s, one H", seconds),
            ("paced_seconds", "s, own H_i", seconds), ("fixed_to_target_s", "s to target, one H", seconds),
            *to_target,
            ("fixed_loss_at_paced_end", "one H's loss when own H_i ends", ".3f"),
            ("paced_long_final_loss", "loss, own H_i, 4R rounds", ".3f"),
            ("paced_long_seconds", "s, 4R rounds", seconds),
            ("long_loss_at_fixed_end", "4R rounds' loss when one H ends", ".3f")]


COLUMNS = columns(".1f", [("paced_to_target_s", "s to target, own H_i", ".1f")])


def plot(saved: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3))
    rows, width = saved["rows"], 0.38
    labels = [r["algorithm"] for r in rows]
    for j, mode in enumerate(("fixed", "paced")):
        values = [r[f"{mode}_fast_share"] for r in rows]
        axes[0].bar([i + (j - 0.5) * width for i in range(len(rows))], values, width,
                    label="one H for all" if mode == "fixed" else "own H_i (sync_seconds)")
    events = [r for r in saved["event_model"] if r["case"].startswith("N=16") and r["algorithm"] in labels]
    axes[0].scatter([i - width / 2 for i in range(len(events))], [r["fixed_fast"] for r in events], marker="_",
                    s=300, color="k", label="event model, N = 16")
    axes[0].scatter([i + width / 2 for i in range(len(events))], [r["paced_fast"] for r in events], marker="_",
                    s=300, color="k")
    axes[0].set_xticks(range(len(rows)), labels)
    axes[0].set_ylabel("fast replicas' compute share")
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=7, loc="lower right")
    for i, name in enumerate(labels):
        for mode, style, what in (("fixed", "--", "one H"), ("paced", "-", "own H_i"),
                                  ("paced_long", ":", f"own H_i, {LONG}× rounds")):
            curve = saved["curves"][name][mode][0]
            axes[1].plot([p["train_seconds"] for p in curve], [p["val_loss"] for p in curve], style, color=f"C{i}",
                         label=f"{name}, {what}")
    axes[1].axhline(saved["target"], color="grey", lw=0.7, ls=":")
    axes[1].set_xlabel("wall time, s (seed 0)")
    axes[1].set_ylabel("validation loss (mean over replicas)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"B6: 4 replicas, speeds {SPEEDS}, H = {saved['sync_every']}, {saved['rounds']} rounds; "
                 f"{saved['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the event model and a tiny NoLoCo run of each mode")
    parser.add_argument("--seeds", type=int, nargs="+", help="default 0 (quick: 0)")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    folder = results_dir(args.quick)
    sync_every, rounds = (4, 3) if args.quick else (50, 5)
    batch_size = 4 if args.quick else 16
    events = event_model(50, 40)
    print("\nB6 part 1, the event model: compute share (compute / wall time), H = 50, 40 rounds, T = H × the fast "
          "step time, exchanges free")
    print(table(events, [("case", "case", "s"), ("algorithm", "algorithm", "s"), ("fixed_fast", "fast, one H", ".3f"),
                         ("paced_fast", "fast, own H_i", ".3f"), ("fixed_slowest", "slowest, one H", ".3f"),
                         ("paced_slowest", "slowest, own H_i", ".3f")]), flush=True)
    step = measure_step(args.quick, batch_size)
    sync_seconds = 0.8 * sync_every * step
    seeds = args.seeds or [0]
    algorithms = args.algorithms or (["noloco"] if args.quick else list(ALGORITHMS))
    print(f"\nB6 part 2: the example alone takes {step * 1e3:.1f} ms a step here; sync_seconds = {sync_seconds:.2f}",
          flush=True)
    modes = {"fixed": (None, rounds), "paced": (sync_seconds, rounds), "paced_long": (sync_seconds, LONG * rounds)}
    curves: dict[str, dict[str, list]] = {a: {m: [] for m in modes} for a in algorithms}
    summaries: dict[str, dict[str, list]] = {a: {m: [] for m in modes} for a in algorithms}
    for seed in seeds:
        for name in algorithms:
            for mode, (seconds, mode_rounds) in modes.items():
                summary = summarise(run(name, seconds, seed, args.quick, sync_every, mode_rounds, batch_size))
                curves[name][mode].append(summary["curve"])
                summaries[name][mode].append(summary)
                print(f"seed {seed} {name:<7} {mode:<10} final loss {summary['curve'][-1]['val_loss']:.4f}  "
                      f"{summary['curve'][-1]['train_seconds']:.1f} s  fast share {summary['fast_share']:.3f}  "
                      f"H_i {summary['h_i']}", flush=True)
    finals = [s["curve"][-1]["val_loss"] for a in algorithms for m in ("fixed", "paced") for s in summaries[a][m]]
    target = round(max(finals) + 0.005, 2)
    rows = []
    for name in algorithms:
        row: dict[str, Any] = {"algorithm": name}
        for mode in modes:
            runs = summaries[name][mode]
            row[f"{mode}_fast_share"] = statistics.mean(s["fast_share"] for s in runs)
            row[f"{mode}_final_loss"] = statistics.mean(s["curve"][-1]["val_loss"] for s in runs)
            row[f"{mode}_seconds"] = statistics.mean(s["curve"][-1]["train_seconds"] for s in runs)
            times = [time_to(s["curve"], target, "train_seconds") for s in runs]
            row[f"{mode}_to_target_s"] = statistics.mean(times) if None not in times else None
            row[f"{mode}_h_i"] = runs[0]["h_i"]
        fixed, paced, long = (summaries[name][m] for m in modes)
        # equal wall time, both ways: one H when the paced run of R rounds ends; own H_i (4R rounds) when one H ends
        row["fixed_loss_at_paced_end"] = statistics.mean(
            loss_by(f["curve"], p["curve"][-1]["train_seconds"]) for f, p in zip(fixed, paced))
        row["long_loss_at_fixed_end"] = statistics.mean(
            loss_by(g["curve"], f["curve"][-1]["train_seconds"]) for g, f in zip(long, fixed))
        rows.append(row)
    print(f"\nB6 part 2: 4 GPT replicas (processes) of speeds {SPEEDS}, H = {sync_every}, {rounds} rounds, "
          f"seeds {seeds}, target loss {target}; {machine()}")
    print(table(rows, COLUMNS))
    saved = {"benchmark": "B6 heterogeneous replicas", "speeds": list(SPEEDS), "sync_every": sync_every,
             "rounds": rounds, "step_seconds_alone": step, "sync_seconds": sync_seconds, "seeds": seeds,
             "target": target, "event_model": events, "rows": rows, "curves": curves,
             "runs": {a: {m: [{k: v for k, v in s.items() if k != "curve"} for s in runs] for m, runs in modes.items()}
                      for a, modes in summaries.items()}}
    path = write_json("b6_heterogeneous.json", saved, folder)
    image = folder / "b6_heterogeneous.png" if args.quick else ROOT / "docs" / "img" / "b6_heterogeneous.png"
    if "LOCO_BENCH_RESULTS" in os.environ:
        image = folder / "b6_heterogeneous.png"
    plot(json.loads(path.read_text()), image)
    print(f"wrote {path} and {image}")


if __name__ == "__main__":
    main()
