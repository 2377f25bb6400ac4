"""What every part of the GPU check trains: the example GPT on token progressions drawn on its
device, one single-process fit, a failed run recorded instead of raised, and memory between runs."""

from __future__ import annotations

import gc
import hashlib
import os
import statistics
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from benchmarks import harness
from benchmarks.gpu_check.settings import Setting, say


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


def weights_digest(model: Any) -> str:
    """SHA-256 of the parameters' float32 values, in order: equal digests are bitwise equal weights."""
    import torch

    weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu()
    return hashlib.sha256(weights.numpy().tobytes()).hexdigest()


def strategy_for(name: str, sync_every: int, **kwargs: Any) -> Any:
    """"plain" (Lightning's default) or a strategy's registered name ("noloco", "gasloc", "diloco");
    kwargs go to the strategy."""
    if name == "plain":
        return "auto"
    return harness.strategy(name, sync_every=sync_every, timeout=timedelta(seconds=120), **kwargs)


def fit(setting: Setting, strategy: Any, steps: int, callbacks: Sequence[Any] = (), **trainer_kwargs: Any) -> Any:
    """One single-process fit; returns the trained model. The world-of-one process group a strategy
    creates is destroyed afterwards, so that the next fit can pick another backend."""
    import torch
    import torch.distributed as dist

    from lightning_loco.driver.flat import FlatParameters

    os.environ.pop("MASTER_PORT", None)  # a fresh port for every world of one
    model = make_model(setting, steps)
    trainer = harness.quiet_trainer(
        strategy=strategy, accelerator=setting.accelerator, devices=1, precision=setting.precision,
        max_steps=steps, callbacks=list(callbacks), **trainer_kwargs,
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
