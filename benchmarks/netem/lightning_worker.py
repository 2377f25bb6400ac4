"""One rank of a Lightning run on an emulated or modelled network: ``lightning-loco`` plus timing.

Started by :func:`benchmarks.netem.launch.run_workers` with torchrun's environment variables, so
Lightning treats every process as a node of its own (``num_nodes = N, devices = 1``). Under the
modelled network (``LOCO_MODELLED_NETWORK`` set) the ``ModelledNetwork`` callback gives the
strategies :class:`~benchmarks.netem.modelled.ModelledTransport` (their ``transport_factory``) and
DDP's gradient all-reduce a communication hook that holds it for the modelled time.

``TimeToLoss`` records, on rank 0, the training wall time (validation excluded) and the validation
loss at every validation, and at the end the strategy's outer-step reports (τ used, the time each
round's landing waited).
"""

from __future__ import annotations

import json
import sys
import time

import lightning as L
import torch
import torch.distributed as dist

from benchmarks.common import skip_final_collection
from benchmarks.netem import modelled


class TimeToLoss(L.Callback):
    """Writes ``{"curve": [{"step", "tokens", "train_seconds", "val_loss"}, ...], "rounds": [...],
    "train_seconds"}`` to ``out`` (rank 0)."""

    def __init__(self, out: str, tokens_per_step: int) -> None:
        self.out, self.tokens_per_step = out, tokens_per_step
        self.rows: list[dict[str, float]] = []
        self.start = 0.0
        self.validation_seconds = 0.0
        self._val_start = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = time.perf_counter()
        self.validation_seconds += now - self._val_start
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        self.rows.append({
            "step": trainer.global_step,
            "tokens": trainer.global_step * self.tokens_per_step,
            "train_seconds": now - self.start - self.validation_seconds,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
        })
        self._write(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reports = getattr(trainer.strategy, "outer_step_reports", [])
        self.rounds = [{"overlap_steps": r.overlap_steps, "comm_seconds": r.comm_seconds, "seconds": r.seconds}
                       for r in reports]
        self.train_seconds = time.perf_counter() - self.start - self.validation_seconds
        self._write(trainer)

    def _write(self, trainer: L.Trainer) -> None:
        if trainer.is_global_zero:
            with open(self.out, "w") as f:
                json.dump({"curve": self.rows, "rounds": getattr(self, "rounds", []),
                           "train_seconds": getattr(self, "train_seconds", None)}, f)


class ModelledNetwork(L.Callback):
    """Under the modelled network only: our strategies' outer steps use
    :class:`~benchmarks.netem.modelled.ModelledTransport`, and DDP's gradient all-reduce is held for
    the modelled time."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if modelled.from_env() is not None and hasattr(trainer.strategy, "transport_factory"):
            trainer.strategy.transport_factory = modelled.ModelledTransport  # reads the network from the environment

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        network = modelled.from_env()
        model = trainer.strategy.model
        if network is None or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        world = dist.get_world_size()

        # No annotations: DDP checks them, and this module's are strings (postponed evaluation).
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            buffer = bucket.buffer().div_(world)
            future = dist.all_reduce(buffer, async_op=True).get_future()

            def held(fut):  # type: ignore[no-untyped-def]
                modelled.wait_until(start, modelled.allreduce_s(network, buffer.numel() * buffer.element_size()))
                return fut.value()[0]

            return future.then(held)

        model.register_comm_hook(None, hook)


def main() -> None:
    from lightning_loco.cli import main as cli_main

    cli_main(sys.argv[1:])
    skip_final_collection()


if __name__ == "__main__":
    main()
