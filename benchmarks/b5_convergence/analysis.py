"""B5's analysis: the runs' records summarised per configuration over seeds, the verdicts in
sentences, the wire formats against float32, and the report (tables, JSON, PNGs)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.b5_convergence.grid import H1_METHODS, MAIN_METHODS, PARTS, Settings, fragment_settings
from benchmarks.b5_convergence.plots import codec_plot, plots
from benchmarks.common import table, write_json


def mean_spread(values: list[float]) -> dict[str, float]:
    """Mean and half the range over seeds (the spread we compare differences with)."""
    return {"mean": statistics.mean(values), "half_range": (max(values) - min(values)) / 2, "n": len(values)}


def correlation(xs: list[float], ys: list[float]) -> float | None:
    """Pearson's r; ``None`` when either series is flat (a spread that is zero up to float noise, as
    for DDP, or DiLoCo right after its all-reduce)."""
    if len(xs) < 3 or max(map(abs, xs)) < 1e-4 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        method = r["method"] if r["part"] != "codecs" else f"{r['method']}:{r.get('wire', 'float32')}"
        groups.setdefault((r["part"], r["replicas"], r["split"], r["sync_every"], method), []).append(r)
    rows = []
    ordered = sorted(groups.items(), key=lambda kv: (*kv[0][:4], MAIN_ORDER.get(kv[0][4], 99)))
    for (part, n, split, h, method), runs in ordered:
        spread_lr = [correlation([p["spread"] for p in r["curve"][1:]], [p["lr"] for p in r["curve"][1:]])
                     for r in runs]
        peer_lr = [correlation([p["peer_distance"] for p in r["peer_distance"]], [p["lr"] for p in r["peer_distance"]])
                   for r in runs]
        rows.append({
            "part": part, "replicas": n, "split": split, "H": h, "method": method, "seeds": len(runs),
            "mean_replica": mean_spread([r["final"]["mean_replica"] for r in runs]),
            "consensus": mean_spread([r["final"]["consensus"] for r in runs]),
            "outer_consensus": mean_spread([r["final"]["outer_consensus"] for r in runs]),
            "outer_mean_replica": mean_spread([r["final"]["outer_mean_replica"] for r in runs]),
            "spread": statistics.mean(r["final"]["spread"] for r in runs),
            "mbytes_per_replica": statistics.mean(r["final"]["bytes_per_replica"] for r in runs) / 1e6,
            "corr_spread_lr": _mean_or_none(spread_lr), "corr_peer_distance_lr": _mean_or_none(peer_lr),
            "seconds": statistics.mean(r["seconds"] for r in runs),
            "compression_error_ratio": _mean_or_none([r.get("compression_error_ratio") for r in runs]),
        })
    return rows


MAIN_ORDER = {m: k for k, m in enumerate((*MAIN_METHODS, *H1_METHODS))}


def _mean_or_none(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.mean(kept) if kept else None


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """What the grid settles, in sentences: each communicating method against independent replicas
    and DDP, NoLoCo against DiLoCo, GASLoC against gossip at H = 1."""
    lines = []
    index = {(r["part"], r["replicas"], r["split"], r["H"], r["method"]): r for r in rows}
    for (part, n, split, h, method), r in sorted(index.items()):
        if part != "main" or method in ("independent", "ddp"):
            continue
        indep, ddp = index.get((part, n, split, h, "independent")), index.get((part, n, split, h, "ddp"))
        for key in ("consensus", "mean_replica"):
            if indep is None or ddp is None:
                continue
            gain = indep[key]["mean"] - r[key]["mean"]
            noise = indep[key]["half_range"] + r[key]["half_range"]
            verdict = "beats" if gain > noise else ("loses to" if -gain > noise else "ties")
            lines.append(
                f"N={n} {split} {method} ({key}): {verdict} independent by {gain:+.3f} "
                f"(seed half-ranges sum {noise:.3f}); trails DDP by {r[key]['mean'] - ddp[key]['mean']:+.3f} "
                f"({100 * (r[key]['mean'] / ddp[key]['mean'] - 1):+.1f} %)"
            )
    for (part, n, split, h, method), r in sorted(index.items()):
        if method == "noloco" and (part, n, split, h, "diloco") in index:
            d = index[(part, n, split, h, "diloco")]
            for key in ("consensus", "mean_replica"):
                rel = 100 * (r[key]["mean"] / d[key]["mean"] - 1)
                lines.append(f"{part} N={n} {split} H={h}: NoLoCo vs DiLoCo ({key}) {rel:+.2f} % "
                             f"({'within 1 % or better' if rel <= 1 else 'worse by more than 1 %'})")
        if part == "h1" and method.startswith("gasloc"):
            g = index.get((part, n, split, h, "gossip_ring" if "ring" in method else "gossip_pairs"))
            if g is not None:
                for key in ("consensus", "mean_replica"):
                    diff = g[key]["mean"] - r[key]["mean"]
                    noise = g[key]["half_range"] + r[key]["half_range"]
                    verdict = "beats" if diff > noise else ("loses to" if -diff > noise else "ties")
                    lines.append(f"H=1 N={n} {method} ({key}): {verdict} plain gossip by {diff:+.3f} "
                                 f"(noise {noise:.3f})")
    return lines


def codec_rows(rows: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The codecs part against float32, per method: the final losses, bytes, and the verdicts on the
    targets (bfloat16 within the seed spread, int8 within 1 %). ``paired``: the difference to float32
    run by run at the same seed (same start and data), mean and half its range over seeds."""
    final = {(r["method"], r.get("wire"), r["seed"]): r["final"]["consensus"] for r in records if r["part"] == "codecs"}
    out = []
    index = {r["method"]: r for r in rows if r["part"] == "codecs"}
    for key, r in index.items():
        method, wire = key.split(":")
        base = index.get(f"{method}:float32")
        if base is None:
            continue
        row = {"method": method, "wire": wire, "seeds": r["seeds"],
               "consensus": r["consensus"]["mean"], "pm": r["consensus"]["half_range"],
               "replica": r["mean_replica"]["mean"], "mbytes": r["mbytes_per_replica"],
               "bytes_ratio": r["mbytes_per_replica"] / base["mbytes_per_replica"],
               "error_ratio": r.get("compression_error_ratio"),
               "delta": r["consensus"]["mean"] - base["consensus"]["mean"],
               "delta_pct": 100 * (r["consensus"]["mean"] / base["consensus"]["mean"] - 1),
               "noise": r["consensus"]["half_range"] + base["consensus"]["half_range"]}
        paired = [final[(method, wire, seed)] - final[(method, "float32", seed)]
                  for (m, w, seed) in final if m == method and w == wire and (method, "float32", seed) in final]
        row["paired"] = statistics.mean(paired) if paired else None
        row["paired_pm"] = (max(paired) - min(paired)) / 2 if paired else None
        row["within_spread"] = abs(row["delta"]) <= row["noise"]
        row["within_1pct"] = row["delta_pct"] <= 1.0
        out.append(row)
    return out


def fragment_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fragments part per method and F, against F = 1 of the same method: the final losses (mean
    and half the range over seeds), the difference to F = 1 (``within_spread``: no larger than the two
    seed half-ranges together; ``paired``: run by run at the same seed), the replicas' spread (its
    mean over every step, and at the end, after every fragment's final round), bytes per replica and
    the largest exchange."""
    runs = [r for r in records if r["part"] == "fragments"]
    final = {(r["method"], r["fragments"], r["seed"]): r["final"]["consensus"] for r in runs}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["fragments"]), []).append(r)
    out = []
    for (method, f), group in sorted(groups.items(), key=lambda kv: (MAIN_ORDER.get(kv[0][0], 99), kv[0][1])):
        consensus = mean_spread([r["final"]["consensus"] for r in group])
        row = {"method": method, "F": f, "H": group[0]["sync_every"], "replicas": group[0]["replicas"],
               "seeds": len(group), "consensus": consensus["mean"], "pm": consensus["half_range"],
               "replica": statistics.mean(r["final"]["mean_replica"] for r in group),
               "mean_spread": statistics.mean(r["mean_spread"] for r in group),
               "final_spread": statistics.mean(r["final"]["spread"] for r in group),
               "mbytes": statistics.mean(r["final"]["bytes_per_replica"] for r in group) / 1e6,
               "peak_mbytes": statistics.mean(r["peak_bytes"] for r in group) / 1e6,
               "seconds": statistics.mean(r["seconds"] for r in group)}
        base = groups.get((method, 1))
        if base is not None:
            base_consensus = mean_spread([r["final"]["consensus"] for r in base])
            row["delta"] = row["consensus"] - base_consensus["mean"]
            row["noise"] = row["pm"] + base_consensus["half_range"]
            row["within_spread"] = abs(row["delta"]) <= row["noise"]
            paired = [final[(method, f, r["seed"])] - final[(method, 1, r["seed"])] for r in group
                      if (method, 1, r["seed"]) in final]
            row["paired"] = statistics.mean(paired) if paired else None
            row["paired_pm"] = (max(paired) - min(paired)) / 2 if paired else None
            row["spread_ratio"] = row["mean_spread"] / statistics.mean(r["mean_spread"] for r in base)
        out.append(row)
    return out


def report(folder: Path, runs_dir: Path, settings: Settings, quick: bool, process_rows: list[dict[str, Any]]) -> None:
    records = [json.loads(p.read_text()) for part in PARTS[:-1] for p in sorted(runs_dir.glob(f"{part}-*.json"))]
    rows = summarise([r for r in records if r["part"] != "fragments"])
    flat = [{**r, "consensus_mean": r["consensus"]["mean"], "consensus_pm": r["consensus"]["half_range"],
             "replica_mean": r["mean_replica"]["mean"], "replica_pm": r["mean_replica"]["half_range"],
             "outer_consensus_mean": r["outer_consensus"]["mean"]} for r in rows]
    print(table(flat, [
        ("part", "part", "s"), ("replicas", "N", "d"), ("split", "split", "s"), ("H", "H", "d"),
        ("method", "method", "s"),
        ("seeds", "seeds", "d"), ("consensus_mean", "consensus", ".3f"), ("consensus_pm", "±", ".3f"),
        ("replica_mean", "mean replica", ".3f"), ("replica_pm", "±", ".3f"),
        ("outer_consensus_mean", "consensus (plain outer end)", ".3f"), ("spread", "spread", ".3f"),
        ("mbytes_per_replica", "MB/replica", ".1f"), ("corr_spread_lr", "r(spread,lr)", ".2f"),
        ("corr_peer_distance_lr", "r(peer,lr)", ".2f"), ("seconds", "s/run", ".0f"),
    ]))
    lines = verdicts(rows)
    print("\n".join(lines))
    if process_rows:
        print(table(process_rows, [
            ("method", "method", "s"), ("replicas", "N", "d"),
            ("processes_consensus", "processes: consensus", ".3f"),
            ("simulator_consensus", "simulator: consensus", ".3f"),
            ("processes_mean_replica", "processes: replica", ".3f"),
            ("simulator_mean_replica", "simulator: replica", ".3f"),
            ("processes_s_per_step", "processes s/step", ".3f"), ("simulator_s_per_step", "simulator s/step", ".3f"),
            ("time_ratio", "processes/simulator", ".2f"),
        ]))
    codecs = codec_rows(rows, records)
    if codecs:
        print(table(codecs, [
            ("method", "method", "s"), ("wire", "wire", "s"), ("seeds", "seeds", "d"),
            ("consensus", "consensus", ".3f"), ("pm", "±", ".3f"), ("replica", "mean replica", ".3f"),
            ("mbytes", "MB/replica", ".2f"), ("bytes_ratio", "bytes/float32", ".3f"),
            ("error_ratio", "‖D(Q(x))−x‖/‖θ−φ‖", ".3f"),
            ("delta_pct", "Δ vs float32 %", "+.2f"), ("noise", "seed half-ranges", ".3f"),
            ("paired", "paired Δ", "+.4f"), ("paired_pm", "±", ".4f"),
            ("within_spread", "within spread", ""), ("within_1pct", "within 1 %", ""),
        ]))
    streaming = fragment_rows(records)
    if streaming:
        print(table(streaming, [
            ("method", "method", "s"), ("F", "F", "d"), ("H", "H", "d"), ("seeds", "seeds", "d"),
            ("consensus", "consensus", ".3f"), ("pm", "±", ".3f"), ("replica", "mean replica", ".3f"),
            ("delta", "Δ vs F=1", "+.3f"), ("noise", "seed half-ranges", ".3f"),
            ("within_spread", "within spread", ""),
            ("paired", "paired Δ", "+.3f"), ("paired_pm", "±", ".3f"),
            ("mean_spread", "spread (mean)", ".3f"), ("spread_ratio", "spread/F=1", ".2f"),
            ("final_spread", "spread (end)", ".3f"), ("mbytes", "MB/replica", ".1f"),
            ("peak_mbytes", "peak MB/exchange", ".3f"), ("seconds", "s/run", ".0f"),
        ]))
    pngs = plots(records, folder, quick) + codec_plot(records, folder)
    write_json("b5_convergence.json", {
        "settings": asdict(settings), "quick": quick, "rows": rows, "verdicts": lines, "codecs": codecs,
        "fragments": streaming, "processes": process_rows,
        "plots": pngs, "runs": len(records),
        # per run: the measuring points (the full records, with per-replica losses and every round's
        # peer distance, stay in the runs folder)
        "curves": {r["name"]: [{k: round(v, 5) for k, v in p.items() if k != "replicas"} for p in r["curve"]]
                   for r in records},
    }, folder)
    if streaming:  # the part's own file, with its runs' curves (and the replicas' losses at the end)
        runs = [r for r in records if r["part"] == "fragments"]
        write_json("b5_fragments.json", {
            "settings": asdict(fragment_settings(settings)), "quick": quick, "rows": streaming,
            "runs": {r["name"]: {"final": r["final"], "mean_spread": r["mean_spread"], "peak_bytes": r["peak_bytes"],
                                 "curve": [{k: round(v, 5) for k, v in p.items() if k != "replicas"}
                                           for p in r["curve"]]}
                     for r in runs},
        }, folder)
    print(f"wrote {folder / 'b5_convergence.json'} and {', '.join(pngs)}")
