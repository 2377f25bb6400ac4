"""B5: does it train as well as the papers say? Convergence at equal tokens.

    python -m benchmarks.b5_convergence                        # the grid: under an hour on 2 CPU cores
    python -m benchmarks.b5_convergence --parts tuning h_study  # the tuning experiment: ~12 min more
    python -m benchmarks.b5_convergence --quick                 # a smoke run of every part, under a minute
    python -m benchmarks.b5_convergence --parts codecs          # wire formats: 45 runs, ~40 min on 2 cores

Every method trains the same byte-level GPT on Shakespeare from the same start, with the same
inner optimizer (AdamW, warmup then cosine), the same batch per replica and the same number of
inner steps, so every run sees the same tokens. Methods:

* ``ddp``: gradients averaged at every step (the same global batch);
* ``independent``: replicas that never communicate;
* ``diloco``, ``noloco``, ``gasloc_pairs`` (random pairs), ``gasloc_ring``: paper defaults except H;
* ``gossip_pairs``, ``gossip_ring``: plain gossip averaging, a D-SGD-style baseline: GASLoC with
  outer momentum γ = 0, η = 1 and α = ½, i.e. each matched pair replaces its weights by their
  average, with no outer step and no momentum.

Data splits: ``iid`` (every replica samples the whole training text, as Lightning's
DistributedSampler gives it) and ``non_iid`` (each replica reads only its own plays; plays are dealt
to replicas by size). The validation set is the last 5 % of every play, common to all runs.

Runs go through :class:`lightning_loco.simulator.TrainingSimulator`, which runs the strategies' own
driver and outer step for N replicas in one process (``tests/test_simulator.py`` shows it follows
the multi-process strategies step by step). The ``processes`` part trains the same configuration with
real processes through Lightning at N = 4 and 8 and compares loss and time per step.

The ``codecs`` part trains DiLoCo, NoLoCo and GASLoC (random pairs) at N = 4 on iid shards with
every wire format (``CODECS``: float32, bfloat16, float16, int8 with the default error feedback, and
int8 with it switched the other way), 3 seeds each, and plots the loss against the bytes sent.

Each finished run is kept as one JSON file in ``b5_runs/`` next to the results, so an interrupted
run resumes where it stopped (``--fresh`` starts over). The summary is ``b5_convergence.json`` with
tables and PNGs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, results_dir, table, write_json

# ----------------------------------------------------------------------------------------- settings


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

PARTS = ("main", "h1", "large", "tuning", "h_study", "codecs", "processes")
DEFAULT_PARTS = ("main", "h1", "large", "processes")
MAIN_METHODS = ("ddp", "independent", "diloco", "noloco", "gasloc_pairs", "gasloc_ring", "gossip_pairs")
LARGE_METHODS = {16: ("ddp", "independent", "diloco", "noloco", "gasloc_pairs"), 64: ("diloco", "noloco", "gasloc_pairs")}
# At H = 1, also GASLoC with gossip's η = 1 and α = ½: then only the outer momentum γ differs from
# plain gossip, the paper's claim of momentum as gossip acceleration in isolation.
H1_METHODS = ("gasloc_ring", "gossip_ring", "gasloc_pairs", "gossip_pairs", "gasloc_ring_matched", "gasloc_pairs_matched")


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
    "float32": ("float32", None, None),
    "bfloat16": ("bfloat16", None, None),
    "int8": ("float32", "int8", None),
    "float16": ("float16", None, None),
    "int8_ef": ("float32", "int8", True),  # error feedback on weights (NoLoCo, GASLoC)
    "int8_no_ef": ("float32", "int8", False),  # DiLoCo without its error feedback
}
CODEC_METHODS = ("diloco", "noloco", "gasloc_pairs")


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

    if "@" in method:  # a tuning variant: "noloco@lr=0.5,m=0.25"
        base, spec = method.split("@")
        values = dict(item.split("=") for item in spec.split(","))
        lr, momentum = float(values["lr"]), float(values["m"])
        if base == "diloco":
            return DiLoCo(outer_lr=lr, outer_momentum=momentum)
        if base == "noloco":
            return NoLoCo(outer_lr=lr, outer_momentum=momentum)
        return GASLoC(topology="random_pairs", outer_lr=lr, outer_momentum=momentum)
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


@dataclass(frozen=True)
class Job:
    method: str
    replicas: int
    split: str
    seed: int
    sync_every: int
    part: str  # "main", "h1", "large", "tuning", "h_study" or "codecs"
    wire: str = "float32"  # a key of CODECS

    @property
    def name(self) -> str:
        wire = "" if self.part != "codecs" else f"-{self.wire}"
        return f"{self.part}-{self.method}{wire}-n{self.replicas}-{self.split}-h{self.sync_every}-s{self.seed}"


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


# ----------------------------------------------------------------------------------------- data


def load_data(settings: Settings) -> tuple[list[Any], Any, list[int]]:
    """The plays' training parts (token tensors), the validation blocks and each play's size."""
    from lightning_loco.examples.text import TokenBlocks, shakespeare_files, split_each_file

    parts, val = split_each_file(shakespeare_files(), 0.05)
    return parts, TokenBlocks(val, settings.block_size), [p.numel() for p in parts]


def eval_batches(val: Any, count: int) -> list[Any]:
    """``count`` batches of 16 blocks spaced evenly over the validation set (every play)."""
    import torch

    total = count * 16
    index = torch.linspace(0, len(val) - 1, total).long().tolist()
    blocks = [val[i] for i in index]
    return [(torch.stack([x for x, _ in blocks[k : k + 16]]), torch.stack([y for _, y in blocks[k : k + 16]]))
            for k in range(0, total, 16)]


def shards_for(job: Job, settings: Settings, parts: list[Any]) -> list[Any]:
    import torch
    from torch.utils.data import DataLoader

    from lightning_loco.examples.text import TokenBlocks, assign_files, join
    from lightning_loco.simulator import distributed_shards

    if job.split == "iid":
        return distributed_shards(TokenBlocks(join(parts), settings.block_size), job.replicas, settings.batch_size,
                                  shuffle=True, seed=job.seed)
    groups = assign_files([p.numel() for p in parts], job.replicas)
    return [
        DataLoader(TokenBlocks(join([parts[k] for k in group]), settings.block_size), batch_size=settings.batch_size,
                   shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1000 * job.seed + i))
        for i, group in enumerate(groups)
    ]


# ----------------------------------------------------------------------------------------- one run


def gpt_loss(module: Any, batch: Any) -> Any:
    return module.loss(batch)


def run_job(job: Job, settings: Settings, out: str, threads: int) -> dict[str, Any]:
    """Trains one configuration in the simulator and writes its record to ``out``."""
    import torch

    from lightning_loco.examples.gpt import GPT
    from lightning_loco.simulator import TrainingSimulator

    warnings.filterwarnings("ignore", message=".*batching rule.*")
    torch.set_num_threads(threads)
    parts, val, _ = load_data(settings)
    probe, final_probe = eval_batches(val, settings.eval_batches), eval_batches(val, settings.final_eval_batches)
    torch.manual_seed(job.seed)
    model = GPT(**settings.model_kwargs)
    wire_dtype, compression, error_feedback = CODECS[job.wire]
    sim = TrainingSimulator(
        model, shards_for(job, settings, parts), make_algorithm(job.method), sync_every=job.sync_every,
        loss=gpt_loss, gradient_clip_val=1.0, gradient_averaging=job.method == "ddp",
        wire_dtype=wire_dtype, compression=compression, error_feedback=error_feedback,
    )
    tokens_per_step = job.replicas * settings.batch_size * settings.block_size
    curve: list[dict[str, Any]] = []
    # the mean replica over at most 16 replicas, evenly spaced (N = 64: evaluating all would cost more
    # than training); the consensus always averages all of them
    chosen = sorted({round(k * (job.replicas - 1) / 15) for k in range(16)}) if job.replicas > 16 else None

    def measure(s: TrainingSimulator, batches: list[Any]) -> dict[str, Any]:
        """At an outer-step boundary that was taken as the end of training: the live weights (the
        default final landing, without the momentum extrapolation) and the weights the papers'
        plain outer step gave (``outer_*``; the same for methods without an outer step)."""
        ev = s.evaluate(batches, replicas=chosen)
        kept = s.outer_weights()
        outer = ev if kept is None else s.evaluate(batches, weights=kept, replicas=chosen)
        return {
            "step": s.step_count, "tokens": s.step_count * tokens_per_step,
            "bytes_per_replica": statistics.mean(s.bytes_sent()), "mean_replica": ev.mean_replica_loss,
            "consensus": ev.consensus_loss, "outer_mean_replica": outer.mean_replica_loss,
            "outer_consensus": outer.consensus_loss, "spread": s.spread(),
            "lr": s.lr_history[-1] if s.lr_history else s.optimizers[0].param_groups[0]["lr"],
            "replicas": ev.replica_losses,
        }

    started = time.perf_counter()
    curve.append(measure(sim, probe))
    timed = 0.0
    for k in range(settings.steps // settings.eval_every):
        t0 = time.perf_counter()
        sim.run(settings.eval_every - 1)
        sim.step(last=True)  # as if training ended here; the next step takes the landing back
        if k:  # the first block pays one-time costs (torch.func set-up): not timed
            timed += time.perf_counter() - t0
        last = sim.step_count == settings.steps
        curve.append(measure(sim, final_probe if last else probe))
    sim.finish()
    end = curve[-1]
    # the free local signal: each replica's distance from the peers it met, per round, with the LR then
    peer = []
    if sim.drivers:
        lrs = sim.lr_history
        for t in range(len(sim.drivers[0].reports)):
            values = [d.reports[t].peer_distance for d in sim.drivers if d.reports[t].peer_distance is not None]
            if values:
                step = sim.drivers[0].reports[t].inner_step
                peer.append({"step": step, "peer_distance": statistics.mean(values), "lr": lrs[step - 1]})
    # what the codec lost of each payload against one outer step's change ‖θ − anchor‖ (see docs/compression.md)
    errors = [(r.compression_error_norm, r.pseudo_gradient_norm) for d in sim.drivers for r in d.reports
              if r.compression_error_norm is not None and r.pseudo_gradient_norm]
    record = {
        **asdict(job), "name": job.name, "settings": asdict(settings), "curve": curve, "peer_distance": peer,
        "final": {"mean_replica": end["mean_replica"], "consensus": end["consensus"],
                  "outer_mean_replica": end["outer_mean_replica"], "outer_consensus": end["outer_consensus"],
                  "replicas": end["replicas"], "spread": sim.spread(),
                  "bytes_per_replica": statistics.mean(sim.bytes_sent()),
                  "tokens": settings.steps * tokens_per_step},
        "compression_error_norm": statistics.mean(e for e, _ in errors) if errors else None,
        "compression_error_ratio": statistics.mean(e / g for e, g in errors) if errors else None,
        "batched": sim.batched, "seconds": time.perf_counter() - started,
        "seconds_per_step": timed / max(1, settings.steps - settings.eval_every),
    }
    Path(out).write_text(json.dumps(record))
    return record


# ----------------------------------------------------------------------------------------- real processes


def lightning_run(config: dict[str, Any]) -> None:
    """One real multi-process run (this module re-run as a script): every rank writes its weights."""
    import lightning as L
    import torch

    import lightning_loco
    from lightning_loco.examples.gpt import GPT
    from lightning_loco.examples.text import ByteTextDataModule

    settings = Settings(**config["settings"])
    out = Path(config["out"])

    class SaveWeights(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.started = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            seconds = time.perf_counter() - self.started
            torch.save({"state": pl_module.state_dict(), "seconds": seconds}, out / f"rank{trainer.global_rank}.pt")

    strategy_cls = {"noloco": lightning_loco.NoLoCoStrategy, "diloco": lightning_loco.DiLoCoStrategy}[config["method"]]
    L.seed_everything(config["seed"], verbose=False)
    model = GPT(**settings.model_kwargs)
    data = ByteTextDataModule(block_size=settings.block_size, batch_size=settings.batch_size, holdout="per_file")
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu", devices=config["replicas"], max_steps=settings.steps, gradient_clip_val=1.0,
        strategy=strategy_cls(sync_every=settings.sync_every, average_at_end=False, start_method="fork"),
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveWeights()],
    )
    trainer.fit(model, datamodule=data)


def processes_part(settings: Settings, quick: bool, folder: Path) -> list[dict[str, Any]]:
    """The same configuration as real processes and in the simulator: final losses and time per step."""
    import torch

    from lightning_loco.examples.gpt import GPT

    rows = []
    cases = [("noloco", 2)] if quick else [("noloco", 4), ("diloco", 4), ("noloco", 8), ("diloco", 8)]
    _, val, _ = load_data(settings)
    final_probe = eval_batches(val, settings.final_eval_batches)
    model = GPT(**settings.model_kwargs).eval()

    @torch.no_grad()
    def probe_loss(state: dict[str, Any]) -> float:
        model.load_state_dict(state)
        return statistics.mean(gpt_loss(model, b).item() for b in final_probe)

    for method, n in cases:
        out = folder / f"processes-{method}-n{n}"
        out.mkdir(parents=True, exist_ok=True)
        config = {"settings": asdict(settings), "out": str(out), "method": method, "replicas": n, "seed": 0}
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.b5_convergence", "--lightning-run", json.dumps(config)],
                              cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"the {method} run with {n} processes failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        saved = [torch.load(out / f"rank{r}.pt") for r in range(n)]
        losses = [probe_loss(s["state"]) for s in saved]
        consensus = probe_loss({k: torch.stack([s["state"][k].float() for s in saved]).mean(0) for k in saved[0]["state"]})
        # the simulator on the same configuration, in this process (both threads, as the processes share them)
        job = Job(method, n, "iid", 0, settings.sync_every, "processes")
        sim_record = run_job(job, settings, str(out / "simulator.json"), threads=2)
        rows.append({
            "method": method, "replicas": n,
            "processes_mean_replica": statistics.mean(losses), "processes_consensus": consensus,
            "simulator_mean_replica": sim_record["final"]["mean_replica"],
            "simulator_consensus": sim_record["final"]["consensus"],
            "processes_s_per_step": max(s["seconds"] for s in saved) / settings.steps,
            "processes_wall_s": wall,
            "simulator_s_per_step": sim_record["seconds_per_step"],
        })
        rows[-1]["time_ratio"] = rows[-1]["processes_s_per_step"] / rows[-1]["simulator_s_per_step"]
    return rows


# ----------------------------------------------------------------------------------------- summary


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
    for (part, n, split, h, method), runs in sorted(groups.items(), key=lambda kv: (*kv[0][:4], MAIN_ORDER.get(kv[0][4], 99))):
        spread_lr = [correlation([p["spread"] for p in r["curve"][1:]], [p["lr"] for p in r["curve"][1:]]) for r in runs]
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
                f"N={n} {split} {method} ({key}): {verdict} independent by {gain:+.3f} (seed half-ranges sum {noise:.3f}); "
                f"trails DDP by {r[key]['mean'] - ddp[key]['mean']:+.3f} ({100 * (r[key]['mean'] / ddp[key]['mean'] - 1):+.1f} %)"
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
                    lines.append(f"H=1 N={n} {method} ({key}): {verdict} plain gossip by {diff:+.3f} (noise {noise:.3f})")
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


def codec_plot(records: list[dict[str, Any]], folder: Path) -> list[str]:
    """Consensus loss against MB sent per replica, one panel per method, one line per wire format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["part"] == "codecs"]
    if not runs:
        return []
    methods = [m for m in CODEC_METHODS if any(r["method"] == m for r in runs)]
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.8), squeeze=False)
    for ax, method in zip(axes[0], methods):
        tops: list[float] = []
        for k, wire in enumerate(CODECS):
            chosen = [r for r in runs if r["method"] == method and r.get("wire") == wire]
            if not chosen:
                continue
            points = list(zip(*[[p["consensus"] for p in r["curve"]] for r in chosen]))
            mean = [statistics.mean(p) for p in points]
            mbytes = [p["bytes_per_replica"] / 1e6 for p in chosen[0]["curve"]]
            sent = [(b, m) for b, m in zip(mbytes, mean) if b > 0]
            ax.plot([b for b, _ in sent], [m for _, m in sent], marker=".", lw=1.1, color=f"C{k}",
                    label=f"{wire} ({len(chosen)} seeds)")
            tops.append(max(m for _, m in sent[1:]) if len(sent) > 1 else sent[-1][1])
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per replica (log)")
        ax.set_ylabel("consensus validation loss")
        ax.set_title(f"{method}, N=4 iid: loss against bytes", fontsize=9)
        ax.set_ylim(top=max(tops) + 0.02)  # from the second measuring point: the first one dwarfs the rest
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = folder / "b5_codecs.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path.name]


def plots(records: list[dict[str, Any]], folder: Path, quick: bool) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    mains = [r for r in records if r["part"] == "main"]
    for n in sorted({r["replicas"] for r in mains}):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
        for col, split in enumerate(("iid", "non_iid")):
            for method in MAIN_METHODS:
                runs = [r for r in mains if r["replicas"] == n and r["split"] == split and r["method"] == method]
                if not runs:
                    continue
                points = list(zip(*[[p["consensus"] for p in r["curve"]] for r in runs]))
                mean = [statistics.mean(p) for p in points]
                tokens = [p["tokens"] / 1e6 for p in runs[0]["curve"]]
                mbytes = [p["bytes_per_replica"] / 1e6 for p in runs[0]["curve"]]
                color = f"C{MAIN_METHODS.index(method)}"  # the same colour for a method in every panel
                axes[0][col].plot(tokens, mean, label=method, lw=1.2, color=color)
                if method != "independent":  # it sends nothing: no point on a log axis of bytes
                    sent = [(b, m) for b, m in zip(mbytes, mean) if b > 0]
                    axes[1][col].plot([b for b, _ in sent], [m for _, m in sent], label=method, lw=1.2, marker=".",
                                      color=color)
            axes[0][col].set_title(f"N={n}, {split}: consensus validation loss (mean of seeds)", fontsize=9)
            axes[0][col].set_xlabel("tokens (millions, all replicas)")
            axes[1][col].set_xscale("log")
            axes[1][col].set_xlabel("MB sent per replica (log)")
            for ax in (axes[0][col], axes[1][col]):
                ax.set_ylabel("loss")
                ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"b5_convergence_n{n}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path.name)
    return written


def report(folder: Path, runs_dir: Path, settings: Settings, quick: bool, process_rows: list[dict[str, Any]]) -> None:
    records = [json.loads(p.read_text()) for part in PARTS[:-1] for p in sorted(runs_dir.glob(f"{part}-*.json"))]
    rows = summarise(records)
    flat = [{**r, "consensus_mean": r["consensus"]["mean"], "consensus_pm": r["consensus"]["half_range"],
             "replica_mean": r["mean_replica"]["mean"], "replica_pm": r["mean_replica"]["half_range"],
             "outer_consensus_mean": r["outer_consensus"]["mean"]} for r in rows]
    print(table(flat, [
        ("part", "part", "s"), ("replicas", "N", "d"), ("split", "split", "s"), ("H", "H", "d"), ("method", "method", "s"),
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
            ("processes_consensus", "processes: consensus", ".3f"), ("simulator_consensus", "simulator: consensus", ".3f"),
            ("processes_mean_replica", "processes: replica", ".3f"), ("simulator_mean_replica", "simulator: replica", ".3f"),
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
    pngs = plots(records, folder, quick) + codec_plot(records, folder)
    write_json("b5_convergence.json", {
        "settings": asdict(settings), "quick": quick, "rows": rows, "verdicts": lines, "codecs": codecs, "processes": process_rows,
        "plots": pngs, "runs": len(records),
        # per run: the measuring points (the full records, with per-replica losses and every round's
        # peer distance, stay in the runs folder)
        "curves": {r["name"]: [{k: round(v, 5) for k, v in p.items() if k != "replicas"} for p in r["curve"]]
                   for r in records},
    }, folder)
    print(f"wrote {folder / 'b5_convergence.json'} and {', '.join(pngs)}")


# ----------------------------------------------------------------------------------------- main


def run_all(pool: Any, jobs: list[Job], settings: Settings, runs_dir: Path, started: float) -> None:
    futures = [pool.submit(run_job, j, settings, str(runs_dir / f"{j.name}.json"), 1) for j in jobs]
    for k, future in enumerate(futures):
        record = future.result()
        print(f"[{k + 1}/{len(jobs)} {time.perf_counter() - started:6.0f} s] {record['name']}: consensus "
              f"{record['final']['consensus']:.3f} (plain outer end {record['final']['outer_consensus']:.3f}), "
              f"mean replica {record['final']['mean_replica']:.3f} ({record['seconds']:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model and grid: a smoke run of every part")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel, one thread each (default 2)")
    parser.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS), choices=PARTS,
                        help=f"default: {' '.join(DEFAULT_PARTS)} (--quick: all)")
    parser.add_argument("--fresh", action="store_true", help="forget finished runs and start over")
    parser.add_argument("--lightning-run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lightning_run:
        lightning_run(json.loads(args.lightning_run))
        return
    settings = QUICK if args.quick else FULL
    if args.quick and args.parts == list(DEFAULT_PARTS):
        args.parts = list(PARTS)
    folder = results_dir(args.quick)
    runs_dir = folder / ("b5_runs_quick" if args.quick else "b5_runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        for p in runs_dir.glob("*.json"):
            p.unlink()
    todo = [j for j in jobs_for(settings, args.quick) if j.part in args.parts and not (runs_dir / f"{j.name}.json").exists()]
    print(f"B5 on {machine()}: {len(todo)} runs to do, {args.workers} at a time", flush=True)
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        run_all(pool, todo, settings, runs_dir, started)
        if "tuning" in args.parts:
            extra = [j for j in best_tuning_jobs(runs_dir, settings, args.quick) if not (runs_dir / f"{j.name}.json").exists()]
            run_all(pool, extra, settings, runs_dir, started)
    process_rows: list[dict[str, Any]] = []
    process_file = runs_dir / "processes.json"
    if process_file.exists() and not args.fresh:  # kept from an earlier run of this part
        process_rows = json.loads(process_file.read_text())
    elif "processes" in args.parts:
        process_rows = processes_part(settings, args.quick, runs_dir)
        process_file.write_text(json.dumps(process_rows))
    report(folder, runs_dir, settings, args.quick, process_rows)
    print(f"B5 took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
