"""One part of the GPU check in a process of its own, with a hard time limit: a CUDA or NCCL failure
can take its process down, and the other parts go on. On a GPU the limit is the part's budget plus
:data:`GRACE_S`; in the dry run, which has no budgets, it is :data:`DRY_PART_HANG_S`, which only a
hang reaches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import ROOT
from benchmarks.gpu_check.settings import DRY_PART_HANG_S, GRACE_S, START_S


def run_part_isolated(part: int, budget: Optional[float]) -> dict[str, Any]:
    """Runs one part in a child process (``python -m benchmarks.gpu_check --part N``) and returns its
    result. ``budget``: the part's seconds on a GPU, None in the dry run. The child gets a session of
    its own, so that stopping it stops the workers it started too."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result_file, log_file = os.path.join(tmp, "part.json"), os.path.join(tmp, "stderr.txt")
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--part", str(part), "--part-out", result_file]
        if budget is not None:
            cmd += ["--budget", str(max(budget - START_S, 5.0))]
            limit = budget + GRACE_S
            why = f"ran past its budget of {budget:.0f} s (+{GRACE_S:.0f} s) and was stopped"
        else:
            limit = DRY_PART_HANG_S
            why = (f"did not finish within the dry run's hang limit of {DRY_PART_HANG_S:.0f} s and was stopped "
                   "(the dry run has no time budget: a hang)")
        with open(log_file, "w") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=limit)
                stopped = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                stopped = True
        stderr = Path(log_file).read_text(errors="replace")[-1500:]
        if stopped:
            result = {"status": "error", "error": why, "stderr": stderr}
        elif os.path.exists(result_file):
            result = json.loads(Path(result_file).read_text())
        else:
            result = {"status": "error", "error": f"its process exited with {proc.returncode} and no result",
                      "stderr": stderr}
    result["seconds"] = time.perf_counter() - started
    return result
