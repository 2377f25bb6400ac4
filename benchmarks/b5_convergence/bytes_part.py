"""B5's ``bytes`` part: loss per byte in the papers' regime, for the sub-8-bit and sparse wire formats.

The long part's configuration (:data:`.fidelity.LONG`: N = 8, iid, H = 50, 60 outer steps, paper defaults) in
the training simulator, with the wire formats of ``FORMATS``: DiLoCo with int8, int4, int2 (block scales, error
feedback) and top-k at 2 %, 1 % and 3 % of each chunk (values in 2 bits) counted 1/N each with plain error
feedback (``topk_mean="replicas"``, the first form we built); NoLoCo with int8, int4 and int2, without error
feedback (its default for weights) and with it (``int4_ef``, ``int2_ef``; NoLoCo's payload is weights, which top-k
does not take: the rule ``topk-pseudo-gradient-only``). Then:

* ``SPARSELOCO``, the target: topk's defaults (each position averaged over the replicas that sent it, the residual
  decayed by 0.95) with SparseLoCo's outer step (outer lr 1, no outer momentum), on every seed; and
  ``SPARSE_VARIANTS``, one part of that form changed at a time (one seed; the decay of 0.8, best here, on every
  seed);
* ``STUDIES`` (:mod:`.study`): NoLoCo sending a difference both peers know, from the initial weights or from the
  pair's own reference (CHOCO-style public copies), in the same bytes as its payload in that format;
* ``PAPER_FORMATS``: the best format of each method at the NoLoCo paper's protocol (the ``paper`` part's settings,
  one seed), against the paper part's float32 runs (``b5_paper.json``).

The float32 runs, DDP and independent replicas are the long part's own (``b5_long.json``, 3 seeds each): the same
model, data, seeds and code path. Top-k's all-reduce is an all-gather: at N = 8 each replica sends 7 payloads of
about 2.25 bytes per value kept, against float32's 2·7/8 model copies of 4 bytes, so 3 % is about 15 × fewer bytes
and 2 % 22 ×. The summary (``b5_bytes.json``) holds each format's final consensus loss (mean and half range over the
seeds it ran), the MB it sent per replica, the ratio of float32's bytes to its own and the difference from
float32's loss, the paper-protocol rows, and each format on B8's clock where B1's exchanges on the emulated WAN
were measured (``EXCHANGE_FILE``); ``b5_bytes.png`` plots the loss against the MB sent, with the long part's
float32, DDP and independent runs beside.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.b5_convergence.grid import Job, Settings
from benchmarks.b5_convergence.protocol import paper_h
from benchmarks.common import table, write_json

FORMATS = {"diloco": ("topk2", "int2", "int4", "topk1", "int8", "topk3"),
           "noloco": ("int4", "int2", "int8", "int4_ef", "int2_ef")}
# SparseLoCo's form, topk's defaults (each position averaged over its senders, the residual decayed by 0.95) with
# its outer step (outer lr 1, no outer momentum): DiLoCo(outer_lr=1, outer_momentum=0) and WireConfig("topk").
# The target: within float32 DiLoCo's seed spread for at least 20 × fewer bytes.
SPARSELOCO = ("diloco@lr=1.0,m=0.0", "topk2_ef95_senders")
TARGET = SPARSELOCO
# What each part of that form does, one seed each: the 1/N mean (with and without the decay), no decay, an outer
# momentum (DiLoCo's Nesterov 0.9 at lr 0.7, with and without the decay; 0.5 at lr 1), outer lr 0.7, decays of 0.9
# to 0.6 (0.8, the best here, on every seed), and the 1/N mean with the decay and DiLoCo's own outer step. The
# strategies refuse the senders' mean with an outer momentum (rule senders-mean-without-momentum, from these runs),
# so those runs give the same SGD as an outer_optimizer ("opt=sgd"), which the rule leaves to its user.
SPARSE_VARIANTS = (("diloco@lr=1.0,m=0.0", "topk2_ef95"), ("diloco@lr=1.0,m=0.0", "topk2_senders"),
                   ("diloco@lr=0.7,m=0.9,opt=sgd", "topk2_ef95_senders"),
                   ("diloco@lr=0.7,m=0.9,opt=sgd", "topk2_senders"),
                   ("diloco@lr=1.0,m=0.5,opt=sgd", "topk2_ef95_senders"),
                   ("diloco@lr=0.7,m=0.0", "topk2_ef95_senders"), ("diloco@lr=1.0,m=0.0", "topk2_ef90_senders"),
                   ("diloco@lr=1.0,m=0.0", "topk2_ef80_senders"), ("diloco@lr=1.0,m=0.0", "topk2_ef70_senders"),
                   ("diloco@lr=1.0,m=0.0", "topk2_ef60_senders"), ("diloco", "topk2_ef95"))
# NoLoCo sending a difference both peers know (:mod:`.study`): from the initial weights, or from the pair's
# reference (CHOCO-style public copies), in int4 and int2 (the same bytes as NoLoCo's own payload in them).
STUDIES = (("noloco_pairwise", "int4"), ("noloco_pairwise", "int2"), ("noloco_pairwise", "int2_ef"),
           ("noloco_from_start", "int4"), ("noloco_from_start", "int2"), ("noloco_from_start", "int2_ef"))
# Every seed: the target, DiLoCo's int2 and int4, NoLoCo's int8 and its pairwise int4
SEEDED = (SPARSELOCO, ("diloco", "int2"), ("diloco", "int4"), ("noloco", "int8"), ("noloco_pairwise", "int4"),
          ("diloco@lr=1.0,m=0.0", "topk2_ef80_senders"))
LONG_BASELINES = ("ddp", "independent", "diloco", "noloco")
# B1 on the emulated WAN for B8's clock: python -m benchmarks.b1_sync_latency --parts main --modes emulated
#   --replicas 8 --params 120576 --methods noloco diloco --codecs float32 int8 int4 int2 topk --rounds 4
#   --out b5_bytes_exchange
EXCHANGE_FILE = "b5_bytes_exchange.json"
# The paper's protocol (the ``paper`` part's settings) for the best format of each method, one seed: the DiLoCo of
# NoLoCo's code (H = 100, heavy ball 0.3) with int2 and NoLoCo with int8, against the paper part's float32 runs.
PAPER_FORMATS = (("diloco@lr=0.7,m=0.3,nesterov=0", "int2"), ("noloco", "int8"))


def bytes_jobs(settings: Settings, quick: bool) -> list[Job]:
    """The target on every seed, then every other format on seed 0 (the two methods taking turns), SparseLoCo's
    variants and the NoLoCo studies; then the other seeded rows' further seeds. Quick: N = 4, seed 0, and of the
    variants and studies only the first of each."""
    n, seeds = (4, (0,)) if quick else (8, (0, 1, 2))
    jobs = [Job(TARGET[0], n, "iid", s, settings.sync_every, "bytes", TARGET[1]) for s in seeds]
    rest = [[(m, w) for w in FORMATS[m] if (m, w) != TARGET] for m in FORMATS]
    for k in range(max(map(len, rest))):
        jobs += [Job(m, n, "iid", 0, settings.sync_every, "bytes", w) for r in rest if k < len(r) for m, w in [r[k]]]
    extra = SPARSE_VARIANTS[:1] + STUDIES[:1] if quick else SPARSE_VARIANTS + STUDIES
    jobs += [Job(m, n, "iid", 0, settings.sync_every, "bytes", w) for m, w in extra]
    return jobs + [Job(m, n, "iid", s, settings.sync_every, "bytes", w) for m, w in SEEDED[1:] for s in seeds[1:]]


def paper_bytes_jobs(settings: Settings, quick: bool) -> list[Job]:
    """:data:`PAPER_FORMATS` at the paper's protocol (``settings``: the ``paper`` part's), seed 0."""
    return [Job(m, 4 if quick else 8, "iid", 0, paper_h(m, settings), "paper_bytes", w) for m, w in PAPER_FORMATS]


def paper_bytes_report(folder: Path, runs_dir: Path) -> list[dict[str, Any]]:
    """The paper-protocol runs of :data:`PAPER_FORMATS` beside the ``paper`` part's float32 runs (iid, 3 seeds)."""
    paper_file = folder / "b5_paper.json"
    if not paper_file.exists():
        return []
    base = {r["method"]: r for r in json.loads(paper_file.read_text())["rows"] if r["split"] == "iid"}
    rows = []
    for path in sorted(runs_dir.glob("paper_bytes-*.json")):
        r = json.loads(path.read_text())
        full = base.get(r["method"])
        if full is None:
            continue
        mb = r["final"]["bytes_per_replica"] / 1e6
        rows.append({"method": r["method"], "format": r["wire"], "consensus": r["final"]["consensus"],
                     "float32": full["consensus"]["mean"], "float32_half_range": full["consensus"]["half_range"],
                     "minus_float32": r["final"]["consensus"] - full["consensus"]["mean"], "mbytes_per_replica": mb,
                     "bytes_ratio": full["mbytes_per_replica"] / mb if mb else float("nan")})
    if rows:
        print("\nThe paper's protocol (B5 paper part's settings, iid, N = 8): the best format of each method, one "
              "seed, against the paper part's float32 runs (3 seeds)")
        print(table(rows, [("method", "method", "s"), ("format", "format", "s"), ("consensus", "consensus", ".3f"),
                           ("float32", "float32", ".3f"), ("float32_half_range", "±", ".3f"),
                           ("minus_float32", "Δ", "+.3f"), ("mbytes_per_replica", "MB/replica", ".2f"),
                           ("bytes_ratio", "× fewer bytes", ".1f")]))
    return rows


def _order(key: tuple[str, str]) -> tuple[int, int]:
    method, wire = key
    if (method, wire) == SPARSELOCO:
        return len(FORMATS), 0
    if (method, wire) in SPARSE_VARIANTS:
        return len(FORMATS) + 1, SPARSE_VARIANTS.index((method, wire))
    if (method, wire) in STUDIES:
        return len(FORMATS) + 2, STUDIES.index((method, wire))
    if method in FORMATS and wire in FORMATS[method]:
        return list(FORMATS).index(method), FORMATS[method].index(wire)
    return len(FORMATS) + 3, 0


def _stat(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "half_range": (max(values) - min(values)) / 2, "n": len(values)}


def bytes_report(folder: Path, runs_dir: Path, settings: Settings, quick: bool) -> dict[str, Any]:
    """Each format's final consensus loss against the bytes it sent, beside the long part's float32 runs."""
    records = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("bytes-*.json"))]
    long_file = folder / "b5_long.json"
    long_rows = {r["method"]: r for r in json.loads(long_file.read_text())["rows"]} if long_file.exists() else {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["method"], r["wire"]), []).append(r)
    rows = []
    for method in LONG_BASELINES:
        if method in long_rows:
            base = long_rows[method]
            rows.append({"method": method, "format": "float32" if method in FORMATS else "-", "seeds": base["seeds"],
                         "consensus": base["consensus"], "mbytes_per_replica": base["mbytes_per_replica"],
                         "source": "b5_long.json"})
    for (method, wire), runs in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        rows.append({"method": method, "format": wire, "seeds": len(runs),
                     "consensus": _stat([r["final"]["consensus"] for r in runs]),
                     "mbytes_per_replica": statistics.mean(r["final"]["bytes_per_replica"] for r in runs) / 1e6,
                     "compression_error_ratio": statistics.mean(r["compression_error_ratio"] or 0.0 for r in runs),
                     "source": "here"})
    for row in rows:
        # SparseLoCo's form against DiLoCo's float32 with its paper defaults, the studies against NoLoCo's
        base = "noloco" if row["method"].startswith("noloco_") else row["method"].split("@")[0]
        full = long_rows.get(base) if base in FORMATS and row["source"] == "here" else None
        if full is not None and row["mbytes_per_replica"]:
            row["bytes_ratio"] = full["mbytes_per_replica"] / row["mbytes_per_replica"]
            row["minus_float32"] = row["consensus"]["mean"] - full["consensus"]["mean"]
            # within float32's spread over its seeds (plus this row's own, where it has several)
            row["within_spread"] = abs(row["minus_float32"]) <= (full["consensus"]["half_range"]
                                                                  + row["consensus"]["half_range"])
    flat = [{**r, "c": r["consensus"]["mean"], "cpm": r["consensus"]["half_range"],
             "ratio": r.get("bytes_ratio", float("nan")), "d": r.get("minus_float32", float("nan"))} for r in rows]
    print(table(flat, [("method", "method", "s"), ("format", "format", "s"), ("seeds", "seeds", "d"),
                       ("c", "consensus", ".3f"), ("cpm", "±", ".3f"), ("mbytes_per_replica", "MB/replica", ".2f"),
                       ("ratio", "× fewer bytes than float32", ".1f"), ("d", "Δ vs float32", "+.3f"),
                       ("source", "source", "s")]))
    clock = b8_clock(rows, folder / EXCHANGE_FILE, settings)
    paper = paper_bytes_report(folder, runs_dir)
    pngs = bytes_plot(rows, folder)
    summary = {"settings": asdict(settings), "quick": quick, "rows": rows, "runs": len(records), "b8_clock": clock,
               "paper_protocol": paper,
               "curves": {f"{m}-{w}": [{"mbytes": p["bytes_per_replica"] / 1e6, "consensus": p["consensus"]}
                                       for p in runs[0]["curve"]] for (m, w), runs in groups.items()},
               "pngs": pngs}
    write_json("b5_bytes.json", summary, folder)
    print(f"wrote {folder / 'b5_bytes.json'}")
    return summary


def exchange_key(method: str, wire: str) -> str | None:
    """The B1 column of a (method, format) row: ``diloco+int4``; the studies take NoLoCo's pair exchange of their
    format (the same bytes); None where B1 has no such format."""
    base = "noloco" if method.startswith("noloco_") else method.split("@")[0]
    codec = "topk" if wire.startswith("topk2") else wire.removesuffix("_ef")  # B1 timed topk at its 2 %
    if base not in ("diloco", "noloco") or codec not in ("float32", "int8", "int4", "int2", "topk"):
        return None
    return base if codec == "float32" else f"{base}+{codec}"


def b8_clock(rows: list[dict[str, Any]], exchange_file: Path, settings: Settings) -> list[dict[str, Any]]:
    """Each row's run on B8's clock: every inner step costs X = float32 DiLoCo's measured all-reduce ÷ H (so that
    it costs H inner steps, as in B8), and every outer step the format's measured exchange e, blocking (B1 on the
    emulated WAN, N = 8, the GPT's parameters, ``EXCHANGE_FILE``): steps·X + rounds·e."""
    if not exchange_file.exists():
        return []
    found = [r for r in json.loads(exchange_file.read_text())["rows"] if r["replicas"] == 8]
    if not found or "diloco" not in found[0]:
        return []
    measured = found[0]
    x = measured["diloco"]["median"] / settings.sync_every
    rounds = settings.steps // settings.sync_every
    out = []
    for r in rows:
        key = exchange_key(r["method"], r["format"])
        if key is None or key not in measured:
            continue
        e = measured[key]
        out.append({"method": r["method"], "format": r["format"], "consensus": r["consensus"]["mean"],
                    "exchange_s": e["median"], "exchange_min": e["min"], "exchange_max": e["max"],
                    "wall_s": settings.steps * x + rounds * e["median"],
                    "exchange_share": rounds * e["median"] / (settings.steps * x + rounds * e["median"])})
    print(f"\nB8's clock: inner step X = {x:.4f} s (float32 DiLoCo's all-reduce / H), each outer step's measured "
          f"exchange e blocking ({exchange_file.name}: {measured['mode']}, N = 8, {measured['params']} parameters)")
    print(table(out, [("method", "method", "s"), ("format", "format", "s"), ("consensus", "consensus", ".3f"),
                      ("exchange_s", "exchange s", ".3f"), ("exchange_min", "min", ".3f"),
                      ("exchange_max", "max", ".3f"), ("wall_s", "run s", ".0f"),
                      ("exchange_share", "share exchanging", ".2f")]))
    return out


def plot_label(method: str, wire: str) -> str:
    """A short label: "DiLoCo int4", "SparseLoCo β = 0.8", "NoLoCo pairwise int4"."""
    if method.startswith("diloco@") and "senders" in wire:
        decay = {"topk2_ef95_senders": "0.95", "topk2_ef90_senders": "0.9", "topk2_ef80_senders": "0.8",
                 "topk2_ef70_senders": "0.7", "topk2_ef60_senders": "0.6"}.get(wire, wire)
        return f"SparseLoCo β = {decay}" + ("" if method == SPARSELOCO[0] else f" ({method.split('@')[1]})")
    names = {"diloco": "DiLoCo", "noloco": "NoLoCo", "ddp": "DDP", "noloco_pairwise": "NoLoCo pairwise",
             "noloco_from_start": "NoLoCo from θ₀"}
    return f"{names.get(method, method)} {'' if wire == '-' else wire}".strip()


def bytes_plot(rows: list[dict[str, Any]], folder: Path) -> list[str]:
    """Final consensus loss against MB sent per replica (log), one marker per method and format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    independent = next((r for r in rows if r["method"] == "independent"), None)
    ceiling = independent["consensus"]["mean"] + 0.3 if independent is not None else float("inf")
    # one marker per format: the variants of SparseLoCo's form and the studies but the best are left out, and so
    # are runs that ended above the independent replicas (diverged: the table has them)
    variants = [r for r in rows if (r["method"], r["format"]) in SPARSE_VARIANTS]
    best = min(variants, key=lambda r: r["consensus"]["mean"]) if variants else None
    shown = {SPARSELOCO, ("noloco_pairwise", "int4")} | ({(best["method"], best["format"])} if best else set())
    sent = [r for r in rows if r["mbytes_per_replica"] > 0 and r["consensus"]["mean"] < ceiling
            and ((r["method"], r["format"]) not in SPARSE_VARIANTS + STUDIES or (r["method"], r["format"]) in shown)]
    if not sent:
        return []
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    colours = {"diloco": "C0", "noloco": "C1", "ddp": "C2", SPARSELOCO[0]: "C4", "noloco_pairwise": "C5"}
    for r in sent:
        c = r["consensus"]
        ax.errorbar(r["mbytes_per_replica"], c["mean"], yerr=c["half_range"], marker="o", ms=4, capsize=2,
                    color=colours.get(r["method"], "C3"))
        left = r["method"] == SPARSELOCO[0]  # beside DiLoCo's int2 and int4: their labels go right, these left
        ax.annotate(plot_label(r["method"], r["format"]), (r["mbytes_per_replica"], c["mean"]), fontsize=6,
                    xytext=(-5 if left else 4, -2 if r["method"] in ("diloco", SPARSELOCO[0]) else
                            -9 if r["method"] == "noloco_pairwise" else 3),
                    ha="right" if left else "left", textcoords="offset points")
    if independent is not None:
        ax.axhline(independent["consensus"]["mean"], color="grey", ls=":", lw=1, label="independent replicas' average")
        ax.legend(fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per replica in the run (log)")
    ax.set_ylabel("final consensus validation loss")
    ax.set_title("B5 long (N = 8, H = 50, 60 outer steps): loss against bytes", fontsize=9)
    fig.tight_layout()
    path = folder / "b5_bytes.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [str(path)]
