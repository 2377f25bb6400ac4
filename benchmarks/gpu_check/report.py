"""The GPU check's table: one row per check (part, check, result, target, status) from the parts'
results, printed at the end and kept in the JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from benchmarks.common import table
from benchmarks.gpu_check.settings import PARTS

COLUMNS = [("part", "part", "s"), ("check", "check", "s"), ("result", "result", "s"), ("target", "target", "s"),
           ("status", "status", "s")]
Add = Callable[..., None]


def fmt(value: Optional[float], spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def rows_of(parts: dict[int, dict[str, Any]], on_gpu: bool) -> list[dict[str, str]]:
    """One table: part, what was checked, the result, the target, and whether it was met ("ok",
    "MISSED", "-" where there is no target or it does not apply, "FAILED" for a run that failed,
    "SKIPPED" for a run that the part's time budget turned down)."""
    rows: list[dict[str, str]] = []

    def add(part: int, check: str, result: str, target: str = "", ok: Optional[bool] = None, failed: bool = False,
            skipped: bool = False) -> None:
        status = "FAILED" if failed else "SKIPPED" if skipped else "-" if ok is None else ("ok" if ok else "MISSED")
        rows.append({"part": str(part), "check": check, "result": result, "target": target, "status": status})

    for part, res in parts.items():
        if res.get("status") != "ran":
            add(part, PARTS[part][0], (res.get("error") or res.get("status", "?"))[:90], failed=True)
            continue
        for config, error in res.get("errors", {}).items():
            add(part, f"{config} failed", error[:90], failed=True)
        for what in res.get("skipped", []):
            add(part, f"{what} skipped", "out of the part's time budget", skipped=True)
        PART_ROWS[part](res, on_gpu, add)
    return rows


def print_table(rows: list[dict[str, str]]) -> None:
    print()
    print(table(rows, COLUMNS))


def _overhead(res: dict[str, Any], on_gpu: bool, add: Add) -> None:
    for config, row in res["configs"].items():
        if config == "plain":
            add(1, "plain tokens/s", fmt(row["tokens_per_s"]["median"], ".0f"))
            continue
        if "ratio" not in row:
            continue  # plain failed in some repeat: no ratio
        spread = row["ratio_per_repeat"]
        add(1, f"{config} tokens/s over plain (H={res['sync_every']})",
            f"{row['ratio']:.3f} [{spread['min']:.3f}, {spread['max']:.3f}]", ">= 0.98",
            row["ratio"] >= 0.98 if on_gpu else None)
        if "outer_step_cost_s" in row:
            add(1, f"{config} cost per outer step (ms)", fmt(row["outer_step_cost_s"]["median"] * 1e3, ".1f"))


def _host_sync(res: dict[str, Any], on_gpu: bool, add: Add) -> None:
    plain = res["configs"].get("plain", {})
    for config, row in res["configs"].items():
        key = "cuda_syncs_per_inner_step" if on_gpu else "host_reads_per_inner_step"
        what = "CUDA syncs" if on_gpu else "host reads"
        if config == "plain":
            add(2, f"plain: {what} per inner step", fmt(row[key], ".2f"))
            continue
        caused = None if row[key] is None or plain.get(key) is None else row[key] - plain[key]
        target_met = caused is not None and caused <= 0 and row["hook_host_reads_per_inner_step"] == 0
        add(2, f"{config}: {what} per inner step over plain; in our hooks",
            f"{fmt(caused, '+.2f')}; {fmt(row['hook_host_reads_per_inner_step'], '.0f')}", "0; 0",
            target_met if "monitor" not in config else None)


def _memory(res: dict[str, Any], on_gpu: bool, add: Add) -> None:
    for config, row in res["configs"].items():
        if config == "plain":
            peak = row["peak_bytes"]
            add(3, "plain peak GPU memory (MiB)", fmt(None if peak is None else peak / 2**20, ".0f"))
            continue
        copies = row.get("extra_float32_copies")
        limit = 0 if "cpu-state" in config else 2
        add(3, f"{config}: extra float32 copies on the GPU", fmt(copies, ".2f"), f"<= {limit}",
            None if copies is None else copies <= limit + 0.25)


def _two_processes(res: dict[str, Any], on_gpu: bool, add: Add) -> None:
    """On a GPU the replicas must also have trained (their losses fell over 60 steps); the dry run's
    few steps of a tiny model say nothing about its loss, so there the loss is shown, not judged."""
    for config, row in res["configs"].items():
        if row["errors"]:
            add(4, config, "; ".join(row["errors"])[:90], failed=True)
            continue
        add(4, f"{config}: outer step ms [min, max]",
            f"{row['outer_step_s']['median'] * 1e3:.1f} [{row['outer_step_s']['min'] * 1e3:.1f}, "
            f"{row['outer_step_s']['max'] * 1e3:.1f}]")
        add(4, f"{config}: rounds started, landed per rank (at the expected steps)",
            f"{row['rounds_started_per_rank']}, {row['rounds_per_rank']} ({row['rounds_as_expected']})",
            f"{row['rounds_expected']} each (True)", row["rounds_as_expected"])
        if on_gpu:
            add(4, f"{config}: trained, replicas agree, staging reused (pinned={row['staging_pinned']})",
                f"{row['trained']}, {row['replicas_agree']}, {row['staging_reused']}", "True x3",
                row["trained"] and row["replicas_agree"] and row["staging_reused"])
            continue
        add(4, f"{config}: weights moved, replicas agree bitwise, staging reused (pinned={row['staging_pinned']})",
            f"{row['weights_moved']}, {row['replicas_agree']}, {row['staging_reused']}", "True x3",
            row["weights_moved"] and row["replicas_agree"] and row["staging_reused"])
        add(4, f"{config}: losses fell (not judged in the dry run)", f"{row['trained']}")


def _nccl(res: dict[str, Any], on_gpu: bool, add: Add) -> None:
    for name, run in res["runs"].items():
        expected_event = on_gpu and "overlap" in name
        add(5, f"{name} on {res['backend']}: rounds; CUDA-event completion",
            f"{run['rounds']}; {run['event_completion']}", f"3; {expected_event}",
            run["rounds"] == 3 and run["event_completion"] == expected_event)
    t = res.get("transport") or {}
    add(5, f"transport all-reduce on {res['backend']}: equal; event; new threads",
        f"{t.get('bitwise_equal')}; {t.get('event_completion')}; {t.get('new_threads')}",
        f"True; {on_gpu}; 0", t.get("bitwise_equal") is True and t.get("event_completion") == on_gpu
        and (t.get("new_threads") == 0 or not on_gpu))


def _sharded(res: dict[str, Any], on_gpu: bool, add: Add) -> None:
    for row in res["rows"]:  # each a check that holds on the CPU too: judged in the dry run as well
        add(6, row["check"], row["result"], "holds", row["ok"] == "ok")
    if on_gpu:
        for name in ("diloco", "noloco"):
            if f"{name}_peak_cuda_gb" in res:
                add(6, f"{name}: peak CUDA memory (GB)", fmt(res[f"{name}_peak_cuda_gb"], ".2f"))


def _codecs(res: dict[str, Any], on_gpu: bool, add: Add) -> None:
    """The bytes must match the CPU codec's everywhere; the speed target (encode and decode within 2x
    the copy's time) is judged on a GPU only."""
    for name, equal in res["bytes_equal_cpu"].items():
        decoded = res["decoded_equal_cpu"][name]
        add(7, f"{name}: encoded bytes, decoded floats equal the CPU codec's", f"{equal}, {decoded}", "True x2",
            equal and decoded)
    for row in res["rows"]:
        gbps, times = row["gbps"]["median"], row["x_copy"]["median"]
        if row["op"] == "copy":
            add(7, f"copy ({row['variant']}) GB/s at n = {res['n']:.0e}", f"{gbps:.1f}")
            continue
        judged = row["op"] in ("encode", "decode") and row["codec"] in ("int8", "bfloat16")
        add(7, f"{row['op']} {row['codec']}: GB/s, time over the copy's", f"{gbps:.1f}, {times:.2f}x",
            "<= 2x" if judged else "", (times <= 2.0) if judged and on_gpu else None)


PART_ROWS: dict[int, Callable[[dict[str, Any], bool, Add], None]] = {
    1: _overhead, 2: _host_sync, 3: _memory, 4: _two_processes, 5: _nccl, 6: _sharded, 7: _codecs,
}
