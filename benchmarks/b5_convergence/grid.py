"""B5's grid: the two sizes of a run (full and quick), the methods, the wire formats, and the jobs
of every part in priority order."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_loco.replica.options import WireConfig


@dataclass(frozen=True)
class Settings:
    steps: int
    sync_every: int
    batch_size: int
    block_size: int
    n_layer: int
    n_embd: int
    n_head: int
    lr: float
    warmup_steps: int
    eval_every: int
    eval_batches: int  # 16 sequences each, spread evenly over the validation set; every eval_every steps
    final_eval_batches: int
    # the inner optimizer: "adamw" (the example GPT's: AdamW, betas 0.9/0.95, its weight decay) or "adam" (the
    # NoLoCo authors' runs: torch's Adam with its defaults, no weight decay); the same warm-up and cosine to lr/10
    inner: str = "adamw"

    @property
    def model_kwargs(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                "lr": self.lr, "warmup_steps": self.warmup_steps, "max_steps": self.steps}


# H = 10 and 450 steps: 45 outer steps (at least 40 were asked for), so that the whole grid fits in
# about an hour on 2 cores. The papers' H = 50 would need 2,250 steps per run for as many outer steps;
# at 8 sequences of 64 bytes per replica and step, the grid would then take about 5 hours here.
FULL = Settings(steps=450, sync_every=10, batch_size=8, block_size=64, n_layer=2, n_embd=64, n_head=4, lr=3e-3,
                warmup_steps=30, eval_every=50, eval_batches=8, final_eval_batches=64)
QUICK = Settings(steps=24, sync_every=4, batch_size=4, block_size=32, n_layer=1, n_embd=32, n_head=2, lr=3e-3,
                 warmup_steps=4, eval_every=12, eval_batches=2, final_eval_batches=4)

PARTS = ("main", "h1", "large", "tuning", "h_study", "codecs", "fragments", "processes")
DEFAULT_PARTS = ("main", "h1", "large", "processes")
MAIN_METHODS = ("ddp", "independent", "diloco", "noloco", "gasloc_pairs", "gasloc_ring", "gossip_pairs")
LARGE_METHODS = {16: ("ddp", "independent", "diloco", "noloco", "gasloc_pairs"),
                 64: ("diloco", "noloco", "gasloc_pairs")}
# At H = 1, also GASLoC with gossip's η = 1 and α = ½: then only the outer momentum γ differs from
# plain gossip, the paper's claim of momentum as gossip acceleration in isolation.
H1_METHODS = ("gasloc_ring", "gossip_ring", "gasloc_pairs", "gossip_pairs", "gasloc_ring_matched",
              "gasloc_pairs_matched")


# The tuning part: every method gets the same 3 x 3 grid of outer learning rate and outer momentum
# (its paper default among them), at N = 4, iid, one seed; then the best of each with two more seeds.
TUNING_GRID = {
    "diloco": ((0.3, 0.7, 1.0), (0.0, 0.5, 0.9)),
    "noloco": ((0.5, 0.7, 0.9), (0.0, 0.25, 0.5)),
    "gasloc_pairs": ((0.5, 0.7, 1.0), (0.0, 0.25, 0.5)),
}


# The codecs part: wire formats as (wire_dtype, compression, error_feedback); None = the default
# (error feedback on for DiLoCo's pseudo-gradients, off for NoLoCo's and GASLoC's weights).
CODECS = {
    "float32": WireConfig("float32"),
    "bfloat16": WireConfig("bfloat16"),
    "int8": WireConfig("int8"),
    "float16": WireConfig("float16"),
    "int8_ef": WireConfig("int8", error_feedback=True),  # error feedback on weights (NoLoCo, GASLoC)
    "int8_no_ef": WireConfig("int8", error_feedback=False),  # DiLoCo without its error feedback
    # the bytes part (:mod:`.bytes_part`): the sub-8-bit block formats and top-k (values in 2 bits, error feedback)
    "int4": WireConfig("int4"),
    "int2": WireConfig("int2"),
    # top-k with every payload counted 1/N, plain error feedback; 2 % is topk's default density
    "topk2": WireConfig("topk", topk_mean="replicas", error_feedback_decay=1.0),
    "topk3": WireConfig("topk", density=0.03, topk_mean="replicas", error_feedback_decay=1.0),
    "topk1": WireConfig("topk", density=0.01, topk_mean="replicas", error_feedback_decay=1.0),
    # SparseLoCo's accumulator (with no outer momentum), every payload counted 1/N
    "topk2_ef95": WireConfig("topk", error_feedback_decay=0.95, topk_mean="replicas"),
    # SparseLoCo's aggregation: each position's mean over the replicas that sent it
    "topk2_senders": WireConfig("topk", topk_mean="senders", error_feedback_decay=1.0),
    "topk2_ef95_senders": WireConfig("topk", error_feedback_decay=0.95, topk_mean="senders"),
    "topk2_ef90_senders": WireConfig("topk", error_feedback_decay=0.9, topk_mean="senders"),
    "topk2_ef80_senders": WireConfig("topk", error_feedback_decay=0.8, topk_mean="senders"),
    "topk2_ef70_senders": WireConfig("topk", error_feedback_decay=0.7, topk_mean="senders"),
    "topk2_ef60_senders": WireConfig("topk", error_feedback_decay=0.6, topk_mean="senders"),
    "int4_ef": WireConfig("int4", error_feedback=True),  # error feedback on weights (NoLoCo)
    "int2_ef": WireConfig("int2", error_feedback=True),
}
CODEC_METHODS = ("diloco", "noloco", "gasloc_pairs")


# The fragments part: streaming fragments (docs/fragments.md), F = 1, 2, 4, at N = 4 on iid shards,
# 3 seeds, paper defaults. F must divide H, and this grid's H = 10 is not divisible by 4: the part runs
# at H = 12 for 480 steps (40 outer steps, evaluated every 48 steps, 4 rounds), so that the run ends on
# a round of every fragment for every F. Quick: NoLoCo with F = 1 and 4 at the quick H = 4.
FRAGMENT_METHODS = ("diloco", "noloco", "gasloc_pairs")
FRAGMENT_COUNTS = (1, 2, 4)


FRAGMENTS_FULL = replace(FULL, steps=480, sync_every=12, eval_every=48)


def fragment_settings(settings: Settings) -> Settings:
    """The fragments part's settings: the full run's at H = 12 (``FRAGMENTS_FULL``); quick's as they are
    (its H = 4 takes every F of the part)."""
    return FRAGMENTS_FULL if settings == FULL else settings


def codec_variants(method: str, first: bool) -> list[str]:
    """The wire formats of the codecs part for ``method``: the targets first (float32, bfloat16,
    int8), then float16 and error feedback switched the other way."""
    if first:
        return ["float32", "bfloat16", "int8"]
    return ["float16", "int8_no_ef" if method == "diloco" else "int8_ef"]


def tuned(method: str, lr: float, momentum: float) -> str:
    return f"{method}@lr={lr},m={momentum}"


def make_algorithm(method: str) -> Any:
    from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo

    if "@" in method:  # a tuning variant: "noloco@lr=0.5,m=0.25", "gasloc_ring_sent@lr=1.0,m=0.5,a=0.5"
        base, spec = method.split("@")
        values = dict(item.split("=") for item in spec.split(","))
        lr, momentum = float(values["lr"]), float(values["m"])
        if base == "diloco":  # "nesterov=0": heavy ball, as the NoLoCo authors' DiLoCo baseline steps
            nesterov = values.get("nesterov", "1") != "0"
            if values.get("opt") == "sgd":  # the same SGD given as an outer_optimizer (B5 bytes: see SPARSE_VARIANTS)
                from lightning_loco.algorithms.outer_optimizer import SGDFactory

                return DiLoCo(outer_optimizer=SGDFactory(lr, momentum, nesterov))
            return DiLoCo(outer_lr=lr, outer_momentum=momentum, nesterov=nesterov)
        if base == "noloco":
            return NoLoCo(outer_lr=lr, outer_momentum=momentum)
        return GASLoC(outer_lr=lr, outer_momentum=momentum, gossip_step=float(values.get("a", 0.25)),
                      **gasloc_form(base))
    if method in ("noloco_from_start", "noloco_pairwise"):  # the bytes part's study (:mod:`.study`)
        from benchmarks.b5_convergence.study import NoLoCoFromStart, NoLoCoPairwise

        return NoLoCoFromStart() if method == "noloco_from_start" else NoLoCoPairwise()
    if method.startswith("gasloc") and method.endswith("_sent"):
        return GASLoC(**gasloc_form(method))
    return {
        "ddp": None,
        "independent": None,
        "diloco": DiLoCo(),
        "noloco": NoLoCo(),
        "gasloc_pairs": GASLoC(topology="random_pairs"),
        "gasloc_ring": GASLoC(topology="ring"),
        "gossip_pairs": GASLoC(topology="random_pairs", outer_lr=1.0, outer_momentum=0.0, gossip_step=0.5),
        "gossip_ring": GASLoC(topology="ring", outer_lr=1.0, outer_momentum=0.0, gossip_step=0.5),
        "gasloc_pairs_matched": GASLoC(topology="random_pairs", outer_lr=1.0, outer_momentum=0.5, gossip_step=0.5),
        "gasloc_ring_matched": GASLoC(topology="ring", outer_lr=1.0, outer_momentum=0.5, gossip_step=0.5),
    }[method]


def gasloc_form(base: str) -> dict[str, str]:
    """GASLoC's topology and form from a method's name: ``gasloc_ring_sent`` is a ring with
    ``momentum_on="sent"``; ``gasloc_pairs`` random pairs with the default form."""
    topology = "ring" if base.startswith("gasloc_ring") else "random_pairs"
    return {"topology": topology, "momentum_on": "sent" if base.endswith("_sent") else "mixed"}


@dataclass(frozen=True)
class Job:
    method: str
    replicas: int
    split: str
    seed: int
    sync_every: int
    part: str  # "main", "h1", "large", "tuning", "h_study", "codecs", "fragments", "forms", "long", "paper",
    # "scale", "bytes" or "paper_bytes" (the bytes part's best formats at the paper's protocol)
    wire: str = "float32"  # a key of CODECS
    fragments: int = 1  # F, streaming fragments (the fragments part)
    model: str = ""  # "" (the settings' model) or "wide" (see model_settings; the scale part)
    overlap: int = 0  # τ, overlap_steps (B8)

    @property
    def name(self) -> str:
        wire = "" if self.part not in ("codecs", "bytes", "paper_bytes") else f"-{self.wire}"
        fragments = "" if self.part != "fragments" else f"-f{self.fragments}"
        model = f"-{self.model}" if self.model else ""
        overlap = f"-o{self.overlap}" if self.overlap else ""
        return (f"{self.part}-{self.method}{wire}{fragments}{model}{overlap}-n{self.replicas}-{self.split}"
                f"-h{self.sync_every}-s{self.seed}")


def model_settings(model: str, settings: Settings) -> Settings:
    """A job's settings for its ``model``: "" the settings' own; "wide" twice the width and heads and 4 layers."""
    if not model:
        return settings
    if model != "wide":
        raise ValueError(f"model must be '' or 'wide', got {model!r}")
    return replace(settings, n_layer=4, n_embd=2 * settings.n_embd, n_head=2 * settings.n_head)


def jobs_for(settings: Settings, quick: bool) -> list[Job]:
    """In priority order: an interrupted run has the most important results first."""
    seeds = (0,) if quick else (0, 1, 2)
    sizes = (2,) if quick else (4, 8)
    methods = MAIN_METHODS
    jobs = []
    for n in sizes:
        for split in ("iid", "non_iid"):
            for seed in seeds:
                jobs += [Job(m, n, split, seed, settings.sync_every, "main") for m in methods]
        if n == sizes[0]:  # GASLoC against plain gossip at one step per communication
            jobs += [Job(m, n, "iid", seed, 1, "h1") for seed in seeds for m in H1_METHODS]
    large = {4: ("noloco", "gasloc_pairs")} if quick else LARGE_METHODS
    for n, names in large.items():
        jobs += [Job(m, n, "iid", 0, settings.sync_every, "large") for m in names]
    n = sizes[0]
    for method, (lrs, momenta) in TUNING_GRID.items():
        grid = [(lrs[0], momenta[0]), (lrs[-1], momenta[-1])] if quick else [(a, b) for a in lrs for b in momenta]
        jobs += [Job(tuned(method, a, b), n, "iid", 0, settings.sync_every, "tuning") for a, b in grid]
    # H against the run length: the defaults at half and at five times this H (9 outer steps in all)
    for h in (settings.sync_every // 2, settings.sync_every * 5):
        methods = ("noloco", "diloco") if quick else ("noloco", "diloco", "gasloc_pairs")
        jobs += [Job(m, n, "iid", 0, h, "h_study") for m in methods]
    # wire formats: the targets with every seed first, then the rest
    # (quick: DiLoCo and NoLoCo with the targets and float16, one seed)
    codec_methods = ("diloco", "noloco") if quick else CODEC_METHODS
    for first in (True, False):
        for seed in seeds:
            jobs += [Job(m, n, "iid", seed, settings.sync_every, "codecs", w)
                     for m in codec_methods for w in codec_variants(m, first)[: 1 if quick and not first else None]]
    # streaming fragments: every seed of every F, F = 1 first
    h = fragment_settings(settings).sync_every
    methods, counts = (("noloco",), (1, 4)) if quick else (FRAGMENT_METHODS, FRAGMENT_COUNTS)
    jobs += [Job(m, n, "iid", seed, h, "fragments", fragments=f) for f in counts for seed in seeds for m in methods]
    return jobs


def best_tuning_jobs(runs_dir: Path, settings: Settings, quick: bool) -> list[Job]:
    """Two more seeds for each method's best tuning configuration (by consensus loss)."""
    jobs = []
    for method in TUNING_GRID:
        runs = [json.loads(p.read_text()) for p in runs_dir.glob(f"tuning-{method}@*-s0.json")]
        if not runs:
            continue
        best = min(runs, key=lambda r: r["final"]["consensus"])
        seeds = (1,) if quick else (1, 2)
        jobs += [Job(best["method"], best["replicas"], "iid", seed, settings.sync_every, "tuning") for seed in seeds]
    return jobs
