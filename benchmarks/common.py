"""Helpers shared by the benchmark scripts: where results go, what machine ran them, tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parent.parent
# LOCO_BENCH_RESULTS redirects the output (the tests' smoke runs use it to keep the committed results).
RESULTS = Path(os.environ.get("LOCO_BENCH_RESULTS", ROOT / "benchmarks" / "results"))


def machine() -> str:
    return f"{os.cpu_count()} CPUs ({platform.machine()}), {platform.system()}"


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
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
