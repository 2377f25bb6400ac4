"""Part 2, no host synchronisation in an inner step: steps run under ``torch.cuda.set_sync_debug_mode``
and with reads of tensor values to the host counted (:class:`~lightning_loco.testing.host_reads.HostReadCounter`),
per inner step for the plain Trainer and the strategies, and inside the strategy's own per-step hooks."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from benchmarks.gpu_check.settings import Budget, Setting, say
from benchmarks.gpu_check.training import fit, free_memory, guarded, strategy_for
from lightning_loco.testing.host_reads import HostReadCounter, rounds_seen


def part_host_sync(setting: Setting, budget: Budget) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_loco.trainer.monitoring import OuterStepMonitor

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
            self.steps.append({"outer": outer, "host_reads": self.reads.count,
                               "cuda_syncs": len(syncs) if on_gpu else None,
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
