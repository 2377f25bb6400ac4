"""B5's protocol parts: the NoLoCo paper's own comparison (``paper``) and how the gap moves with scale (``scale``).

``paper`` (N = 8): NoLoCo as the paper runs it (H = 50, groups of 2, β = 0.7, α = 0.5) against DiLoCo as the
authors' code configures it for the same table (``DILOCO_CODE``: H = 100, heavy-ball outer momentum 0.3, lr
0.7), both with the authors' inner optimizer (torch's Adam, no weight decay, warm-up over 4 % of the run, then
cosine to lr/10; gradient clipping 1.0), on iid and on non-iid shards, 3 seeds each; then DiLoCo with its own
paper's settings (H = 50, Nesterov 0.9) and GASLoC (random pairs, defaults) at H = 50 on iid shards. 3,000
inner steps: 60 of NoLoCo's outer steps, 30 of the code's DiLoCo. Measured every 300 steps (a multiple of
both H), so every curve point is an outer-step boundary. The summary gives each method's final losses and
bytes, NoLoCo − DiLoCo seed by seed, and every method's consensus loss at equal bytes sent per replica
(interpolated along its curve), with a plot of loss against megabytes.

``scale`` (iid, one seed per point): NoLoCo against DiLoCo (the code's settings as above, at twice NoLoCo's
H) and DDP as the model and N grow, at H = 10 and 120 of NoLoCo's outer steps: B5's model (0.1 M
parameters) at N = 8, 16 and 32, and a model of 4 layers of width 128 (``model="wide"``, 0.8 M) at N = 8.
The question is the paper's Table 2: does the gap to DDP shrink with the model and grow with N, and
where does NoLoCo stand against DiLoCo.

Both write their own summary (``b5_paper.json`` with ``b5_paper_bytes.png``, ``b5_scale.json``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.b5_convergence.fidelity import LONG, LONG_QUICK
from benchmarks.b5_convergence.grid import Job, Settings
from benchmarks.common import table, write_json

# ----------------------------------------------------------------------------------------- settings

# The long part's model and data; the authors' inner optimizer and warm-up share (1,000 of 25,000 steps),
# measured every 300 steps (6 of NoLoCo's outer steps, 3 of the code's DiLoCo).
PAPER = replace(LONG, warmup_steps=120, eval_every=300, inner="adam")
PAPER_QUICK = replace(LONG_QUICK, eval_every=8, inner="adam")

DILOCO_CODE = "diloco@lr=0.7,m=0.3,nesterov=0"  # gensyn-ai/noloco's c4_diloco_100m_8.yaml, at twice NoLoCo's H
PAPER_NAMES = {"noloco": "NoLoCo (paper: H = 50)", DILOCO_CODE: "DiLoCo as NoLoCo's code (H = 100, heavy ball 0.3)",
               "diloco": "DiLoCo, its own paper (H = 50, Nesterov 0.9)",
               "gasloc_pairs": "GASLoC, random pairs (H = 50)"}
PAPER_METHODS = tuple(PAPER_NAMES)


def paper_h(method: str, settings: Settings) -> int:
    """Each method's H: the code's DiLoCo syncs half as often as the others."""
    return 2 * settings.sync_every if method == DILOCO_CODE else settings.sync_every


def paper_jobs(settings: Settings, quick: bool) -> list[Job]:
    """The main comparison first (NoLoCo against the code's DiLoCo, iid, seed by seed), then the same on
    non-iid shards, then DiLoCo's own settings and GASLoC on iid shards."""
    n, seeds = (4, (0,)) if quick else (8, (0, 1, 2))
    main, more = PAPER_METHODS[:2], PAPER_METHODS[2:]
    jobs = [Job(m, n, split, s, paper_h(m, settings), "paper") for split in ("iid", "non_iid") for s in seeds
            for m in main]
    return jobs + [Job(m, n, "iid", s, paper_h(m, settings), "paper") for s in seeds for m in more]


# The scale part: B5's model at N = 8, 16 and 32, and a 4 x 128 model at N = 8; H = 10, 1,200 steps.
SCALE = replace(LONG, steps=1200, sync_every=10, warmup_steps=48, eval_every=120, inner="adam")
SCALE_QUICK = replace(PAPER_QUICK, steps=16, sync_every=4, eval_every=8)
SCALE_POINTS = (("", 8), ("", 16), ("", 32), ("wide", 8))  # (model, N); "": B5's model (grid.model_settings)
SCALE_METHODS = ("noloco", DILOCO_CODE, "ddp")


def scale_jobs(settings: Settings, quick: bool) -> list[Job]:
    """NoLoCo, the code's DiLoCo and DDP at each point (``model``, N), smallest first."""
    points = (("", 2), ("wide", 2)) if quick else SCALE_POINTS
    return [Job(m, n, "iid", 0, paper_h(m, settings), "scale", model=model) for model, n in points
            for m in SCALE_METHODS]


# ----------------------------------------------------------------------------------------- summaries


def _stat(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "half_range": (max(values) - min(values)) / 2, "n": len(values)}


def _records(runs_dir: Path, part: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob(f"{part}-*.json"))]


def at_bytes(curve: list[dict[str, Any]], mbytes: float, key: str = "consensus") -> float | None:
    """The loss ``key`` when the run had sent ``mbytes`` MB per replica, linearly interpolated between its
    measuring points (None beyond its last)."""
    points = [(p["bytes_per_replica"] / 1e6, p[key]) for p in curve]
    for (b0, l0), (b1, l1) in zip(points, points[1:]):
        if b0 <= mbytes <= b1:
            return l0 if b1 == b0 else l0 + (l1 - l0) * (mbytes - b0) / (b1 - b0)
    return None


def paper_report(folder: Path, runs_dir: Path, settings: Settings, quick: bool) -> dict[str, Any]:
    """Final losses and bytes by split and method; NoLoCo − DiLoCo (the code's) seed by seed; every method's
    consensus loss at equal megabytes sent per replica; the plot of loss against megabytes."""
    records = _records(runs_dir, "paper")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["split"], r["method"]), []).append(r)
    order = {m: k for k, m in enumerate(PAPER_METHODS)}
    rows = []
    for (split, method), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99))):
        rows.append({"split": split, "method": method, "name": PAPER_NAMES.get(method, method),
                     "H": runs[0]["sync_every"], "seeds": len(runs),
                     "outer_steps": settings.steps // runs[0]["sync_every"],
                     "consensus": _stat([r["final"]["consensus"] for r in runs]),
                     "mean_replica": _stat([r["final"]["mean_replica"] for r in runs]),
                     "mbytes_per_replica": statistics.mean(r["final"]["bytes_per_replica"] for r in runs) / 1e6})
    # NoLoCo − DiLoCo (the code's), paired by seed (same start and data); negative: NoLoCo is better
    paired = []
    for split in sorted({s for s, _ in groups}):
        noloco = {r["seed"]: r["final"] for r in groups.get((split, "noloco"), [])}
        diloco = {r["seed"]: r["final"] for r in groups.get((split, DILOCO_CODE), [])}
        for seed in sorted(set(noloco) & set(diloco)):
            paired.append({"split": split, "seed": seed,
                           "consensus": noloco[seed]["consensus"] - diloco[seed]["consensus"],
                           "mean_replica": noloco[seed]["mean_replica"] - diloco[seed]["mean_replica"],
                           "relative": noloco[seed]["consensus"] / diloco[seed]["consensus"] - 1})
    # equal bytes: budgets are fractions of the smallest final megabytes of a split's methods
    equal = []
    for split in sorted({s for s, _ in groups}):
        methods = [m for s, m in groups if s == split]
        least = min(statistics.mean(r["final"]["bytes_per_replica"] for r in groups[(split, m)]) for m in methods) / 1e6
        for fraction in (0.25, 0.5, 0.75, 1.0):
            budget = fraction * least
            for method in sorted(methods, key=lambda m: order.get(m, 99)):
                losses = [at_bytes(r["curve"], budget) for r in groups[(split, method)]]
                if all(v is not None for v in losses):
                    equal.append({"split": split, "mbytes": budget, "method": method,
                                  "consensus": statistics.mean(v for v in losses if v is not None)})
    flat = [{**r, "c": r["consensus"]["mean"], "cpm": r["consensus"]["half_range"], "m": r["mean_replica"]["mean"],
             "mpm": r["mean_replica"]["half_range"]} for r in rows]
    print(table(flat, [("split", "split", "s"), ("name", "method", "s"), ("seeds", "seeds", "d"),
                       ("outer_steps", "outer steps", "d"), ("c", "consensus", ".3f"), ("cpm", "±", ".3f"),
                       ("m", "mean replica", ".3f"), ("mpm", "±", ".3f"), ("mbytes_per_replica", "MB/replica", ".1f")]))
    print(table(paired, [("split", "split", "s"), ("seed", "seed", "d"),
                         ("consensus", "NoLoCo − DiLoCo consensus", "+.3f"),
                         ("mean_replica", "NoLoCo − DiLoCo mean replica", "+.3f"), ("relative", "relative", "+.2%")]))
    print(table(equal, [("split", "split", "s"), ("mbytes", "MB sent per replica", ".1f"), ("method", "method", "s"),
                        ("consensus", "consensus loss then", ".3f")]))
    summary = {"settings": asdict(settings), "quick": quick, "methods": PAPER_NAMES, "rows": rows, "paired": paired,
               "equal_bytes": equal,
               "curves": {f"{r['split']}/{r['method']}/s{r['seed']}": r["curve"] for r in records},
               "runs": len(records)}
    write_json("b5_paper.json", summary, folder)
    plot_bytes(groups, folder / "b5_paper_bytes.png", settings)
    print(f"wrote {folder / 'b5_paper.json'} and {folder / 'b5_paper_bytes.png'}")
    return summary


def plot_bytes(groups: dict[tuple[str, str], list[dict[str, Any]]], path: Path, settings: Settings) -> None:
    """Consensus loss against megabytes sent per replica, mean over seeds, one panel per split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({s for s, _ in groups})
    fig, axes = plt.subplots(1, len(splits), figsize=(6 * len(splits), 4.2), squeeze=False)
    for ax, split in zip(axes[0], splits):
        for (s, method), runs in sorted(groups.items()):
            if s != split:
                continue
            points = list(zip(*[r["curve"][1:] for r in runs]))
            ax.plot([statistics.mean(q["bytes_per_replica"] for q in p) / 1e6 for p in points],
                    [statistics.mean(q["consensus"] for q in p) for p in points], marker="o",
                    label=f"{PAPER_NAMES.get(method, method)} ({len(runs)} seeds)")
        ax.set_xlabel("MB sent per replica")
        ax.set_ylabel("consensus validation loss")
        ax.set_title(f"{split}: N = {runs[0]['replicas']}, {settings.steps} inner steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scale_report(folder: Path, runs_dir: Path, settings: Settings, quick: bool) -> dict[str, Any]:
    """Per model size and N: each method's final consensus loss, NoLoCo − DiLoCo, and each one's gap to DDP."""
    records = _records(runs_dir, "scale")
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    params: dict[str, float] = {}
    for r in records:
        model = r.get("model") or "small"
        by.setdefault((model, r["replicas"]), {})[r["method"]] = r["final"]
        params[model] = r["m_params"]
    rows = []
    for (size, n), finals in sorted(by.items(), key=lambda kv: (kv[0][0] != "small", kv[0][1])):
        row: dict[str, Any] = {"size": size, "replicas": n, "m_params": params[size]}
        for base in SCALE_METHODS:
            if base in finals:
                row[base] = finals[base]["consensus"]
        if "noloco" in row and DILOCO_CODE in row:
            row["noloco_minus_diloco"] = row["noloco"] - row[DILOCO_CODE]
        if "ddp" in row:
            for base in ("noloco", DILOCO_CODE):
                if base in row:
                    row[f"{base}_vs_ddp"] = row[base] / row["ddp"] - 1
        rows.append(row)
    print(table(rows, [("size", "model", "s"), ("m_params", "M params", ".2f"), ("replicas", "N", "d"),
                       ("ddp", "DDP", ".3f"), ("noloco", "NoLoCo", ".3f"), (DILOCO_CODE, "DiLoCo (code)", ".3f"),
                       ("noloco_minus_diloco", "NoLoCo − DiLoCo", "+.3f"),
                       ("noloco_vs_ddp", "NoLoCo / DDP − 1", "+.1%"),
                       (f"{DILOCO_CODE}_vs_ddp", "DiLoCo / DDP − 1", "+.1%")]))
    summary = {"settings": asdict(settings), "quick": quick, "rows": rows, "runs": len(records)}
    write_json("b5_scale.json", summary, folder)
    print(f"wrote {folder / 'b5_scale.json'}")
    return summary
