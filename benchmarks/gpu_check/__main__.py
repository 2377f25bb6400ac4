"""``python -m benchmarks.gpu_check``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import benchmarks.gpu_check
from benchmarks.common import results_dir, write_json
from benchmarks.gpu_check.report import print_table, rows_of
from benchmarks.gpu_check.runner import run_part_here, run_parts
from benchmarks.gpu_check.settings import DRY, GPU, PARTS, say


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=benchmarks.gpu_check.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--parts", type=int, nargs="+", default=sorted(PARTS), choices=sorted(PARTS))
    parser.add_argument("--out", help="default: gpu_check.json in benchmarks/results (dry run: a temporary folder)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the parts in this process (default without CUDA; with CUDA each part gets a process)")
    parser.add_argument("--isolate", action="store_true",
                        help="run each part in a process of its own, also without CUDA")
    parser.add_argument("--part", type=int, help=argparse.SUPPRESS)  # internal: one part, in a child process
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    on_gpu = torch.cuda.is_available()
    setting = GPU if on_gpu else DRY
    if not on_gpu:
        # One thread: a tiny model gains nothing from more. OMP_NUM_THREADS keeps Lightning's DDP-based
        # strategies from raising it to cores/processes (the plain Trainer would keep one: unfair).
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)  # its tiny AdamW moments turn subnormal, which is slow on CPUs
    if args.part:
        budget = (args.budget or PARTS[args.part][1]) if on_gpu else None  # the dry run has no budgets
        result = run_part_here(args.part, setting, budget)
        Path(args.part_out).write_text(json.dumps(result))
        return 0

    device = torch.cuda.get_device_name(0) if on_gpu else "no CUDA device: CPU dry run"
    say(f"GPU check on {device}; torch {torch.__version__}; parts {args.parts}")
    isolate = args.isolate or (on_gpu and not args.in_process)
    started = time.perf_counter()
    parts = run_parts(args.parts, setting, on_gpu, isolate)

    rows = rows_of(parts, on_gpu)
    print_table(rows)
    out = Path(args.out) if args.out else results_dir(quick=not on_gpu) / "gpu_check.json"
    payload = {"device": device, "cuda": on_gpu, "torch": torch.__version__, "setting": asdict(setting),
               "seconds": time.perf_counter() - started, "parts": {str(k): v for k, v in parts.items()}, "rows": rows}
    path = write_json(out.name, payload, out.parent)
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")
    if not on_gpu:
        print("This was a CPU dry run: it did not run on a GPU (no CUDA device). Its numbers say nothing about GPUs.")
    return 1 if any(row["status"] == "FAILED" for row in rows) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no final garbage collection over torch's objects, no wait for lingering threads
