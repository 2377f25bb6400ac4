"""Runs the parts of the GPU check: one part in this process (:func:`run_part_here`), and every part
asked for, each here or in a process of its own, within the total budget on a GPU (:func:`run_parts`)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

from benchmarks.gpu_check.host_sync import part_host_sync
from benchmarks.gpu_check.isolation import run_part_isolated
from benchmarks.gpu_check.memory import part_memory
from benchmarks.gpu_check.nccl import part_nccl
from benchmarks.gpu_check.overhead import part_overhead
from benchmarks.gpu_check.settings import PARTS, TOTAL_BUDGET_S, Budget, Setting, say
from benchmarks.gpu_check.sharded import part_sharded
from benchmarks.gpu_check.two_processes import part_two_processes
from benchmarks.gpu_check.wire_codecs import part_codecs

RUNNERS: dict[int, Callable[[Setting, Budget], dict[str, Any]]] = {
    1: part_overhead, 2: part_host_sync, 3: part_memory, 4: part_two_processes, 5: part_nccl, 6: part_sharded,
    7: part_codecs,
}


def run_part_here(part: int, setting: Setting, budget: Optional[float]) -> dict[str, Any]:
    """Runs one part in this process with a budget of ``budget`` seconds (None: no budget, the dry
    run); an exception is recorded, not raised. ``skipped`` lists the runs the budget turned down."""
    started = time.perf_counter()
    limit = Budget(budget)
    try:
        result = {"status": "ran", **RUNNERS[part](setting, limit)}
    except BaseException as err:  # a failed part must not stop the others
        if isinstance(err, KeyboardInterrupt):
            raise
        result = {"status": "error", "error": f"{type(err).__name__}: {err}",
                  "traceback": traceback.format_exc()[-4000:]}
    result["skipped"] = limit.skipped
    result["seconds"] = time.perf_counter() - started
    return result


def run_parts(parts: list[int], setting: Setting, on_gpu: bool, isolate: bool) -> dict[int, dict[str, Any]]:
    """Every part of ``parts`` in turn, here or (``isolate``) each in a process of its own. On a GPU
    each part gets its budget, at most what is left of :data:`TOTAL_BUDGET_S`, and a part that would
    start with less than 15 s left is skipped; the dry run has no budgets."""
    started = time.perf_counter()
    results: dict[int, dict[str, Any]] = {}
    for part in parts:
        title, budget = PARTS[part]
        limit: Optional[float] = None
        if on_gpu:
            left = TOTAL_BUDGET_S - (time.perf_counter() - started)
            if left < 15:
                results[part] = {"status": "skipped: out of time", "seconds": 0.0}
                say(f"part {part} ({title}): skipped, {left:.0f} s left of {TOTAL_BUDGET_S:.0f}")
                continue
            limit = min(budget, left)
            say(f"part {part} ({title}): starting, budget {limit:.0f} s")
        else:
            say(f"part {part} ({title}): starting (the dry run has no time budget)")
        results[part] = run_part_isolated(part, limit) if isolate else run_part_here(part, setting, limit)
        say(f"part {part}: {results[part]['status']} in {results[part]['seconds']:.0f} s"
            + (f": {results[part].get('error')}" if results[part]["status"] != "ran" else ""))
    return results
