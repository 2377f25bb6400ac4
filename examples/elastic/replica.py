"""One elastic replica: a tiny regression model trained with NoLoCo (or GASLoC, DiLoCo) over a Lighthouse.

    python examples/elastic/replica.py --lighthouse HOST:PORT --replica-id r0 --out runs/elastic

Each replica is its own process and its own Lightning Trainer (devices=1). It writes
``OUT/ID.json`` when ``fit`` ends: its loss at every step, its step and learning rate at every step,
its rounds (outer step, group by replica id, alone or not), the memberships it took up, the state it
healed from, the rounds taken alone for a late partner, and timings. ``OUT/ID.progress`` holds the step it is at,
for whoever wants to kill it at a
given point (``demo.py``, the tests). ``--optimizer adamw`` trains with the shipped GPT's AdamW and
warm-up + cosine schedule; ``--csv`` logs the loss and learning rate to ``OUT/csv/ID/PID/metrics.csv``.

``--ranks K`` makes the replica K processes (DDP inside, ``ranks_per_replica=K``), started as torchrun
starts them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...:
``lightning_loco.testing.elastic.Replicas.start_ranks``); rank r > 0 writes ``OUT/ID.rankR.json`` and
``OUT/ID.rankR.progress``. ``--sharding fsdp`` shards the model over the replica's K ranks with FSDP2
(``replica_sharding="fsdp"``) instead: each rank then holds, exchanges, heals and records (``final_weights``)
its own shards.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_loco import ElasticConfig
from lightning_loco.examples.gpt import warmup_cosine
from lightning_loco.testing.launch import strategy_class

IN_FEATURES = 8


def shard(replica_id: str, size: int = 512) -> TensorDataset:
    """This replica's data: y = x·w + noise with one w for every replica, x drawn from the replica's id."""
    g = torch.Generator().manual_seed(zlib.crc32(replica_id.encode()))
    x = torch.randn(size, IN_FEATURES, generator=g)
    w = torch.linspace(-2.0, 2.0, IN_FEATURES).unsqueeze(1)
    return TensorDataset(x, x @ w + 0.05 * torch.randn(size, 1, generator=g))


class HoldAt(L.Callback):
    """Before step ``at`` (0: before the first membership is asked for) writes the file ``held`` and waits
    until the file ``release`` exists (at most ``limit_s``): a launcher lines replicas up on events, not on
    times (``Replicas.wait_until_held`` and ``Replicas.release``)."""

    def __init__(self, at: int, held: Path, release: Path, limit_s: float = 120.0) -> None:
        self.at, self.held, self.release, self.limit_s, self.done = at, held, release, limit_s, False

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.at == 0:
            self.hold()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.at and trainer.global_step == self.at:
            self.hold()

    def hold(self) -> None:
        if self.done:
            return
        self.done = True
        self.held.write_text("held")
        deadline = time.monotonic() + self.limit_s
        while not self.release.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"held before step {self.at} and not released within {self.limit_s:g} s "
                                   f"(no file {self.release})")
            time.sleep(0.02)


class Regressor(L.LightningModule):
    def __init__(self, replica_id: str, step_sleep: float, progress: Path, optimizer: str = "sgd",
                 max_steps: int = 60) -> None:
        super().__init__()
        torch.manual_seed(0)  # every replica starts from the same weights
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.replica_id, self.step_sleep, self.progress = replica_id, step_sleep, progress
        self.optimizer, self.max_steps = optimizer, max_steps
        self.losses: list[tuple[float, int, float]] = []  # (time, outer-step count, loss)
        self.steps: list[tuple[int, float]] = []  # (global_step, learning rate) of every step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        strategy = self.trainer.strategy
        self.losses.append((time.time(), strategy.outer_steps, loss.item()))
        self.steps.append((self.trainer.global_step, self.trainer.optimizers[0].param_groups[0]["lr"]))
        self.log("train_loss", loss)
        if self.step_sleep:
            time.sleep(self.step_sleep)  # stands for a bigger model's step
        self.progress.write_text(str(len(self.losses)))
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        # the shipped GPT's: AdamW, linear warm-up then cosine decay over the run's max_steps
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, betas=(0.9, 0.95), weight_decay=0.0)
        scheduler = warmup_cosine(optimizer, max(1, self.max_steps // 10), self.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(shard(self.replica_id), batch_size=16, shuffle=True)


class DieInExchange(L.Callback):
    """Kills this process (SIGKILL) right after it posts the exchange of its ``at``-th round with others
    (counted from 1: a replica that joined late counts from its first round)."""

    def __init__(self, at: int) -> None:
        self.at, self.posted = at, 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        transport = trainer.strategy.driver.transport
        if getattr(transport, "_wrapped", False):
            return
        post, post_all = transport.start_group_sum, transport.start_all_reduce_sum

        def die_if_due(pending: Any) -> Any:
            if transport.num_replicas > 1:
                self.posted += 1
                if self.posted == self.at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return pending

        transport.start_group_sum = lambda *args, **kwargs: die_if_due(post(*args, **kwargs))
        transport.start_all_reduce_sum = lambda *args, **kwargs: die_if_due(post_all(*args, **kwargs))
        transport._wrapped = True


class SlowAt(L.Callback):
    """Sleeps ``seconds`` once, in the inner phase of outer step ``at``: this replica reaches that round's
    exchange late (a straggler), alive all the while."""

    def __init__(self, at: int, seconds: float) -> None:
        self.at, self.seconds, self.slept = at, seconds, False

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.slept and trainer.strategy.outer_steps == self.at:
            self.slept = True
            time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--algorithm", choices=["noloco", "gasloc", "diloco"], default="noloco")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--sync-every", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--outer-step-timeout", type=float, default=30.0)
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument("--membership-every", type=int, default=1)
    parser.add_argument("--die-in-exchange-at", type=int, default=None,
                        help="kill this process right after it posts its N-th exchange with others")
    parser.add_argument("--no-heal", action="store_true", help="take only the step count when joining")
    parser.add_argument("--straggler-timeout", type=float, default=None,
                        help="seconds an exchange waits for a live partner that is late (default: off)")
    parser.add_argument("--hold-at", type=int, default=None,
                        help="before this step (0: before joining), wait until the file OUT/ID.release exists")
    parser.add_argument("--slow-at", type=int, default=None, help="sleep --slow-seconds before this outer step")
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--wire", choices=["float32", "bfloat16", "float16", "int8"], default="float32")
    parser.add_argument("--ckpt-path", default=None, help="resume from this replica's own checkpoint")
    parser.add_argument("--save-ckpt", default=None, help="save a checkpoint here when fit ends")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                        help="sgd (lr 0.05), or adamw with the shipped GPT's warm-up + cosine schedule")
    parser.add_argument("--csv", action="store_true", help="log the loss and learning rate with a CSVLogger")
    parser.add_argument("--ranks", type=int, default=1, help="processes of this replica (DDP inside)")
    parser.add_argument("--sharding", choices=["fsdp"], default=None, help="FSDP2 inside the replica, not DDP")
    parser.add_argument("--launched-at", type=float, default=None,
                        help="when the launcher started this process (time.time()); default: after the imports")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*(does not have many workers|GPU available|LOCAL_RANK).*")
    started = args.launched_at or time.time()
    elastic = ElasticConfig(args.lighthouse, replica_id=args.replica_id, outer_step_timeout=args.outer_step_timeout,
                            join_timeout=args.join_timeout, membership_every=args.membership_every,
                            heal=not args.no_heal, straggler_timeout=args.straggler_timeout)
    strategy = strategy_class(args.algorithm)(sync_every=args.sync_every, ranks_per_replica=args.ranks,
                                              replica_sharding=args.sharding, wire=args.wire, elastic=elastic)
    rank = int(os.environ.get("RANK", 0)) if args.ranks > 1 else 0
    name = args.replica_id + (f".rank{rank}" if rank else "")  # this process's files
    model = Regressor(args.replica_id, args.step_sleep, args.out / f"{name}.progress", args.optimizer,
                      args.max_steps)
    callbacks: list[L.Callback] = []
    if args.die_in_exchange_at is not None:
        callbacks.append(DieInExchange(args.die_in_exchange_at))
    if args.hold_at is not None:
        callbacks.append(HoldAt(args.hold_at, args.out / f"{name}.held", args.out / f"{args.replica_id}.release"))
    if args.slow_at is not None:
        callbacks.append(SlowAt(args.slow_at, args.slow_seconds))
    logger: Any = False
    if args.csv:
        logger = L.pytorch.loggers.CSVLogger(args.out / "csv", name=args.replica_id, version=str(os.getpid()))
        callbacks.append(L.pytorch.callbacks.LearningRateMonitor(logging_interval="step"))
    trainer = L.Trainer(
        accelerator="cpu", devices=args.ranks, strategy=strategy, max_steps=args.max_steps, max_epochs=-1,
        logger=logger,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    driver_holder: dict[str, Any] = {}

    class Keep(L.Callback):  # the driver (outer state, reports) goes at teardown: save and keep it before
        def on_train_end(self, trainer: L.Trainer, *_: Any) -> None:
            driver_holder["driver"] = trainer.strategy.driver
            if args.save_ckpt:  # every rank takes part (rank 0 writes)
                trainer.save_checkpoint(args.save_ckpt)

    trainer.callbacks.append(Keep())
    trainer.fit(model, ckpt_path=args.ckpt_path)
    driver = driver_holder["driver"]
    membership = driver.transport.membership
    record = {
        "replica_id": args.replica_id, "rank": rank, "started": started, "ended": time.time(), "losses": model.losses,
        "rounds": driver.plugin.rounds, "memberships": membership.history, "healed_from": driver.plugin.healed_from,
        "exported": driver.plugin.exported,
        "failures": driver.transport.failures, "late": driver.transport.late, "quorum_waits": membership.waits,
        "round_seconds": [r.seconds for r in driver.reports], "comm_seconds": [r.comm_seconds for r in driver.reports],
        "outer_steps": driver.slots[0].outer_steps, "steps": model.steps, "global_step": trainer.global_step,
        "final_weights": torch.cat([(p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1)
                                    for p in model.parameters()]).tolist(),  # sharded: this rank's shards
    }
    (args.out / f"{name}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
