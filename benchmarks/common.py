"""Helpers shared by the benchmark scripts: where results go, what machine ran them, tables, and how their
helper processes start.

With ``LOCO_BENCH_FORK_WORKERS=1`` (the test suite's smoke runs set it) a benchmark's helper processes on this
machine (``python -m`` runs, a pool's workers, loopback or modelled-network workers) are children forked from the
benchmark's process instead of new interpreters: the same runs, without the seconds each new interpreter spends
importing torch and Lightning on a 2-core machine. Measured runs keep new interpreters (the variable unset), and
so does a process where torchft's runtime runs (a forked child of it crashed: see :func:`forking`).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).parent.parent
# LOCO_BENCH_RESULTS redirects the output (the tests' smoke runs use it to keep the committed results).
RESULTS = Path(os.environ.get("LOCO_BENCH_RESULTS", ROOT / "benchmarks" / "results"))


FORK_ENV = "LOCO_BENCH_FORK_WORKERS"


def forking() -> bool:
    """Whether helper processes are forked from this one (see the module docstring): not where this process
    runs threads a forked child could not do without (``lightning_loco.testing.fork_safety.fork_hazards``)."""
    if os.environ.get(FORK_ENV) != "1":
        return False
    from lightning_loco.testing.fork_safety import fork_hazards

    return not fork_hazards()


def pool_context() -> Any:
    """The multiprocessing context of a benchmark's process pool: "spawn" (fresh workers), "fork" when forking."""
    return get_context("fork" if forking() else "spawn")


def run_python(args: Sequence[str], env: Optional[dict[str, str]] = None, timeout: Optional[float] = None,
               cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python *args`` (``-m module ...`` or ``script.py ...``) to its end, its output captured: a new
    interpreter, or when forking a child of this process that runs the same module or script."""
    if not forking():
        return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, check=False)
    import runpy

    from lightning_loco.testing.launch import finish_forked, fork_call, module_runner

    args = list(args)
    if args[0] == "-m":
        run = module_runner(args[1], args[2:], cwd)
    else:
        def run() -> None:
            os.chdir(cwd)
            sys.argv = args
            try:
                runpy.run_path(args[0], run_name="__main__")
            except SystemExit as stop:
                if stop.code not in (None, 0):
                    raise
    with tempfile.TemporaryDirectory() as out:
        streams = {1: Path(out) / "stdout.txt", 2: Path(out) / "stderr.txt"}
        added = {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}
        pid = fork_call(run, streams, added)
        return finish_forked(pid, streams, timeout if timeout is not None else 3600.0, [sys.executable, *args])


def results_dir(quick: bool) -> Path:
    """Where a run writes: ``RESULTS``, except that a ``--quick`` run never replaces the published
    results; without LOCO_BENCH_RESULTS it writes to a folder of the system's temporary directory."""
    if quick and "LOCO_BENCH_RESULTS" not in os.environ:
        return Path(tempfile.gettempdir()) / "lightning_loco_quick_results"
    return RESULTS


def machine() -> str:
    return f"{os.cpu_count()} CPUs ({platform.machine()}), {platform.system()}"


def load_average() -> str:
    """``uptime``'s line (the load averages): what else the machine was running, for a timed run's results."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load averages (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def skip_final_collection() -> None:
    """For a worker process about to exit: exempt every live object from the interpreter's final
    garbage collection, which would otherwise walk all of torch's and Lightning's objects (about
    0.7 s of CPU a process). Nothing else changes: exit handlers run and open files are flushed."""
    gc.freeze()


def wait_for_files(paths: Sequence[Path], timeout_s: float = 120.0) -> list[Path]:
    """Waits until every path exists or ``timeout_s`` passed; returns the ones still missing. Lightning's popen
    launcher returns with rank 0, and the other ranks end on their own (nothing global at the end of fit), so a
    rank may still be writing what it measured when rank 0's process has exited: write to a temporary name and
    rename, and wait here."""
    deadline = time.monotonic() + timeout_s
    while not all(Path(p).exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [Path(p) for p in paths if not Path(p).exists()]


def write_json(name: str, payload: dict[str, Any], folder: Path = RESULTS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median with min and max: the benchmarks' summary of repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format) triples."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else format(row[k], f)) for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def grouped_bars(
    path: Path,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str,
    title: str,
    size: tuple[float, float] = (8, 3.8),
    reference: float | None = None,
) -> None:
    """A PNG of grouped bars: one group per x label, one bar per series in every group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    width = 0.8 / len(series)
    for j, (label, values) in enumerate(series.items()):
        offset = (j - (len(series) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(groups))], list(values), width, label=label)
    if reference is not None:
        ax.axhline(reference, color="grey", lw=0.8)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
