"""B4, overhead: inner-step throughput and peak memory of each strategy against a plain
single-process Trainer on the same module, with and without ``outer_state_device="cpu"``.

    python -m benchmarks.b4_overhead [--steps 300] [--repeats 3] [--sync-every 50]
    python -m benchmarks.b4_overhead --quick          # ~10 s: plain, noloco-2, noloco-2-cpu-state at once

The module is the example GPT on Shakespeare (``lightning_loco.examples``). Every configuration runs
in its own process tree with one thread per process (``OMP_NUM_THREADS=1``), so on a machine with at least N cores each
replica has a core to itself, as the plain Trainer does. Configurations are interleaved across
repeats so that drifts in machine load hit all of them alike. Per run, from a callback:

* inner step: median wall time from ``on_train_batch_start`` to ``on_train_batch_end`` over steps
  that ran no outer step (forward, backward, optimizer; data loading excluded);
* all steps: mean over every step, outer steps included (the amortised cost per step).

The first 20 steps are warm-up and not counted. Peak memory is each process's peak resident set
size (``ru_maxrss``; the slowest, largest replica counts). On a CPU machine the outer state lives
in host memory either way, so ``outer_state_device="cpu"`` can only show its cost, not its saving;
on an accelerator it moves the float32 outer state out of device memory.
Writes ``benchmarks/results/b4_overhead.json`` and ``.png`` (a ``--quick`` run writes them to a
temporary folder instead, or to ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import grouped_bars, machine, results_dir, skip_final_collection
from lightning_loco.testing.elastic import child_env

CONFIGS = {  # (strategy's name, devices, its arguments besides sync_every)
    "plain": ("auto", 1, {}),
    "noloco-1": ("noloco", 1, {}),
    "noloco-2": ("noloco", 2, {}),
    "gasloc-2": ("gasloc", 2, {}),
    "diloco-2": ("diloco", 2, {}),
    "noloco-2-cpu-state": ("noloco", 2, {"outer_state_device": "cpu"}),
}
QUICK_CONFIGS = ("plain", "noloco-2", "noloco-2-cpu-state")
WARMUP = 20


def run_one(strategy_name: str, devices: int, kwargs: dict, steps: int, sync_every: int, out: str) -> None:
    import lightning as L
    import torch

    from lightning_loco.examples.gpt import GPT
    from lightning_loco.examples.text import ByteTextDataModule
    from lightning_loco.testing.launch import strategy_class

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.outer: list[bool] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.start = time.perf_counter()
            self.outer_before = getattr(trainer.strategy, "outer_steps", 0)

        def on_train_batch_end(self, *args: object) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.outer.append(getattr(trainer.strategy, "outer_steps", 0) != self.outer_before)

    strategy = "auto" if strategy_name == "auto" else strategy_class(strategy_name)(sync_every=sync_every, **kwargs)
    timer = StepTimer()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[timer],
    )
    trainer.fit(GPT(max_steps=steps), datamodule=ByteTextDataModule())
    times, outer = timer.times[WARMUP:], timer.outer[WARMUP:]
    inner = [t for t, o in zip(times, outer) if not o]
    result = {"inner_step_s": statistics.median(inner), "all_steps_s": statistics.mean(times),
              "outer_steps": sum(outer),
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    with open(f"{out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


def plot(saved: dict, path: Path) -> None:
    """Bars of the three ratios (strategy over plain Trainer) per configuration."""
    rows = saved["rows"]
    series = {label: [r[key] for r in rows] for key, label in (
        ("inner_ratio", "inner step time"), ("all_ratio", "time per step, outer steps included"),
        ("rss_ratio", "peak resident memory"))}
    grouped_bars(path, [r["config"] for r in rows], series, "ratio to the plain Trainer",
                 f"B4 overhead: example GPT, {saved['steps']} steps, H = {saved['sync_every']}, {saved['repeats']} "
                 f"repeats (medians); {saved['network']}; {saved['machine']}", size=(9, 3.8), reference=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK_CONFIGS)} only, started together (a smoke test: the timings "
                        f"mean nothing); {WARMUP} + 10 steps, 1 repeat, H = 10")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--sync-every", type=int)
    parser.add_argument("--out", help="default: b4_overhead.json in benchmarks/results (quick: in a temporary folder)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one configuration
    parser.add_argument("--run-out", help=argparse.SUPPRESS)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON of an earlier run")
    args = parser.parse_args()
    args.out = args.out or str(results_dir(args.quick) / "b4_overhead.json")
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return
    args.steps = args.steps or (WARMUP + 10 if args.quick else 300)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.sync_every = args.sync_every or (10 if args.quick else 50)
    if args.run:
        name, devices, kwargs = CONFIGS[args.run]
        run_one(name, devices, kwargs, args.steps, args.sync_every, args.run_out)
        skip_final_collection()  # both ranks: Lightning starts the second with the same command line
        return

    configs = QUICK_CONFIGS if args.quick else tuple(CONFIGS)
    samples: dict[str, list[dict]] = {c: [] for c in configs}

    def start(config: str, base: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "benchmarks.b4_overhead", "--run", config, "--run-out", base,
               "--steps", str(args.steps), "--sync-every", str(args.sync_every)]
        # Lightning's launchers set torch's thread count to cores/N unless OMP_NUM_THREADS is set:
        # pin one thread per process so every configuration computes alike.
        env = child_env(OMP_NUM_THREADS="1")  # and no rendezvous variables: each configuration picks its own port
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=Path(__file__).parent.parent)

    # One configuration at a time; a quick run, a smoke test whose timings mean nothing, starts its
    # configurations together (they share the cores).
    batches = [configs] if args.quick else [(config,) for config in configs]
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for batch in batches:
                procs = {config: start(config, os.path.join(tmp, f"{config}-{rep}")) for config in batch}
                errors = {config: proc.communicate()[1] for config, proc in procs.items()}
                for config, proc in procs.items():
                    if proc.returncode != 0:
                        sys.exit(f"{config} failed:\n{errors[config][-4000:]}")
                    ranks = [json.load(open(os.path.join(tmp, f))) for f in sorted(os.listdir(tmp))
                             if f.startswith(f"{config}-{rep}.rank")]
                    # the slowest replica sets the pace
                    samples[config].append({k: max(r[k] for r in ranks)
                                            for k in ("inner_step_s", "all_steps_s", "peak_rss_mb")})
                    print(f"repeat {rep + 1}/{args.repeats} {config}: {samples[config][-1]}", flush=True)

    def summary(config: str, key: str) -> tuple[float, float, float]:
        values = [s[key] for s in samples[config]]
        return statistics.median(values), min(values), max(values)

    plain_inner, _, _ = summary("plain", "inner_step_s")
    plain_all, _, _ = summary("plain", "all_steps_s")
    plain_rss, _, _ = summary("plain", "peak_rss_mb")
    rows = []
    print(f"\nexample GPT on CPU, 1 thread per process, {args.steps} steps, H = {args.sync_every}, "
          f"{args.repeats} repeats (median [min, max]); ratio = plain steps/s over strategy steps/s")
    print(f"{'config':<19} {'inner step ms':>22} {'ratio':>6} {'all steps ms':>22} {'ratio':>6} {'peak MB':>8} "
          f"{'ratio':>6}")
    for config in configs:
        inner, all_ = summary(config, "inner_step_s"), summary(config, "all_steps_s")
        rss = summary(config, "peak_rss_mb")
        row = {"config": config, "inner_step_s": inner, "all_steps_s": all_, "peak_rss_mb": rss,
               "inner_ratio": inner[0] / plain_inner, "all_ratio": all_[0] / plain_all, "rss_ratio": rss[0] / plain_rss}
        rows.append(row)
        print(f"{config:<19} {inner[0] * 1e3:>7.2f} [{inner[1] * 1e3:.2f}, {inner[2] * 1e3:.2f}] "
              f"{row['inner_ratio']:>6.3f} "
              f"{all_[0] * 1e3:>7.2f} [{all_[1] * 1e3:.2f}, {all_[2] * 1e3:.2f}] {row['all_ratio']:>6.3f} "
              f"{rss[0]:>8.0f} {row['rss_ratio']:>6.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    saved = {"machine": machine(), "network": "loopback", "steps": args.steps, "sync_every": args.sync_every,
             "repeats": args.repeats, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(saved, f, indent=2)
    plot(saved, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")


if __name__ == "__main__":
    main()
