"""Part 1, inner-step overhead: tokens per second of NoLoCo with N = 1 (outer steps at H, outer state
on the device and on the CPU) against a plain single-device Trainer, interleaved repeats, as ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import spread
from benchmarks.gpu_check.settings import Budget, Setting, say
from benchmarks.gpu_check.training import cuda_sync, fit, free_memory, guarded, numel, strategy_for


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
        row: dict[str, Any] = {"tokens_per_s": spread(rates), "outer_steps_timed": runs[0]["outer_steps"]}
        if config != "plain" and len(runs) == len(plain):
            pairs = [r / p for r, p in zip(rates, plain)]  # repeat by repeat: neighbours in time
            row["ratio"] = statistics.median(rates) / statistics.median(plain)
            row["ratio_per_repeat"] = spread(pairs)
            if runs[0]["outer_steps"]:
                extra = [(s["s_per_step"] - p["s_per_step"]) * setting.overhead_steps / s["outer_steps"]
                         for s, p in zip(runs, samples["plain"])]
                row["outer_step_cost_s"] = spread(extra)  # time per step over plain, per outer step
        rows[config] = row
    return {"parameters": params, "sync_every": h, "steps_timed": setting.overhead_steps,
            "tokens_per_step": setting.batch_size * setting.block_size, "repeats": len(plain), "configs": rows,
            "errors": errors}

