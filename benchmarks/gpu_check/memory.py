"""Part 3, peak GPU memory of NoLoCo, GASLoC and DiLoCo (N = 1) against plain, outer state on the
device and on the CPU, in float32 copies of the model."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check.settings import Budget, Setting, say
from benchmarks.gpu_check.training import fit, free_memory, guarded, numel, strategy_for


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
        with_end = torch.cuda.max_memory_allocated() - base if on_gpu else None
        row: dict[str, Any] = {"peak_bytes": peak,  # training, outer steps included
                               "peak_bytes_with_end_of_fit": with_end}
        if config == "plain":
            plain_peak = peak
        elif peak is not None and plain_peak is not None:
            row["extra_float32_copies"] = (peak - plain_peak) / (4 * params)
            plain_end = out["configs"]["plain"]["peak_bytes_with_end_of_fit"]
            row["extra_float32_copies_with_end_of_fit"] = (row["peak_bytes_with_end_of_fit"] - plain_end) / (4 * params)
        out["configs"][config] = row
        out["parameters"] = params
        say(f"part 3: {config}: peak {peak / 2**20:.0f} MiB" if peak is not None
            else f"part 3: {config}: ran (no CUDA)")
        del model
        free_memory()
    return out
