"""B5's runs: the data, one configuration trained in the simulator (:func:`run_job`), and the
``processes`` part, the same configuration as real processes through Lightning (launched by
:mod:`benchmarks.harness`) against the simulator."""

from __future__ import annotations

import json
import statistics
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.b5_convergence.grid import CODECS, Job, Settings, fragment_settings, make_algorithm, model_settings

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


class OnDevice:
    """A replica's batches moved to ``device`` as they are drawn (the sampler stays reachable, so
    that the simulator still sets the epoch)."""

    def __init__(self, loader: Any, device: str) -> None:
        self.loader, self.device, self.sampler = loader, device, getattr(loader, "sampler", None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        return ((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in self.loader)


def inner_optimizer(settings: Settings) -> Any:
    """``settings.inner``'s optimizer and schedule for the simulator (None: the module's own, AdamW)."""
    if settings.inner == "adamw":
        return None
    if settings.inner != "adam":
        raise ValueError(f"inner must be 'adamw' or 'adam', got {settings.inner!r}")

    def adam(module: Any) -> dict[str, Any]:
        import torch

        from lightning_loco.examples.gpt import warmup_cosine

        optimizer = torch.optim.Adam(module.parameters(), lr=settings.lr)  # torch's defaults, no weight decay
        scheduler = warmup_cosine(optimizer, settings.warmup_steps, settings.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return adam


def run_job(job: Job, settings: Settings, out: str, threads: int, device: str = "cpu",
            precision: str = "32-true") -> dict[str, Any]:
    """Trains one configuration in the simulator and writes its record to ``out``. ``device`` and
    ``precision``: where the replicas train and how (the GPU quality run's "cuda" and "bf16-mixed").

    The fragments part measures at its evaluation points as training goes, and ends at ``max_steps``:
    with F > 1 a step taken as the end starts a round of every fragment, which an evaluation point
    must not add. It also keeps the replicas' spread after every step (its mean over the run: the
    fragments' rounds fall at different steps, so one step's spread is not comparable across F)."""
    import torch

    from lightning_loco.examples.gpt import GPT
    from lightning_loco.simulator import TrainingSimulator

    warnings.filterwarnings("ignore", message=".*batching rule.*")
    torch.set_num_threads(threads)
    parts, val, _ = load_data(settings)
    probe, final_probe = eval_batches(val, settings.eval_batches), eval_batches(val, settings.final_eval_batches)
    streaming = job.part == "fragments"
    if streaming:
        settings = fragment_settings(settings)
    settings = model_settings(job.model, settings)
    shards = shards_for(job, settings, parts)
    if device != "cpu":
        probe, final_probe = ([(x.to(device), y.to(device)) for x, y in b] for b in (probe, final_probe))
        shards = [OnDevice(s, device) for s in shards]
    torch.manual_seed(job.seed)
    model = GPT(**settings.model_kwargs).to(device)
    sim = TrainingSimulator(
        model, shards, make_algorithm(job.method), sync_every=job.sync_every, optimizers=inner_optimizer(settings),
        loss=gpt_loss, gradient_clip_val=1.0, gradient_averaging=job.method == "ddp",
        wire=CODECS[job.wire], precision=precision,
        fragments=job.fragments, max_steps=settings.steps if streaming else None, overlap_steps=job.overlap,
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
    spreads: list[float] = []  # the fragments part: after every step
    for k in range(settings.steps // settings.eval_every):
        t0 = time.perf_counter()
        if streaming:
            for _ in range(settings.eval_every):
                sim.step()  # the run's last step is the end (max_steps)
                spreads.append(sim.spread())
        else:
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
        "m_params": sum(p.numel() for p in model.parameters()) / 1e6,
        "batched": sim.batched, "seconds": time.perf_counter() - started,
        "peak_bytes": max((r.bytes_sent for d in sim.drivers for r in d.reports), default=0),
        "mean_spread": statistics.mean(spreads) if spreads else None,
        "seconds_per_step": timed / max(1, settings.steps - settings.eval_every),
    }
    Path(out).write_text(json.dumps(record))
    return record


# ----------------------------------------------------------------------------------------- real processes


def lightning_run(config: dict[str, Any]) -> None:
    """One real multi-process run, in the process that :func:`benchmarks.harness.run_lightning_processes`
    started (``--lightning-run``): Lightning's launcher forks the ranks, every rank saves its weights."""
    import lightning as L
    import torch

    from lightning_loco.examples.gpt import GPT
    from lightning_loco.examples.text import ByteTextDataModule

    settings = Settings(**config["settings"])
    L.seed_everything(config["seed"], verbose=False)
    model = GPT(**settings.model_kwargs)
    data = ByteTextDataModule(block_size=settings.block_size, batch_size=settings.batch_size, holdout="per_file")
    torch.set_num_threads(1)
    trainer = harness.quiet_trainer(
        accelerator="cpu", devices=config["replicas"], max_steps=settings.steps, gradient_clip_val=1.0,
        strategy=harness.strategy(config["method"], sync_every=settings.sync_every, average_at_end=False,
                                  start_method="fork"),
        callbacks=[harness.save_weights(Path(config["out"]))],
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
        saved, wall = harness.run_lightning_processes("benchmarks.b5_convergence", config, out, n,
                                                      what=f"the {method} run")
        losses = [probe_loss(s["state"]) for s in saved]
        consensus = probe_loss({k: torch.stack([s["state"][k].float() for s in saved]).mean(0)
                                for k in saved[0]["state"]})
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
