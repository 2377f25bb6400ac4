"""``python -m benchmarks.b5_convergence``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Optional

import benchmarks.b5_convergence
from benchmarks.b5_convergence.analysis import report
from benchmarks.b5_convergence.bytes_part import bytes_jobs, bytes_report, paper_bytes_jobs
from benchmarks.b5_convergence.fidelity import (
    LONG,
    LONG_QUICK,
    forms_best_jobs,
    forms_jobs,
    forms_report,
    long_jobs,
    long_report,
)
from benchmarks.b5_convergence.grid import DEFAULT_PARTS, FULL, PARTS, QUICK, Job, Settings, best_tuning_jobs, jobs_for
from benchmarks.b5_convergence.protocol import (
    PAPER,
    PAPER_QUICK,
    SCALE,
    SCALE_QUICK,
    paper_jobs,
    paper_report,
    scale_jobs,
    scale_report,
)
from benchmarks.b5_convergence.runs import lightning_run, processes_part, run_job
from benchmarks.common import machine, pool_context, results_dir


def run_all(pool: Any, jobs: list[Job], settings: Settings, runs_dir: Path, started: float) -> None:
    futures = [pool.submit(run_job, j, settings, str(runs_dir / f"{j.name}.json"), 1) for j in jobs]
    for k, future in enumerate(futures):
        record = future.result()
        print(f"[{k + 1}/{len(jobs)} {time.perf_counter() - started:6.0f} s] {record['name']}: consensus "
              f"{record['final']['consensus']:.3f} (plain outer end {record['final']['outer_consensus']:.3f}), "
              f"mean replica {record['final']['mean_replica']:.3f} ({record['seconds']:.0f} s)", flush=True)


FIDELITY_PARTS = ("forms", "long", "paper", "scale", "bytes")


def fidelity_parts(parts: list[str], quick: bool, workers: int, folder: Path, runs_dir: Path, started: float,
                   seeds: Optional[list[int]] = None) -> None:
    """The ``forms`` and ``long`` parts (:mod:`.fidelity`), the ``paper`` and ``scale`` parts (:mod:`.protocol`) and
    the ``bytes`` part (:mod:`.bytes_part`, the long part's settings), each with its own summary."""
    forms_settings, long_settings = (QUICK, LONG_QUICK) if quick else (FULL, LONG)

    def missing(jobs: list[Job]) -> list[Job]:
        return [j for j in jobs if not (runs_dir / f"{j.name}.json").exists()]

    with ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
        if "forms" in parts:
            todo = missing(forms_jobs(forms_settings, quick))
            print(f"B5 forms on {machine()}: {len(todo)} runs to do, {workers} at a time", flush=True)
            run_all(pool, todo, forms_settings, runs_dir, started)
            run_all(pool, missing(forms_best_jobs(runs_dir, quick)), forms_settings, runs_dir, started)
            forms_report(folder, runs_dir, forms_settings, quick)
        if "long" in parts:
            todo = missing(long_jobs(long_settings, quick, seeds))
            print(f"B5 long on {machine()}: {len(todo)} runs to do, {workers} at a time", flush=True)
            run_all(pool, todo, long_settings, runs_dir, started)
            long_report(folder, runs_dir, long_settings, quick)
        for part, (settings, jobs_of, report_of) in (("paper", ((PAPER_QUICK if quick else PAPER), paper_jobs,
                                                                  paper_report)),
                                                       ("scale", ((SCALE_QUICK if quick else SCALE), scale_jobs,
                                                                  scale_report))):
            if part in parts:
                todo = missing(jobs_of(settings, quick))
                print(f"B5 {part} on {machine()}: {len(todo)} runs to do, {workers} at a time", flush=True)
                run_all(pool, todo, settings, runs_dir, started)
                report_of(folder, runs_dir, settings, quick)
        # after the paper part: its float32 runs are the paper-protocol formats' baseline
        if "bytes" in parts:
            todo = missing(bytes_jobs(long_settings, quick))
            paper_settings = PAPER_QUICK if quick else PAPER
            protocol = missing(paper_bytes_jobs(paper_settings, quick))
            print(f"B5 bytes on {machine()}: {len(todo) + len(protocol)} runs to do, {workers} at a time", flush=True)
            run_all(pool, todo, long_settings, runs_dir, started)
            run_all(pool, protocol, paper_settings, runs_dir, started)
            bytes_report(folder, runs_dir, long_settings, quick)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.b5_convergence", description=benchmarks.b5_convergence.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a small model and grid: a smoke run of every part")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel, one thread each (default 2)")
    parser.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS), choices=PARTS + FIDELITY_PARTS,
                        help=f"default: {' '.join(DEFAULT_PARTS)} (--quick: {' '.join(PARTS)}); "
                        f"{' and '.join(FIDELITY_PARTS)} write their own summaries")
    parser.add_argument("--fresh", action="store_true", help="forget finished runs and start over")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="the long part: only these seeds of its default methods (more seeds later, or alongside)")
    parser.add_argument("--lightning-run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lightning_run:
        lightning_run(json.loads(args.lightning_run))
        return
    settings = QUICK if args.quick else FULL
    if args.quick and args.parts == list(DEFAULT_PARTS):
        args.parts = list(PARTS)
    folder = results_dir(args.quick)
    runs_dir = folder / ("b5_runs_quick" if args.quick else "b5_runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        for p in runs_dir.glob("*.json"):
            p.unlink()
    started = time.perf_counter()
    fidelity = [p for p in args.parts if p in FIDELITY_PARTS]
    if fidelity:
        fidelity_parts(fidelity, args.quick, args.workers, folder, runs_dir, started, args.seeds)
        if len(fidelity) == len(args.parts):
            print(f"B5 took {time.perf_counter() - started:.0f} s")
            return
    todo = [j for j in jobs_for(settings, args.quick)
            if j.part in args.parts and not (runs_dir / f"{j.name}.json").exists()]
    print(f"B5 on {machine()}: {len(todo)} runs to do, {args.workers} at a time", flush=True)
    with ProcessPoolExecutor(args.workers, mp_context=pool_context()) as pool:
        run_all(pool, todo, settings, runs_dir, started)
        if "tuning" in args.parts:
            extra = [j for j in best_tuning_jobs(runs_dir, settings, args.quick)
                     if not (runs_dir / f"{j.name}.json").exists()]
            run_all(pool, extra, settings, runs_dir, started)
    process_rows: list[dict[str, Any]] = []
    process_file = runs_dir / "processes.json"
    if process_file.exists() and not args.fresh:  # kept from an earlier run of this part
        process_rows = json.loads(process_file.read_text())
    elif "processes" in args.parts:
        process_rows = processes_part(settings, args.quick, runs_dir)
        process_file.write_text(json.dumps(process_rows))
    report(folder, runs_dir, settings, args.quick, process_rows)
    print(f"B5 took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
