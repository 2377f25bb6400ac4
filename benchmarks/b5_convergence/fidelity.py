"""B5's fidelity parts: GASLoC's two forms (``forms``) and the papers' regime (``long``).

``forms`` (N = 4, iid): where GASLoC's outer momentum acts, ``momentum_on="mixed"`` (on the mixed
iterates) against ``"sent"`` (heavy ball on the sent iterates, the public summary's form). Each form
gets the same grid of (η, γ, α) on random pairs and seed 0 (``FORMS_GRID``: 2 × 2 × 2 at H = 1,
2 × 2 at H = 10); its best cell per H then runs 3 seeds, at H = 1 also on a ring. The baselines,
3 seeds each: plain gossip (pair averaging, ring and random pairs) at H = 1, DiLoCo and NoLoCo
(paper defaults) at H = 10, taken from B5's published runs of the same configuration.

``long`` (N = 8, iid): the papers' H = 50 and 60 outer steps (3,000 inner steps), every method with
its paper defaults, 3 seeds, measured every 5 outer steps; then, one seed each, the settings that
docs/tuning.md recommends from B5's H = 10 grid.

Both write their own summary (``b5_forms.json``, ``b5_long.json``) and leave ``b5_convergence.json``
as the other parts made it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from benchmarks.b5_convergence.grid import Job, Settings
from benchmarks.common import table, write_json

# ----------------------------------------------------------------------------------------- settings

# The long part's model, data and inner optimizer are B5's (FULL); H and the run length change, the
# warmup keeps the same share of the run (30 of 450 steps there), and each replica's batch is 4
# sequences instead of 8, so that 15 runs of 3,000 steps fit in about an hour on the shared 2 cores.
LONG = Settings(steps=3000, sync_every=50, batch_size=4, block_size=64, n_layer=2, n_embd=64, n_head=4, lr=3e-3,
                warmup_steps=200, eval_every=250, eval_batches=8, final_eval_batches=64)
LONG_QUICK = Settings(steps=32, sync_every=4, batch_size=4, block_size=32, n_layer=1, n_embd=32, n_head=2, lr=3e-3,
                      warmup_steps=4, eval_every=8, eval_batches=2, final_eval_batches=4)
LONG_METHODS = ("ddp", "independent", "diloco", "noloco", "gasloc_pairs")
# With --seeds (more seeds for a part that ran out of time): the comparisons with independent
# replicas first, DDP (far ahead of every other method) last
LONG_PRIORITY = ("independent", "gasloc_pairs", "noloco", "diloco", "ddp")
# GASLoC's other form (``momentum_on="sent"``), defaults otherwise: after the defaults' seeds
LONG_OTHER_FORM = "gasloc_pairs_sent"
# docs/tuning.md's recommendations for short runs (B5's tuning grid, N = 4, H = 10, 45 outer steps)
LONG_TUNED = ("diloco@lr=0.7,m=0.0", "noloco@lr=0.5,m=0.25", "gasloc_pairs@lr=0.5,m=0.25")

# The forms part's grid, the same for both forms: η (outer_lr), γ (outer_momentum), α (gossip_step).
# At H = 1, 2 x 2 x 2: it holds the "matched" cell of B5's H = 1 part (η 1, γ ½, α ½: plain gossip
# plus momentum), the pair average's α = ½ and GASLoC's default α = ¼. At H = 10, 2 x 2 at the
# default α = ¼ (the shared 2-core machine allowed no more; B5's tuning part found η and γ to matter there).
FORMS_GRID = {1: ((0.5, 1.0), (0.25, 0.5), (0.25, 0.5)), 10: ((0.5, 1.0), (0.25, 0.5), (0.25,))}
FORMS = ("mixed", "sent")
FORMS_H = (1, 10)
FORMS_BASELINES = {1: ("gossip_pairs", "gossip_ring"), 10: ("diloco", "noloco")}


def baselines_for(h: int) -> tuple[str, ...]:
    """The baselines at H = 1, and at the longer H (10; 4 in the quick run)."""
    return FORMS_BASELINES[1 if h == 1 else 10]


def gasloc_name(topology: str, form: str, lr: float, momentum: float, alpha: float) -> str:
    """A method name that :func:`benchmarks.b5_convergence.grid.make_algorithm` builds:
    ``gasloc_pairs_sent@lr=1.0,m=0.5,a=0.5``."""
    suffix = "_sent" if form == "sent" else ""
    return f"gasloc_{topology}{suffix}@lr={lr},m={momentum},a={alpha}"


def form_of(method: str) -> str:
    return "sent" if method.split("@")[0].endswith("_sent") else "mixed"


# ----------------------------------------------------------------------------------------- jobs


def forms_jobs(settings: Settings, quick: bool) -> list[Job]:
    """The grid on seed 0 and the baselines' seed 0 first, then the baselines' other seeds; the best
    cells' seeds come from :func:`forms_best_jobs` once the grid has run."""
    n, seeds = (2, (0,)) if quick else (4, (0, 1, 2))
    hs = (1, settings.sync_every) if quick else FORMS_H
    jobs = []
    for h in hs:
        if h == 1 or quick:  # H = 10: B5's published runs (seed 0 of H = 1 runs again as the check)
            jobs += [Job(m, n, "iid", 0, h, "forms") for m in baselines_for(h)]
        lrs, momenta, alphas = FORMS_GRID[1 if h == 1 else 10]
        cells = [(a, b, c) for a in lrs for b in momenta for c in alphas]
        if quick:
            cells = cells[:: len(cells) - 1]  # the two corners
        jobs += [Job(gasloc_name("pairs", form, *cell), n, "iid", 0, h, "forms") for form in FORMS for cell in cells]
    if quick:  # no published runs to take the other seeds from (see forms_baselines)
        for h in hs:
            jobs += [Job(m, n, "iid", s, h, "forms") for s in seeds[1:] for m in baselines_for(h)]
    return jobs


def published_finals(folder: Path) -> dict[str, dict[str, float]]:
    """The final losses of B5's published runs (``b5_convergence.json``'s curves), by run name."""
    path = folder / "b5_convergence.json"
    if not path.exists():
        return {}
    curves = json.loads(path.read_text()).get("curves", {})
    return {name: curve[-1] for name, curve in curves.items()}


def forms_baselines(records: list[dict[str, Any]], folder: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The baselines' finals for every seed: this part's own runs, and for the other seeds B5's
    published runs of the same configuration (the h1 and main parts: same settings, seeds and data;
    the simulator is deterministic). Seed 0 runs here again as the check: ``checks`` lists it
    against the published value."""
    published = published_finals(folder)
    own = {(r["sync_every"], r["method"], r["seed"]): r["final"] for r in records
           if r["method"] in baselines_for(r["sync_every"])}
    wanted = set(own) | {(h, m, seed) for h, methods in FORMS_BASELINES.items() for m in methods for seed in (0, 1, 2)}
    finals, checks = [], []
    for h, method, seed in sorted(wanted):
        name = f"h1-{method}-n4-iid-h1-s{seed}" if h == 1 else f"main-{method}-n4-iid-h{h}-s{seed}"
        mine, theirs = own.get((h, method, seed)), published.get(name)
        if mine is not None and theirs is not None:
            checks.append({"H": h, "method": method, "seed": seed, "here": mine["consensus"],
                           "published": theirs["consensus"]})
        final = mine or theirs
        if final is not None:
            finals.append({"H": h, "method": method, "seed": seed, "consensus": final["consensus"],
                           "mean_replica": final["mean_replica"], "source": "here" if mine else name})
    return finals, checks


def forms_best(runs_dir: Path) -> dict[tuple[int, str], str]:
    """Each form's best grid cell per H (lowest consensus loss on seed 0): {(H, form): method}."""
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for p in runs_dir.glob("forms-gasloc_pairs*@*-s0.json"):
        r = json.loads(p.read_text())
        key = (r["sync_every"], form_of(r["method"]))
        if key not in best or r["final"]["consensus"] < best[key]["final"]["consensus"]:
            best[key] = r
    return {k: r["method"] for k, r in best.items()}


def forms_best_jobs(runs_dir: Path, quick: bool) -> list[Job]:
    """Every seed of each form's best cell on random pairs, then at H = 1 on a ring (the same cell),
    seed by seed."""
    n, seeds = (2, (0,)) if quick else (4, (0, 1, 2))
    best = sorted(forms_best(runs_dir).items())
    jobs = [Job(method, n, "iid", s, h, "forms") for (h, _), method in best for s in seeds]
    rings = [(h, method.replace("gasloc_pairs", "gasloc_ring")) for (h, _), method in best if h == 1]
    return jobs + [Job(method, n, "iid", s, h, "forms") for s in seeds for h, method in rings]


def long_jobs(settings: Settings, quick: bool, only_seeds: Optional[list[int]] = None) -> list[Job]:
    """Seed by seed (an interrupted run has whole seeds), then GASLoC's other form on every seed, then
    the H = 10 recommendations on seed 0. ``only_seeds``: the default methods on these seeds alone,
    in the order of ``LONG_PRIORITY``."""
    n, seeds = (4, (0,)) if quick else (8, (0, 1, 2))
    if only_seeds is not None:
        return [Job(m, n, "iid", s, settings.sync_every, "long") for s in only_seeds for m in LONG_PRIORITY]
    jobs = [Job(m, n, "iid", s, settings.sync_every, "long") for s in seeds for m in LONG_METHODS]
    jobs += [Job(LONG_OTHER_FORM, n, "iid", s, settings.sync_every, "long") for s in seeds]
    return jobs + [Job(m, n, "iid", 0, settings.sync_every, "long") for m in LONG_TUNED]


# ----------------------------------------------------------------------------------------- summaries


def _records(runs_dir: Path, part: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob(f"{part}-*.json"))]


def _stat(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "half_range": (max(values) - min(values)) / 2, "n": len(values)}


def _group(records: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["sync_every"], r["method"]), []).append(r)
    return groups


def forms_report(folder: Path, runs_dir: Path, settings: Settings, quick: bool) -> dict[str, Any]:
    """The grid (seed 0), and each form's best against the baselines over seeds."""
    records = _records(runs_dir, "forms")
    groups = _group(records)
    grid = []
    for (h, method), runs in sorted(groups.items()):
        if "@" not in method or not method.startswith("gasloc_pairs"):
            continue
        values = dict(item.split("=") for item in method.split("@")[1].split(","))
        seed0 = [r for r in runs if r["seed"] == 0]
        if seed0:
            grid.append({"H": h, "form": form_of(method), "eta": float(values["lr"]), "gamma": float(values["m"]),
                         "alpha": float(values["a"]), "consensus": seed0[0]["final"]["consensus"],
                         "mean_replica": seed0[0]["final"]["mean_replica"]})
    best = forms_best(runs_dir)
    chosen = set(best.values()) | {m.replace("gasloc_pairs", "gasloc_ring") for (h, _), m in best.items() if h == 1}
    finals, checks = forms_baselines(records, folder)
    for r in records:
        if "@" in r["method"] and r["method"] in chosen:
            finals.append({"H": r["sync_every"], "method": r["method"], "seed": r["seed"], **{
                k: r["final"][k] for k in ("consensus", "mean_replica")}, "source": "here"})
    by: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for f in finals:
        by.setdefault((f["H"], f["method"]), []).append(f)
    rows = []
    for (h, method), runs in sorted(by.items()):
        rows.append({"H": h, "method": method, "form": form_of(method) if method.startswith("gasloc") else "",
                     "seeds": len(runs), "consensus": _stat([r["consensus"] for r in runs]),
                     "mean_replica": _stat([r["mean_replica"] for r in runs]),
                     "paired_vs": _paired(runs, by, h)})
    flat = [{**r, "c": r["consensus"]["mean"], "cpm": r["consensus"]["half_range"], "m": r["mean_replica"]["mean"],
             "vs": ", ".join(f"{b} {d['mean']:+.3f} ± {d['half_range']:.3f}" for b, d in r["paired_vs"].items())}
            for r in rows]
    print(table(grid, [("H", "H", "d"), ("form", "form", "s"), ("eta", "η", ".2f"), ("gamma", "γ", ".2f"),
                       ("alpha", "α", ".2f"), ("consensus", "consensus (s0)", ".3f"),
                       ("mean_replica", "mean replica (s0)", ".3f")]))
    print(table(flat, [("H", "H", "d"), ("method", "method", "s"), ("seeds", "seeds", "d"),
                       ("c", "consensus", ".3f"), ("cpm", "±", ".3f"), ("m", "mean replica", ".3f"),
                       ("vs", "paired Δ consensus vs baselines", "s")]))
    gaps = form_gaps(finals)
    print(table(gaps, [("H", "H", "d"), ("topology", "topology", "s"), ("seeds", "seeds", "d"),
                       ("sent_minus_mixed", "consensus: sent − mixed (paired)", "+.4f"), ("half_range", "±", ".4f")]))
    if checks:
        print(table(checks, [("H", "H", "d"), ("method", "baseline", "s"), ("seed", "seed", "d"),
                             ("here", "consensus here", ".5f"), ("published", "published", ".5f")]))
    summary = {"settings": asdict(settings), "quick": quick, "grid": grid,
               "best": {f"H={h} {f}": m for (h, f), m in best.items()},
               "rows": rows, "form_gaps": gaps, "finals": finals, "reproduced": checks, "runs": len(records)}
    write_json("b5_forms.json", summary, folder)
    print(f"wrote {folder / 'b5_forms.json'}")
    return summary


def form_gaps(finals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The two forms' best cells against each other, seed by seed, per H and topology: the consensus
    loss of "sent" minus that of "mixed" (negative: the summary's form is better)."""
    by: dict[tuple[int, str, str, int], float] = {}
    for f in finals:
        if "@" in f["method"]:
            topology = "ring" if f["method"].startswith("gasloc_ring") else "random_pairs"
            by[(f["H"], topology, form_of(f["method"]), f["seed"])] = f["consensus"]
    out = []
    for h, topology in sorted({(k[0], k[1]) for k in by}):
        diffs = [by[(h, topology, "sent", s)] - by[(h, topology, "mixed", s)] for s in range(3)
                 if (h, topology, "sent", s) in by and (h, topology, "mixed", s) in by]
        if diffs:
            stat = _stat(diffs)
            out.append({"H": h, "topology": topology, "seeds": len(diffs), "sent_minus_mixed": stat["mean"],
                        "half_range": stat["half_range"]})
    return out


def _paired(runs: list[dict[str, Any]], by: dict[tuple[int, str], list[dict[str, Any]]], h: int) -> dict[str, Any]:
    """For a GASLoC row: its consensus loss minus each baseline's of the same H, seed by seed (the
    same start and data), mean and half the range. Negative: GASLoC is better."""
    out: dict[str, Any] = {}
    if not runs[0]["method"].startswith("gasloc"):
        return out
    topology = "ring" if runs[0]["method"].startswith("gasloc_ring") else "pairs"
    mine = {r["seed"]: r["consensus"] for r in runs}
    for base in baselines_for(h):
        if h == 1 and not base.endswith(topology):
            continue
        theirs = {r["seed"]: r["consensus"] for r in by.get((h, base), [])}
        diffs = [mine[s] - theirs[s] for s in sorted(mine) if s in theirs]
        if diffs:
            out[base] = _stat(diffs)
    return out


def long_report(folder: Path, runs_dir: Path, settings: Settings, quick: bool) -> dict[str, Any]:
    """Final losses over seeds, and the curve: at every measuring point (outer steps so far), each
    method's consensus and mean-replica loss (mean over seeds) and its gap to independent replicas'
    mean replica (positive: better than never communicating) and to DDP."""
    records = _records(runs_dir, "long")
    groups = _group(records)
    rows = []
    for (_, method), runs in sorted(groups.items(), key=lambda kv: _order(kv[0][1])):
        rows.append({"method": method, "seeds": len(runs), "consensus": _stat([r["final"]["consensus"] for r in runs]),
                     "mean_replica": _stat([r["final"]["mean_replica"] for r in runs]),
                     "mbytes_per_replica": statistics.mean(r["final"]["bytes_per_replica"] for r in runs) / 1e6})
    curves: dict[str, list[dict[str, Any]]] = {}
    for (h, method), runs in groups.items():
        points = zip(*[r["curve"] for r in runs])
        curves[method] = [{"step": p[0]["step"], "outer_steps": p[0]["step"] // h, "seeds": len(p),
                           "consensus": statistics.mean(q["consensus"] for q in p),
                           "mean_replica": statistics.mean(q["mean_replica"] for q in p)} for p in points]
    gaps = _long_gaps(records)
    flat = [{**r, "c": r["consensus"]["mean"], "cpm": r["consensus"]["half_range"], "m": r["mean_replica"]["mean"],
             "mpm": r["mean_replica"]["half_range"]} for r in rows]
    print(table(flat, [("method", "method", "s"), ("seeds", "seeds", "d"), ("c", "consensus", ".3f"),
                       ("cpm", "±", ".3f"),
                       ("m", "mean replica", ".3f"), ("mpm", "±", ".3f"), ("mbytes_per_replica", "MB/replica", ".1f")]))
    print(table(gaps, [("method", "method", "s"), ("outer_steps", "outer steps", "d"),
                       ("consensus_vs_independent", "indep. replica − consensus", "+.3f"),
                       ("replica_vs_independent", "indep. replica − mean replica", "+.3f"),
                       ("consensus_vs_ddp", "consensus − DDP", "+.3f"), ("seeds", "seeds", "d")]))
    summary = {"settings": asdict(settings), "quick": quick, "rows": rows, "curves": curves, "gaps": gaps,
               "runs": len(records)}
    write_json("b5_long.json", summary, folder)
    print(f"wrote {folder / 'b5_long.json'}")
    return summary


def _long_gaps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At every measuring point of every method: its consensus and mean-replica loss against an
    independent replica's (the mean replica of the independent run of the same seed; positive: better
    than never communicating) and its consensus minus DDP's, each paired by seed and averaged over
    the seeds that the method and the baseline both ran."""
    runs = {(r["method"], r["seed"]): r["curve"] for r in records}
    gaps = []
    for method in sorted({m for m, _ in runs}, key=_order):
        if method in ("independent", "ddp"):
            continue
        seeds = sorted(s for m, s in runs if m == method and ("independent", s) in runs)
        if not seeds:
            continue
        for k in range(1, len(runs[(method, seeds[0])])):
            points = [(runs[(method, s)][k], runs[("independent", s)][k]) for s in seeds]
            gap = {"method": method, "outer_steps": points[0][0]["step"] // records[0]["sync_every"],
                   "seeds": len(seeds),
                   "consensus_vs_independent": statistics.mean(b["mean_replica"] - p["consensus"] for p, b in points),
                   "replica_vs_independent": statistics.mean(b["mean_replica"] - p["mean_replica"] for p, b in points)}
            with_ddp = [runs[(method, s)][k]["consensus"] - runs[("ddp", s)][k]["consensus"]
                        for s in seeds if ("ddp", s) in runs]
            if with_ddp:
                gap["consensus_vs_ddp"] = statistics.mean(with_ddp)
            gaps.append(gap)
    return gaps


def _order(method: str) -> tuple[int, str]:
    base = method.split("@")[0]
    order = (*LONG_METHODS, LONG_OTHER_FORM)
    return (order.index(base) if base in order else len(order), method)
