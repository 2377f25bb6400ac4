"""The GPU check: one prepared run of the CUDA and NCCL paths on a single GPU, in under 6 minutes.

    python -m benchmarks.gpu_check                   # every part; on a machine with CUDA
    python -m benchmarks.gpu_check --parts 1 3       # some parts only

Parts (each with a time budget; a part that fails or runs out of time is recorded and the others go on):

1. **Inner-step overhead.** A GPT of about 100 M parameters (the example GPT scaled up) in
   ``bf16-mixed``: tokens per second of NoLoCo with N = 1 (outer steps at H = 50, outer state on the
   GPU and on the CPU) against a plain single-device Trainer, interleaved repeats, as ratios.
2. **No host synchronisation in an inner step.** Steps run under ``torch.cuda.set_sync_debug_mode``
   and with reads of tensor values to the host (``item``, ``tolist``, ``cpu``, ...) counted: per inner
   step for the plain Trainer and the strategies, and inside the strategy's own per-step hooks.
3. **Memory.** Peak GPU memory of NoLoCo, GASLoC and DiLoCo (N = 1) against plain, outer state on
   the GPU and on the CPU, in float32 model copies.
4. **Two processes on one GPU over gloo**, with and without ``overlap_steps``: outer-step time, the
   pinned staging buffers (allocated once, reused), and that the replicas trained and agree at the end.
5. **The NCCL path on a world of one**: NoLoCo (groups of one) and DiLoCo with ``overlap_steps`` (an
   asynchronous NCCL all-reduce completed through a CUDA event), the transport alone, and a new
   group's warm-up.

The data are token sequences drawn on the GPU (arithmetic progressions modulo 256, a pattern the
model can learn, so its loss falls): no files, no network, no host work per step. Prints one table and writes
``benchmarks/results/gpu_check.json``. Without CUDA it runs a CPU dry run instead (a tiny model, a
few steps, the same code paths where they exist: gloo in place of NCCL, the staging buffers unpinned),
writes its JSON to a temporary folder (or ``$LOCO_BENCH_RESULTS``) and says that it did not run on a
GPU. The exit status is 1 when a part or a run inside one failed, after the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from benchmarks.common import results_dir, table, write_json

TOTAL_BUDGET_S = 330.0  # all parts together: with the grace below and start-up, under 6 minutes
GRACE_S = 15.0  # a part's process is stopped this long after its budget (an isolated part)
START_S = 10.0  # of a part's budget, what starting its process (imports, CUDA) takes
# part -> (title, time budget in seconds on one H200)
PARTS: dict[int, tuple[str, float]] = {
    1: ("inner-step overhead", 110.0),
    2: ("host synchronisation", 50.0),
    3: ("peak memory", 60.0),
    4: ("two processes on one GPU (gloo)", 90.0),
    5: ("NCCL on one GPU", 45.0),
}


@dataclass(frozen=True)
class Setting:
    """The model and run sizes of one mode (GPU, or the CPU dry run)."""

    accelerator: str
    precision: str
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    warmup: int  # steps not timed
    overhead_steps: int  # part 1: timed steps per run
    overhead_repeats: int
    sync_every: int  # part 1's H
    short_steps: int  # parts 2, 3, 5: steps per run
    short_sync_every: int
    pair_steps: int  # part 4
    pair_sync_every: int
    pair_overlap: int
    lr: float


GPU = Setting("gpu", "bf16-mixed", 14, 12, 768, 256, 32, 20, 150, 3, 50, 30, 10, 60, 20, 4, 1e-3)
DRY = Setting("cpu", "32-true", 1, 2, 32, 16, 4, 2, 8, 1, 4, 8, 3, 8, 4, 1, 1e-2)


class Budget:
    """A part's time budget: parts ask between runs whether they may start another."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def allows(self, fraction: float, what: str) -> bool:
        """Whether a run expected to take ``fraction`` of the budget still fits; says so if not."""
        if self.left() >= fraction * self.seconds:
            return True
        say(f"  skipping {what}: {self.left():.0f} s left of the part's {self.seconds:.0f} s")
        return False


def say(message: str) -> None:
    """A progress line with the time, so that a partial log shows how far the run came."""
    print(f"[{datetime.now(timezone.utc):%H:%M:%S}] {message}", flush=True)


# ---------------------------------------------------------------- model and data


def make_model(setting: Setting, steps: int) -> Any:
    """The example GPT at the setting's size, trained on token progressions drawn on its device."""
    import torch

    from lightning_loco.examples.gpt import GPT

    class ProgressionGPT(GPT):
        """Each sequence is s, s + k, s + 2k, ... mod 256 (s, k random): drawn on the device at every step,
        so a step reads nothing from the host. The loss is kept on the device; nothing is logged."""

        def __init__(self) -> None:
            super().__init__(vocab_size=256, block_size=setting.block_size, n_layer=setting.n_layer,
                             n_head=setting.n_head, n_embd=setting.n_embd, lr=setting.lr,
                             warmup_steps=min(10, steps // 4 + 1),
                             max_steps=max(steps, 20))
            self.losses: list[Any] = []
            self._generator: Any | None = None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self._generator is None:
                self._generator = torch.Generator(device=self.device)
                self._generator.manual_seed(1234 + self.global_rank)
            b, t = setting.batch_size, setting.block_size
            start = torch.randint(0, 256, (b, 1), device=self.device, generator=self._generator)
            stride = torch.randint(1, 8, (b, 1), device=self.device, generator=self._generator)
            tokens = (start + stride * torch.arange(t + 1, device=self.device)) % 256
            loss = self.loss((tokens[:, :-1], tokens[:, 1:]))
            self.losses.append(loss.detach())
            return loss

    return ProgressionGPT()


def step_loader(steps: int) -> Any:
    """One placeholder batch per step (the model draws its own tokens)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)


def numel(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def trained(model: Any) -> dict[str, float]:
    """Mean loss of the first and the last few steps (read once, after training)."""
    import torch

    losses = torch.stack(model.losses).float().cpu().tolist()
    k = max(1, min(5, len(losses) // 4))
    return {"loss_first": statistics.mean(losses[:k]), "loss_last": statistics.mean(losses[-k:])}


def strategy_for(name: str, sync_every: int, **kwargs: Any) -> Any:
    """"plain", "noloco", "gasloc" or "diloco" (kwargs go to the strategy)."""
    import lightning_loco

    if name == "plain":
        return "auto"
    cls = {"noloco": lightning_loco.NoLoCoStrategy, "gasloc": lightning_loco.GASLoCStrategy,
           "diloco": lightning_loco.DiLoCoStrategy}[name]
    return cls(sync_every=sync_every, timeout=timedelta(seconds=120), **kwargs)


def fit(setting: Setting, strategy: Any, steps: int, callbacks: list[Any] = (), **trainer_kwargs: Any) -> Any:
    """One single-process fit; returns the trained model. The world-of-one process group a strategy
    creates is destroyed afterwards, so that the next fit can pick another backend."""
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_loco.flat import FlatParameters

    os.environ.pop("MASTER_PORT", None)  # a fresh port for every world of one
    model = make_model(setting, steps)
    trainer = L.Trainer(
        strategy=strategy, accelerator=setting.accelerator, devices=1, precision=setting.precision,
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=list(callbacks),
        **trainer_kwargs,
    )
    # Without CUDA, runs with the outer state on the CPU take the path of CUDA parameters through the
    # staging buffer (which the model's parameters on the CPU would skip).
    staged = not torch.cuda.is_available() and str(getattr(strategy, "_outer_state_device", None)) == "cpu"
    FlatParameters.stage_cpu_params = staged
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single replica.*")
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            trainer.fit(model, train_dataloaders=step_loader(steps))
    finally:
        FlatParameters.stage_cpu_params = False
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    model.trainer_strategy = trainer.strategy
    return model


def guarded(errors: dict[str, str], config: str, run: Callable[[], Any]) -> Any:
    """``run()``, or None after recording its error under ``config``: one failed run does not end
    its part."""
    try:
        return run()
    except Exception as err:  # noqa: BLE001 (recorded, reported in the table and the JSON)
        errors[config] = f"{type(err).__name__}: {err}"[:600]
        say(f"  {config} failed: {errors[config][:200]}")
        free_memory()
        return None


def free_port() -> int:
    """A port the system says is free (never a fixed one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    """Between runs on a GPU: the last run's memory back to the device (nothing to do on the CPU)."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- part 1: inner-step overhead


def part_overhead(setting: Setting, budget: Budget) -> dict[str, Any]:
    import lightning as L

    class Window(L.Callback):
        """Wall time of the steps after warm-up, with the device synchronised at both ends."""

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == setting.warmup:
                cuda_sync()
                self.start = time.perf_counter()
                self.outer_before = getattr(trainer.strategy, "outer_steps", 0)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == trainer.max_steps - 1:
                cuda_sync()
                self.seconds = time.perf_counter() - self.start
                self.outer = getattr(trainer.strategy, "outer_steps", 0) - self.outer_before

    h = setting.sync_every
    configs: dict[str, Callable[[], Any]] = {
        "plain": lambda: strategy_for("plain", h),
        "noloco-1": lambda: strategy_for("noloco", h),
        "noloco-1-cpu-state": lambda: strategy_for("noloco", h, outer_state_device="cpu"),
    }
    steps = setting.warmup + setting.overhead_steps
    tokens = setting.overhead_steps * setting.batch_size * setting.block_size
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    errors: dict[str, str] = {}
    params = 0
    for rep in range(setting.overhead_repeats):
        if rep and not budget.allows(1.1 / setting.overhead_repeats, f"repeats {rep + 1}+"):
            break
        for config, make in configs.items():  # interleaved: a drift in the machine hits all alike
            window = Window()
            model = guarded(errors, config, lambda make=make, window=window: fit(setting, make(), steps, [window]))
            if model is None:
                continue
            samples[config].append({"tokens_per_s": tokens / window.seconds, "outer_steps": window.outer,
                                    "s_per_step": window.seconds / setting.overhead_steps})
            say(f"part 1: repeat {rep + 1} {config}: {samples[config][-1]['tokens_per_s']:.0f} tokens/s")
            params = numel(model)
            del model
            free_memory()
    plain = [s["tokens_per_s"] for s in samples["plain"]]
    rows = {}
    for config, runs in samples.items():
        if not runs:
            continue
        rates = [s["tokens_per_s"] for s in runs]
        row: dict[str, Any] = {"tokens_per_s": summary(rates), "outer_steps_timed": runs[0]["outer_steps"]}
        if config != "plain" and len(runs) == len(plain):
            pairs = [r / p for r, p in zip(rates, plain)]  # repeat by repeat: neighbours in time
            row["ratio"] = statistics.median(rates) / statistics.median(plain)
            row["ratio_per_repeat"] = summary(pairs)
            if runs[0]["outer_steps"]:
                extra = [(s["s_per_step"] - p["s_per_step"]) * setting.overhead_steps / s["outer_steps"]
                         for s, p in zip(runs, samples["plain"])]
                row["outer_step_cost_s"] = summary(extra)  # time per step over plain, per outer step
        rows[config] = row
    return {"parameters": params, "sync_every": h, "steps_timed": setting.overhead_steps,
            "tokens_per_step": setting.batch_size * setting.block_size, "repeats": len(plain), "configs": rows,
            "errors": errors}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ---------------------------------------------------------------- part 2: host synchronisation

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class HostReadCounter:
    """Counts reads of tensor values to the host (``Tensor.item``, ``tolist``, ``cpu``, ``numpy``,
    ``bool``/``float``/``int`` of a tensor) while active: on a CUDA tensor each one synchronises the
    host with the device. ``device_type``: count only tensors on that device type (None: all)."""

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type
        self.count = 0
        self.where: list[str] = []
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        import torch

        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))

    def uninstall(self) -> None:
        import torch

        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Any) -> Any:
        counter = self

        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if counter.active and (counter.device_type is None or tensor.device.type == counter.device_type):
                counter.count += 1
                if len(counter.where) < 20:
                    counter.where.append(f"Tensor.{name} at {_caller()}")
            return original(tensor, *args, **kwargs)

        return counted

    active = False

    @contextmanager
    def counting(self) -> Iterator[HostReadCounter]:
        self.install()
        self.active = True
        try:
            yield self
        finally:
            self.active = False
            self.uninstall()


def _caller() -> str:
    """The first frame outside this file and torch: where a host read came from."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and f"{os.sep}torch{os.sep}" not in path:
            return f"{Path(path).name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def rounds_seen(owner: Any) -> tuple[int, int]:
    """(rounds started, rounds landed) of a strategy or a driver: a step that changes either is an
    outer step (with ``overlap_steps`` a round lands τ steps after it started)."""
    return len(getattr(owner, "rounds_started", ())), len(getattr(owner, "outer_step_reports", getattr(owner, "reports", ())))


def part_host_sync(setting: Setting, budget: Budget) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_loco.monitoring import OuterStepMonitor

    on_gpu = torch.cuda.is_available()
    warm = max(2, setting.warmup // 4)  # the first steps synchronise while CUDA libraries start

    class Count(L.Callback):
        """Per step after warm-up: host reads (and, on CUDA, synchronisations reported by
        ``set_sync_debug_mode``), whole step and inside the strategy's per-step hooks."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.reads = HostReadCounter("cuda" if on_gpu else None)
            self.hook_reads = HostReadCounter("cuda" if on_gpu else None)
            self.wrapped = False

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            driver = getattr(trainer.strategy, "driver", None)
            if driver is not None and not self.wrapped:  # our per-step hooks, counted on their own
                self.wrapped = True
                for name in ("after_inner_step", "restore_outer_weights"):
                    setattr(driver, name, self._counted(getattr(driver, name)))
            if batch_idx < warm:
                return
            self.outer_before = rounds_seen(trainer.strategy)
            self.hook_before = self.hook_reads.count
            self.reads.count = 0
            self.reads.install()
            self.reads.active = True
            self.caught = warnings.catch_warnings(record=True)
            self.warned = self.caught.__enter__()
            warnings.simplefilter("always")
            if on_gpu:
                torch.cuda.set_sync_debug_mode("warn")

        def _counted(self, hook: Any) -> Any:
            def counted(*args: Any, **kwargs: Any) -> Any:
                outer_before = rounds_seen(hook.__self__)
                self.hook_reads.install()
                self.hook_reads.active = True
                before = self.hook_reads.count
                try:
                    return hook(*args, **kwargs)
                finally:
                    self.hook_reads.active = False
                    self.hook_reads.uninstall()
                    if rounds_seen(hook.__self__) != outer_before:  # a round started or landed: an outer step
                        self.hook_reads.count = before

            return counted

        def cleanup(self) -> None:
            """After a failed run: sync debugging off, ``Tensor`` methods restored."""
            if on_gpu:
                torch.cuda.set_sync_debug_mode(0)
            for counter in (self.hook_reads, self.reads):
                counter.active = False
                counter.uninstall()
            if getattr(self, "caught", None) is not None:
                self.caught.__exit__(None, None, None)
                self.caught = None

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx < warm:
                return
            if on_gpu:
                torch.cuda.set_sync_debug_mode(0)
            self.reads.active = False
            self.reads.uninstall()
            syncs = [str(w.message) for w in self.warned if "synchroniz" in str(w.message)]
            self.caught.__exit__(None, None, None)
            self.caught = None
            outer = rounds_seen(trainer.strategy) != self.outer_before
            self.steps.append({"outer": outer, "host_reads": self.reads.count, "cuda_syncs": len(syncs) if on_gpu else None,
                               "hook_host_reads": self.hook_reads.count - self.hook_before,
                               "where": self.reads.where[:5], "sync_messages": syncs[:3]})
            self.reads.where = []

    h = setting.short_sync_every
    tau = max(2, h // 3)  # inner steps with the round in flight before it lands
    configs = {
        "plain": lambda: (strategy_for("plain", h), []),
        "noloco-1": lambda: (strategy_for("noloco", h), []),
        "noloco-1-cpu-state": lambda: (strategy_for("noloco", h, outer_state_device="cpu"), []),
        "noloco-1-overlap": lambda: (strategy_for("noloco", h, overlap_steps=tau), []),
        # a world of one still all-reduces: on NCCL, inner steps poll a CUDA event while the round is in flight
        "diloco-1-overlap": lambda: (strategy_for("diloco", h, overlap_steps=tau), []),
        "noloco-1+monitor": lambda: (strategy_for("noloco", h), [OuterStepMonitor()]),
    }
    steps = warm + 3 * h
    out: dict[str, Any] = {"sync_every": h, "steps_counted": 3 * h, "sync_debug_mode": on_gpu, "configs": {},
                           "errors": {}}
    for config, make in configs.items():
        if not budget.allows(0.12, config):
            continue
        count = Count()

        def run(make: Callable[[], Any] = make, count: Any = count) -> Any:
            strategy, extra = make()
            return fit(setting, strategy, steps, [count, *extra])

        model = guarded(out["errors"], config, run)
        if model is None:
            count.cleanup()
            continue
        inner = [s for s in count.steps if not s["outer"]]
        outer = [s for s in count.steps if s["outer"]]

        def per_step(rows: list[dict[str, Any]], key: str) -> float | None:
            values = [r[key] for r in rows if r[key] is not None]
            return sum(values) / len(values) if values else None

        out["configs"][config] = {
            "inner_steps": len(inner), "outer_steps": len(outer),
            "host_reads_per_inner_step": per_step(inner, "host_reads"),
            "cuda_syncs_per_inner_step": per_step(inner, "cuda_syncs"),
            "hook_host_reads_per_inner_step": per_step(inner, "hook_host_reads") if config != "plain" else None,
            "host_reads_per_outer_step": per_step(outer, "host_reads"),
            "cuda_syncs_per_outer_step": per_step(outer, "cuda_syncs"),
            "inner_step_examples": sorted({w for s in inner for w in s["where"]})[:8],
            "inner_sync_examples": sorted({w for s in inner for w in s["sync_messages"]})[:3],
        }
        say(f"part 2: {config}: {out['configs'][config]['host_reads_per_inner_step']} host reads, "
            f"{out['configs'][config]['cuda_syncs_per_inner_step']} CUDA syncs per inner step")
        del model
        free_memory()
    return out


# ---------------------------------------------------------------- part 3: memory


def part_memory(setting: Setting, budget: Budget) -> dict[str, Any]:
    import lightning as L
    import torch

    on_gpu = torch.cuda.is_available()

    class TrainingPeak(L.Callback):
        """The peak up to the end of training: before the strategy's own end of fit (the replicas'
        average with ``average_at_end``), which runs after the callbacks' ``on_train_end``."""

        peak: int | None = None

        def on_train_end(self, trainer: Any, module: Any) -> None:
            if on_gpu:
                self.peak = torch.cuda.max_memory_allocated()

    h = setting.short_sync_every
    configs = {"plain": lambda: strategy_for("plain", h)}
    for name in ("noloco", "gasloc", "diloco"):
        configs[f"{name}-1"] = lambda name=name: strategy_for(name, h)
        configs[f"{name}-1-cpu-state"] = lambda name=name: strategy_for(name, h, outer_state_device="cpu")
    steps = 2 * h + 1  # two outer steps, then one inner step
    out: dict[str, Any] = {"sync_every": h, "steps": steps, "configs": {}, "errors": {}}
    plain_peak = None
    for config, make in configs.items():
        if not budget.allows(0.08, config):
            continue
        free_memory()
        base = None
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        seen = TrainingPeak()
        model = guarded(out["errors"], config, lambda make=make, seen=seen: fit(setting, make(), steps, [seen]))
        if model is None:
            continue
        params = numel(model)
        peak = seen.peak - base if on_gpu and seen.peak is not None else None
        row: dict[str, Any] = {"peak_bytes": peak,  # training, outer steps included
                               "peak_bytes_with_end_of_fit": torch.cuda.max_memory_allocated() - base if on_gpu else None}
        if config == "plain":
            plain_peak = peak
        elif peak is not None and plain_peak is not None:
            row["extra_float32_copies"] = (peak - plain_peak) / (4 * params)
            row["extra_float32_copies_with_end_of_fit"] = (
                row["peak_bytes_with_end_of_fit"] - out["configs"]["plain"]["peak_bytes_with_end_of_fit"]) / (4 * params)
        out["configs"][config] = row
        out["parameters"] = params
        say(f"part 3: {config}: peak {peak / 2**20:.0f} MiB" if peak is not None else f"part 3: {config}: ran (no CUDA)")
        del model
        free_memory()
    return out


# ---------------------------------------------------------------- part 4: two processes on one GPU


def _replica_worker(rank: int, port: int, setting: Setting, overlap: int, out: str, stage_cpu: bool) -> None:
    """One of two replicas sharing the GPU (or the CPU in the dry run) over gloo."""
    import lightning as L
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_loco.transport.torch_dist import TorchDistributedTransport

    class TwoProcesses(LightningEnvironment):
        """Two ranks started by this script, on one node and one device."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        def world_size(self) -> int:
            return 2

        def global_rank(self) -> int:
            return rank

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
    if stage_cpu:
        TorchDistributedTransport.stage_cpu_payloads = True  # the staging path, without CUDA
    result: dict[str, Any] = {"rank": rank}
    try:
        import lightning_loco

        class Staging(L.Callback):
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                driver = trainer.strategy.driver
                if driver is not None and driver.reports and "allocations_after_first_round" not in result:
                    transport = driver.transport
                    result["allocations_after_first_round"] = transport.staging.allocations
                if driver is not None:
                    result["staging_allocations"] = driver.transport.staging.allocations
                    result["staging_pinned"] = driver.transport.staging.pinned

        h = setting.pair_sync_every
        strategy = lightning_loco.NoLoCoStrategy(
            sync_every=h, overlap_steps=overlap, process_group_backend="gloo", cluster_environment=TwoProcesses(),
            timeout=timedelta(seconds=60),
        )
        steps = setting.pair_steps
        model = make_model(setting, steps)
        trainer = L.Trainer(
            strategy=strategy, accelerator=setting.accelerator, devices=1, num_nodes=2, precision=setting.precision,
            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Staging()],
        )
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, train_dataloaders=step_loader(steps))
        cuda_sync()
        result["fit_seconds"] = time.perf_counter() - started
        reports = strategy.outer_step_reports
        result["rounds"] = len(reports)
        result["outer_step_s"] = [r.seconds for r in reports]
        result["comm_s"] = [r.comm_seconds for r in reports]
        result["exchange_s"] = [r.exchange_seconds for r in reports]
        result["device"] = str(next(model.parameters()).device)
        result.update(trained(model))
        weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        result["weights_checksum"] = [float(weights.sum()), float(weights.abs().sum())]
    except Exception as err:  # noqa: BLE001 (recorded for the parent, which reports it)
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-3000:]
    Path(out).write_text(json.dumps(result))


def part_two_processes(setting: Setting, budget: Budget) -> dict[str, Any]:
    import tempfile

    import torch

    on_gpu = torch.cuda.is_available()
    # Fresh processes: fork is unsafe once CUDA is initialised, and, on the CPU, once this process has
    # trained (a forked child can inherit a lock held by one of torch's threads and hang).
    context = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {"sync_every": setting.pair_sync_every, "steps": setting.pair_steps, "configs": {}}
    for overlap in (0, setting.pair_overlap):
        if not budget.allows(0.3, f"overlap_steps={overlap}"):
            continue
        remaining = budget.left() if overlap else budget.left() * 0.55  # leave the second its share
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            files = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
            procs = [context.Process(target=_replica_worker, args=(r, port, setting, overlap, files[r], not on_gpu))
                     for r in range(2)]
            for proc in procs:
                proc.start()
            deadline = time.perf_counter() + max(remaining, 10.0)
            for proc in procs:
                proc.join(max(0.0, deadline - time.perf_counter()))
            hung = [proc for proc in procs if proc.is_alive()]
            for proc in hung:
                proc.kill()
                proc.join(5)
            ranks = [json.loads(Path(f).read_text()) if os.path.exists(f) else {"error": "no result"} for f in files]
        errors = [r.get("error") for r in ranks if r.get("error")]
        if hung:
            errors.append(f"{len(hung)} worker(s) still running after the part's budget; killed")
        config = f"noloco-2-overlap{overlap}"
        row: dict[str, Any] = {"overlap_steps": overlap, "errors": errors}
        if not errors:
            row.update(
                rounds=ranks[0]["rounds"],
                outer_step_s=summary([s for r in ranks for s in r["outer_step_s"]]),
                comm_s=summary([s for r in ranks for s in r["comm_s"]]),
                fit_s=max(r["fit_seconds"] for r in ranks),
                loss_first=[r["loss_first"] for r in ranks], loss_last=[r["loss_last"] for r in ranks],
                trained=all(r["loss_last"] < r["loss_first"] for r in ranks),
                replicas_agree=ranks[0]["weights_checksum"] == ranks[1]["weights_checksum"],
                staging_pinned=ranks[0].get("staging_pinned"),
                staging_allocations=[r.get("staging_allocations") for r in ranks],
                staging_reused=all(r.get("staging_allocations") == r.get("allocations_after_first_round")
                                   for r in ranks),
                device=ranks[0]["device"],
            )
        out["configs"][config] = row
        say(f"part 4: {config}: " + (f"errors {errors}" if errors else
                                     f"{row['rounds']} rounds, outer step {row['outer_step_s']['median'] * 1e3:.1f} ms"))
    return out


# ---------------------------------------------------------------- part 5: NCCL on one GPU


def part_nccl(setting: Setting, budget: Budget) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_loco.process_groups import ProcessGroups
    from lightning_loco.transport.torch_dist import TorchDistributedTransport

    on_gpu = torch.cuda.is_available()
    backend = "nccl" if on_gpu else "gloo"
    h = setting.short_sync_every
    tau = max(1, h // 3)
    out: dict[str, Any] = {"backend": backend, "sync_every": h, "runs": {}, "errors": {}}

    class Seen(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            driver = trainer.strategy.driver
            self.event_completion = driver.transport._side_stream is not None
            self.watcher_threads = sum(t.name == "lightning_loco-exchange" for t in threading.enumerate())

    for name, kwargs in (("noloco-1", {}), ("diloco-1-overlap", {"overlap_steps": tau})):
        if not budget.allows(0.3, name):
            continue
        seen = Seen()
        algorithm = name.split("-")[0]
        model = guarded(out["errors"], name, lambda algorithm=algorithm, kwargs=kwargs, seen=seen: fit(
            setting, strategy_for(algorithm, h, process_group_backend=backend, **kwargs), 3 * h, [seen]))
        if model is None:
            continue
        reports = model.trainer_strategy.outer_step_reports
        out["runs"][name] = {
            "rounds": len(reports), "overlap_steps": [r.overlap_steps for r in reports],
            "event_completion": seen.event_completion, "watcher_threads": seen.watcher_threads,
            **trained(model),
        }
        say(f"part 5: {name} on {backend}: {out['runs'][name]}")
        del model
        free_memory()

    def transport_alone() -> dict[str, Any]:
        """The transport on a world of one: an all-reduce polled with ``done()``, then waited for;
        first a new group's warm-up."""
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=60),
                                **({"device_id": device} if on_gpu else {}))
        try:
            groups = ProcessGroups(1, backend, timedelta(seconds=60))
            groups.warm_up_groups = True  # as on NCCL, also in the dry run
            groups._warm_up(dist.new_group([0], backend=backend))
            transport = TorchDistributedTransport(device)
            payload = torch.arange(1 << 20, dtype=torch.float32, device=device)
            expected = payload.clone()
            threads = threading.active_count()
            pending = transport.start_all_reduce_sum(payload)
            polls, deadline = 0, time.perf_counter() + 30
            while not pending.done() and time.perf_counter() < deadline:
                polls += 1
                time.sleep(0.001)
            total = pending.wait()
            return {
                "done_seen": pending.done(), "polls": polls, "bitwise_equal": bool(torch.equal(total, expected)),
                "event_completion": pending._event is not None, "new_threads": threading.active_count() - threads,
                "group_warmed_up": True,
            }
        finally:
            dist.destroy_process_group()

    out["transport"] = guarded(out["errors"], "transport", transport_alone)
    say(f"part 5: transport on {backend}: {out['transport']}")
    return out


# ---------------------------------------------------------------- running the parts, the table


RUNNERS: dict[int, Callable[[Setting, Budget], dict[str, Any]]] = {
    1: part_overhead, 2: part_host_sync, 3: part_memory, 4: part_two_processes, 5: part_nccl,
}


def run_part_here(part: int, setting: Setting, budget: float) -> dict[str, Any]:
    """Runs one part in this process; an exception is recorded, not raised."""
    started = time.perf_counter()
    try:
        result = {"status": "ran", **RUNNERS[part](setting, Budget(budget))}
    except BaseException as err:  # a failed part must not stop the others
        if isinstance(err, KeyboardInterrupt):
            raise
        result = {"status": "error", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = time.perf_counter() - started
    return result


def run_part_isolated(part: int, budget: float, args: argparse.Namespace) -> dict[str, Any]:
    """Runs one part in a child process with a hard time limit (a CUDA or NCCL failure can take its
    process down; the others go on). The child gets a session of its own, so that stopping it stops
    the workers it started too."""
    import signal
    import tempfile

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result_file, log_file = os.path.join(tmp, "part.json"), os.path.join(tmp, "stderr.txt")
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--part", str(part), "--part-out", result_file,
               "--budget", str(max(budget - START_S, 5.0))]
        with open(log_file, "w") as err:
            proc = subprocess.Popen(cmd, cwd=Path(__file__).parent.parent, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=budget + GRACE_S)
                stopped = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                stopped = True
        stderr = Path(log_file).read_text(errors="replace")[-1500:]
        if stopped:
            result = {"status": "error", "error": f"ran past its budget of {budget:.0f} s (+{GRACE_S:.0f} s) and was "
                      "stopped", "stderr": stderr}
        elif os.path.exists(result_file):
            result = json.loads(Path(result_file).read_text())
        else:
            result = {"status": "error", "error": f"its process exited with {proc.returncode} and no result",
                      "stderr": stderr}
    result["seconds"] = time.perf_counter() - started
    return result


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def rows_of(parts: dict[int, dict[str, Any]], on_gpu: bool) -> list[dict[str, str]]:
    """One table: part, what was checked, the result, the target, and whether it was met ("ok",
    "MISSED", "-" where there is no target or it does not apply, "FAILED" for a run that failed)."""
    rows: list[dict[str, str]] = []

    def add(part: int, check: str, result: str, target: str = "", ok: bool | None = None, failed: bool = False) -> None:
        status = "FAILED" if failed else "-" if ok is None else ("ok" if ok else "MISSED")
        rows.append({"part": str(part), "check": check, "result": result, "target": target, "status": status})

    for part, res in parts.items():
        if res.get("status") != "ran":
            add(part, PARTS[part][0], (res.get("error") or res.get("status", "?"))[:90], failed=True)
            continue
        for config, error in res.get("errors", {}).items():
            add(part, f"{config} failed", error[:90], failed=True)
        if part == 1:
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
        elif part == 2:
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
        elif part == 3:
            for config, row in res["configs"].items():
                if config == "plain":
                    peak = row["peak_bytes"]
                    add(3, "plain peak GPU memory (MiB)", fmt(None if peak is None else peak / 2**20, ".0f"))
                    continue
                copies = row.get("extra_float32_copies")
                limit = 0 if "cpu-state" in config else 2
                add(3, f"{config}: extra float32 copies on the GPU", fmt(copies, ".2f"), f"<= {limit}",
                    None if copies is None else copies <= limit + 0.25)
        elif part == 4:
            for config, row in res["configs"].items():
                if row["errors"]:
                    add(4, config, "; ".join(row["errors"])[:90], failed=True)
                    continue
                add(4, f"{config}: outer step ms [min, max]",
                    f"{row['outer_step_s']['median'] * 1e3:.1f} [{row['outer_step_s']['min'] * 1e3:.1f}, "
                    f"{row['outer_step_s']['max'] * 1e3:.1f}]")
                add(4, f"{config}: trained, replicas agree, staging reused (pinned={row['staging_pinned']})",
                    f"{row['trained']}, {row['replicas_agree']}, {row['staging_reused']}", "True x3",
                    row["trained"] and row["replicas_agree"] and row["staging_reused"])
        elif part == 5:
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
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, nargs="+", default=sorted(PARTS), choices=sorted(PARTS))
    parser.add_argument("--out", help="default: gpu_check.json in benchmarks/results (dry run: a temporary folder)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the parts in this process (default without CUDA; with CUDA each part gets a process)")
    parser.add_argument("--isolate", action="store_true", help="run each part in a process of its own, also without CUDA")
    parser.add_argument("--part", type=int, help=argparse.SUPPRESS)  # internal: one part, in a child process
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    on_gpu = torch.cuda.is_available()
    setting = GPU if on_gpu else DRY
    if not on_gpu:
        # One thread: a tiny model gains nothing from more. OMP_NUM_THREADS keeps Lightning's DDP-based
        # strategies from raising it to cores/processes (the plain Trainer would keep one: unfair).
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)  # its tiny AdamW moments turn subnormal, which is slow on CPUs
    if args.part:
        result = run_part_here(args.part, setting, args.budget or PARTS[args.part][1])
        Path(args.part_out).write_text(json.dumps(result))
        return 0

    device = torch.cuda.get_device_name(0) if on_gpu else "no CUDA device: CPU dry run"
    say(f"GPU check on {device}; torch {torch.__version__}; parts {args.parts}")
    isolate = args.isolate or (on_gpu and not args.in_process)
    started = time.perf_counter()
    parts: dict[int, dict[str, Any]] = {}
    for part in args.parts:
        title, budget = PARTS[part]
        left = TOTAL_BUDGET_S - (time.perf_counter() - started)
        if left < 15:
            parts[part] = {"status": "skipped: out of time", "seconds": 0.0}
            say(f"part {part} ({title}): skipped, {left:.0f} s left of {TOTAL_BUDGET_S:.0f}")
            continue
        budget = min(budget, left)
        say(f"part {part} ({title}): starting, budget {budget:.0f} s")
        parts[part] = run_part_isolated(part, budget, args) if isolate else run_part_here(part, setting, budget)
        say(f"part {part}: {parts[part]['status']} in {parts[part]['seconds']:.0f} s"
            + (f": {parts[part].get('error')}" if parts[part]["status"] != "ran" else ""))

    rows = rows_of(parts, on_gpu)
    print()
    print(table(rows, [("part", "part", "s"), ("check", "check", "s"), ("result", "result", "s"),
                       ("target", "target", "s"), ("status", "status", "s")]))
    out = Path(args.out) if args.out else results_dir(quick=not on_gpu) / "gpu_check.json"
    payload = {"device": device, "cuda": on_gpu, "torch": torch.__version__, "setting": asdict(setting),
               "seconds": time.perf_counter() - started, "parts": {str(k): v for k, v in parts.items()}, "rows": rows}
    path = write_json(out.name, payload, out.parent)
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")
    if not on_gpu:
        print("This was a CPU dry run: it did not run on a GPU (no CUDA device). Its numbers say nothing about GPUs.")
    return 1 if any(row["status"] == "FAILED" for row in rows) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no final garbage collection over torch's objects, no wait for lingering threads
