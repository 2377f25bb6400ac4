"""A tiny regression model, its data, and a recorder: shared by the multi-process tests.

``python tests/tiny.py OUT_DIR CONFIG_JSON`` trains under the configured strategy (Lightning's popen
launcher re-runs this command in every child process) and saves ``OUT_DIR/rank{r}.pt`` with what
that replica saw: its weights at the start and after every batch, and every torch.distributed call
made during training, batch by batch.

Tests call :func:`launch`, which runs the same ``main`` in a child forked from the test's process
when the ranks fork anyway (no second Python and torch start-up), and the script otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_loco.testing.launch import finish_forked, fork_call, fork_ranks, free_port

NUM_SAMPLES = 48
IN_FEATURES = 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=g)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    y = x @ w + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def shard_batches(rank: int, world: int, batch_size: int, epoch: int) -> list[list[int]]:
    """The batches rank ``rank`` sees in ``epoch``: Lightning gives a training dataloader
    ``DistributedSampler(shuffle=True, seed=0)`` and calls ``set_epoch`` every epoch."""
    sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    mine = list(sampler)
    return [mine[k : k + batch_size] for k in range(0, len(mine), batch_size)]


class TinyRegressor(L.LightningModule):
    def __init__(self, lr: float = 0.05, manual: bool = False, batchnorm: bool = False, scheduler: Any = False,
                 inf_loss_at: Any = None, batch_size: int = 4, momentum: float = 0.0,
                 nominal_schedule: Any = None, val_sync_dist: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN_FEATURES, 3)
        self.norm = nn.BatchNorm1d(3) if batchnorm else nn.Identity()
        self.head = nn.Linear(3, 1)
        self.lr = lr
        self.automatic_optimization = not manual
        self.scheduler = scheduler
        self.inf_loss_at = inf_loss_at  # (rank, step): a loss whose gradients overflow there
        self.batch_size = batch_size
        self.momentum = momentum  # of the inner SGD (its state is a momentum buffer per parameter)
        self.nominal_schedule = nominal_schedule  # (warm-up, max_steps): the example GPT's schedule, on nominal steps
        self.val_sync_dist = val_sync_dist  # False: each replica logs its own val_loss, on its own shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.body(x))))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y.float())

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.loss(batch)
        if self.inf_loss_at is not None and [self.global_rank, self.trainer.global_step] == list(self.inf_loss_at):
            loss = loss * float("inf")
        if self.automatic_optimization:
            return loss
        opt_body, opt_head = self.optimizers()
        opt_body.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(loss)
        opt_body.step()
        opt_head.step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, sync_dist=self.val_sync_dist)
        return loss

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=8, shuffle=False)

    def configure_optimizers(self) -> Any:
        if self.automatic_optimization:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, **self._momentum())
            if self.nominal_schedule:
                from lightning_loco.examples.gpt import warmup_cosine

                schedule = warmup_cosine(optimizer, *self.nominal_schedule,
                                         nominal=lambda: getattr(self.trainer.strategy, "nominal_step", None))
                return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
            if self.scheduler == "onecycle":  # stepped once per step over the run's max_steps
                schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr,
                                                               total_steps=self.trainer.max_steps)
                return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
            if self.scheduler:
                schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
                return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
            return optimizer
        return [torch.optim.SGD(self.body.parameters(), lr=self.lr, **self._momentum()),
                torch.optim.SGD(self.head.parameters(), lr=self.lr, **self._momentum())]

    def _momentum(self) -> dict[str, float]:
        return {"momentum": self.momentum} if self.momentum else {}  # none given: SGD as it always was

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)


class TinyModelParallel(TinyRegressor):
    """The regressor written for Lightning's ``ModelParallelStrategy``: ``configure_model`` shards its
    layers with FSDP2 over ``self.device_mesh["data_parallel"]``. ``mismatch``: replica 1 (global
    ranks 2 and 3 with two ranks per replica) shards ``body.weight`` along its second dimension."""

    def __init__(self, *args: Any, mismatch: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mismatch = mismatch

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        mesh = self.device_mesh["data_parallel"]
        placement = None
        if self.mismatch and self.global_rank >= 2:
            placement = lambda p: Shard(1) if p.dim() == 2 else Shard(0)  # noqa: E731
        fully_shard(self.body, mesh=mesh, shard_placement_fn=placement)
        fully_shard(self.head, mesh=mesh)


def flat(module: nn.Module) -> torch.Tensor:
    """The module's parameters as one vector (sharded ones gathered inside their replica)."""
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().float().reshape(-1)
                      for p in module.parameters()])


def lightning_env(**extra: str) -> dict[str, str]:
    """The environment for a new interpreter that runs one Lightning launch: this one's, with a rendezvous
    port from ``free_port`` (Lightning's own choice is a released port of the ephemeral range, which another
    process's connection can take first: see ``conftest.py``)."""
    return {**os.environ, "MASTER_PORT": str(free_port()), **extra}


def launch(tmp_path: Path, expect_failure: bool = False, **config: Any) -> Any:
    """Runs this script under ``config``; returns every rank's record (or, when a failure is expected,
    the finished process). Runs whose ranks fork (see :func:`start_method_of`) start from a child forked
    from this process, which has torch and Lightning imported already; the others (Lightning's popen
    launcher re-runs the command in every rank) start as a new ``python tests/tiny.py``."""
    out = tmp_path / "out"
    start_method = start_method_of(config)
    if start_method == "fork":
        proc = run_forked(out, config, timeout=240)
    elif start_method == "popen" and not any(key in config for key in PER_PROCESS):
        proc = run_ranks_forked(out, config, timeout=240)
    else:
        proc = subprocess.run(
            [sys.executable, __file__, str(out), json.dumps(config)], capture_output=True, text=True, timeout=240,
            env=lightning_env(),
        )
    if expect_failure:
        assert proc.returncode != 0, proc.stdout[-2000:]
        return proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "terminate called" not in proc.stderr
    records = [torch.load(out / f"rank{r}.pt") for r in range(config["devices"])]
    for record in records:
        record["stderr"] = proc.stderr
    return records


def run_forked(out: Path, config: dict[str, Any], timeout: float) -> subprocess.CompletedProcess:
    """``main(out, config)`` in a child forked from this process, as ``python tests/tiny.py`` would run
    it (see :func:`lightning_loco.testing.launch.fork_call`)."""
    out.mkdir(parents=True, exist_ok=True)
    streams = {1: out / "stdout.txt", 2: out / "stderr.txt"}
    pid = fork_call(lambda: main(str(out), config), streams, {})
    return finish_forked(pid, streams, timeout, [__file__, str(out)])


def run_ranks_forked(out: Path, config: dict[str, Any], timeout: float) -> subprocess.CompletedProcess:
    """The ranks of a run that Lightning's popen launcher would start, started instead as torchrun starts
    them (:func:`lightning_loco.testing.launch.fork_ranks`), each running ``main(out, config)``."""
    return fork_ranks(lambda rank: main(str(out), config), config["devices"], out, timeout, [__file__, str(out)])

_COUNTED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "send", "recv", "batch_isend_irecv", "monitored_barrier",
)  # isend/irecv are not wrapped: P2POp accepts only the originals; batch_isend_irecv shows them.


class CallLog:
    def __init__(self) -> None:
        self.active = False
        self.events: list[tuple[Any, ...]] = []

    def install(self) -> None:
        for name in _COUNTED:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                if name == "batch_isend_irecv":
                    ops = tuple((op.op.__name__, op.peer, op.tensor.numel()) for op in args[0])
                    self.events.append((name, ops))
                else:
                    self.events.append((name,))
            return original(*args, **kwargs)

        return wrapper

    def take(self) -> list[tuple[Any, ...]]:
        events, self.events = self.events, []
        return events


class VirtualClock:
    """A process's own clock for ``sync_seconds`` that moves only when a batch starts, by this rank's
    step time: the pacing decisions are then the same in every run (and in a resumed one)."""

    def __init__(self, step_seconds: list[float]) -> None:
        self.step_seconds, self.now = step_seconds, 0.0

    def __call__(self) -> float:
        return self.now


class BatchLog(L.Callback):
    """Writes the training inputs this process saw, batch by batch, to ``OUT/<replica>.rank<R>.json`` at the
    end of fit (the replica named by its elastic id, else its index)."""

    def __init__(self, out: str) -> None:
        self.out, self.batches = out, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        self.batches.append(batch[0].tolist())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        name = trainer.strategy.replica_name
        Path(self.out).mkdir(parents=True, exist_ok=True)
        (Path(self.out) / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(self.batches))


class Recorder(L.Callback):
    def __init__(self, out_dir: str, log: CallLog) -> None:
        self.out_dir, self.call_log = out_dir, log
        self.record: dict[str, Any] = {"weights": [], "calls": []}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record.setdefault("starts", []).append(flat(pl_module))
        self.record["initial"] = self.record["starts"][0]
        self.call_log.take()
        self.call_log.active = True

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the strategy's own end of fit and its teardown."""
        strategy = trainer.strategy
        if hasattr(strategy, "outer_step_reports"):
            self._record_after_fit(trainer, pl_module)
        if self.record.get("record_consensus"):  # the one call for the full consensus state dict (collective)
            consensus = strategy.consensus_state_dict()
            if consensus is not None:
                os.makedirs(self.out_dir, exist_ok=True)
                torch.save(consensus, os.path.join(self.out_dir, f"consensus{trainer.global_rank}.pt"))
        # saves after fit, on every rank (collective), after the strategy's end of fit and teardown
        if "save_to" in self.record:
            trainer.save_checkpoint(self.record["save_to"])
        if "interrupted_save_to" in self.record:
            # As if rank 0 died after every replica file was written and before the main file was: change the
            # weights, then let rank 0 skip all it does after that point (write the main file, tidy up).
            import lightning_loco.replica.checkpoints

            with torch.no_grad():
                for p in pl_module.parameters():
                    p.add_(1.0)
            if trainer.global_rank == 0:
                trainer.strategy.checkpoint_io.save_checkpoint = lambda *args, **kwargs: None
                lightning_loco.replica.checkpoints.remove_sidecars = lambda *args, **kwargs: None
            trainer.save_checkpoint(self.record["interrupted_save_to"])

    def _record_after_fit(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import gc

        gc.collect()
        weak = getattr(self, "weak_outer", [])
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save({"reports": [dataclasses.asdict(r) for r in trainer.strategy.outer_step_reports],
                    "slots_left": len(trainer.strategy.outer_slots),
                    "outer_steps": trainer.strategy.outer_steps,
                    "outer_state_alive": [type(w()).__name__ for w in weak if w() is not None],
                    "outer_state_tracked": len(weak),
                    "buffers": {k: v.clone() for k, v in pl_module.named_buffers() if v.is_floating_point()},
                    "weights": flat(pl_module)}, os.path.join(self.out_dir, f"after_fit{trainer.global_rank}.pt"))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.record.setdefault("before_validation", []).append(flat(pl_module))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.record.setdefault("after_validation", []).append(flat(pl_module))
            if "val_loss" in trainer.callback_metrics:  # what this rank logged, and what callbacks read
                own = getattr(trainer.strategy, "replica_metrics", {}).get("val_loss")  # under ReplicaValidation
                read = float(trainer.callback_metrics["val_loss"])
                self.record.setdefault("val_losses", []).append(read if own is None else own)
                self.record.setdefault("val_losses_read", []).append(read)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._batch_start = time.perf_counter()
        clock = getattr(getattr(trainer.strategy, "replica", None), "_clock", None)
        if isinstance(clock, VirtualClock):
            clock.now += clock.step_seconds[trainer.global_rank]
        if trainer.global_step == self.record.get("fail_at_step"):
            raise RuntimeError(f"stopping on purpose at step {trainer.global_step}")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.record.get("ready_at_step"):  # signal tests: "send your signal now"
            Path(self.out_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.out_dir) / f"ready{trainer.global_rank}").write_text(str(os.getpid()))
        if self.record.get("step_sleep_s"):
            time.sleep(self.record["step_sleep_s"])
        if self.record.get("step_sleep_s_by_rank"):  # replicas of different speeds
            time.sleep(self.record["step_sleep_s_by_rank"][trainer.global_rank])
        self.record.setdefault("batch_seconds", []).append(time.perf_counter() - self._batch_start)
        if trainer.global_step == self.record.get("save_at_step", [None])[0]:  # as ModelCheckpoint saves
            trainer.save_checkpoint(self.record["save_at_step"][1])
        self.record["weights"].append(flat(pl_module))
        self.record.setdefault("step_lrs", []).append(trainer.optimizers[0].param_groups[0]["lr"])
        self.record["calls"].append(self.call_log.take())
        replicas = getattr(trainer.strategy, "outer_slots", [])
        if replicas:
            self.record.setdefault("anchors", []).append(replicas[0].state.anchor.clone())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.call_log.active = False
        strategy = trainer.strategy
        self.record["rank"] = trainer.global_rank
        self.record["world_size"] = trainer.world_size
        self.record["strategy"] = type(strategy).__name__
        self.record["param_dtypes"] = sorted({str(p.dtype) for p in pl_module.parameters()})
        self.record["buffers"] = {k: v.clone() for k, v in pl_module.named_buffers() if v.is_floating_point()}
        self.record["lrs"] = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]
        self.record["best_model_path"] = getattr(trainer.checkpoint_callback, "best_model_path", None)
        replicas = getattr(strategy, "outer_slots", [])
        if self.record.get("track_release"):  # weak references to every piece of outer state
            import weakref

            objects = [r for r in replicas] + [r.state for r in replicas] + [r.flat for r in replicas]
            objects += [t for r in replicas for t in r.state.state_dict().values() if torch.is_tensor(t)]
            objects += [r.state.gradient for r in replicas if hasattr(r.state, "gradient")]
            objects += [t for r in replicas if hasattr(r.state, "optimizer")
                        for per_param in r.state.optimizer.state.values() for t in per_param.values()
                        if torch.is_tensor(t)]
            objects += [x for r in replicas if r.in_flight is not None
                        for x in (r.in_flight, r.in_flight.pending, r.in_flight.reference)]
            objects += [strategy.driver, strategy.driver.transport]
            self.weak_outer = [weakref.ref(o) for o in objects]
        self.record["outer_states"] = [
            {
                "anchor_dtype": str(r.state.anchor.dtype),
                "anchor_device": str(r.state.anchor.device),
                "numel": r.flat.numel,
                "inner_steps": r.inner_steps,
                "outer_steps": r.outer_steps,
                "state": r.state.state_dict(),
            }
            for r in replicas
        ]
        from lightning_loco.replica.sharding import local_tree

        self.record["optimizer_states"] = [local_tree(opt.state_dict()) for opt in trainer.optimizers]
        self.record["reports"] = [dataclasses.asdict(r) for r in getattr(strategy, "outer_step_reports", [])]
        if isinstance(strategy.model, torch.nn.parallel.DistributedDataParallel):
            self.record["ddp_group_ranks"] = dist.get_process_group_ranks(strategy.model.process_group)
        if getattr(getattr(strategy, "options", None), "replica_sharding", None) is not None:  # FSDP's groups
            self.record["fsdp_group_ranks"] = sorted({tuple(dist.get_process_group_ranks(p.device_mesh.get_group()))
                                                      for p in pl_module.parameters()})
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(self.record, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))
        if self.record.get("track_release"):
            self.record.clear()  # it holds the outer state's own tensors (state_dict() does not copy)


def observe(strategy: Any, record: dict[str, Any], config: dict[str, Any]) -> None:
    """Records every snapshot the outer step sends (the weights handed to ``algorithm.payload``)."""
    payload = strategy.algorithm.payload

    def recording_payload(state: Any, weights: torch.Tensor) -> torch.Tensor:
        record.setdefault("snapshots", []).append(weights.clone())
        return payload(state, weights)

    strategy.algorithm.payload = recording_payload


# What a run must do in every process after fit (a second trainer call, errors seen per rank, a signal
# to one process): Lightning's popen launcher runs this script in every process. Other runs fork the
# ranks from one process, which saves every rank but the first its Python and torch start-up.
PER_PROCESS = ("fit_twice", "then_validate", "validate_ckpt_path", "interrupted_save_to",
               "hide_replica_files_on_rank", "ready_at_step", "expect_errors", "then_resume")


def start_method_of(config: dict[str, Any]) -> str:
    if "start_method" in config:
        return config["start_method"]
    if any(key in config for key in PER_PROCESS) or "strategy_kwargs" not in config:
        return "popen"
    return "fork"


def option_groups(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A strategy's arguments from JSON: the option groups given as dicts become their config objects."""
    from lightning_loco import ElasticConfig, FSDPConfig, PacingConfig, WireConfig

    groups = {"wire": WireConfig, "pacing": PacingConfig, "elastic": ElasticConfig, "replica_sharding": FSDPConfig}
    return {k: groups[k](**v) if k in groups and isinstance(v, dict) else v for k, v in kwargs.items()}


def main(out_dir: str, config: dict[str, Any]) -> None:
    from lightning_loco.testing.launch import strategy_class

    log = CallLog()
    log.install()
    strategy: Any = config["strategy"]
    start_method = start_method_of(config)
    if "strategy_kwargs" in config or start_method != "popen":
        cls = strategy_class(strategy)
        timeout = timedelta(seconds=config.get("pg_timeout_s", 60))
        kwargs = option_groups(config.get("strategy_kwargs", {}))
        if config.get("fsdp_bf16"):  # FSDP2's mixed precision: bf16 parameters in compute, float32 reduction
            from torch.distributed.fsdp import MixedPrecisionPolicy

            from lightning_loco import FSDPConfig

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            kwargs["replica_sharding"] = FSDPConfig(kwargs={"mp_policy": policy})
        strategy = cls(timeout=timeout, start_method=start_method, **kwargs)
    recorder = Recorder(out_dir, log)
    callbacks: list[L.Callback] = [recorder]
    for key in ("record_consensus", "fail_at_step", "ready_at_step", "step_sleep_s", "step_sleep_s_by_rank",
                "track_release", "save_to", "interrupted_save_to", "save_at_step"):
        if key in config:
            recorder.record[key] = config[key]
    if not isinstance(strategy, str):
        observe(strategy, recorder.record, config)
        if "virtual_step_seconds" in config:
            strategy.replica._clock = VirtualClock(config["virtual_step_seconds"])  # the driver's clock
    if "checkpoint" in config:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(**config["checkpoint"]))
    if "batchnorm_update" in config:
        from lightning_loco import BatchNormUpdate

        callbacks.insert(0, BatchNormUpdate(**config["batchnorm_update"]))  # before the Recorder reads the end
    if config.get("replica_validation"):
        from lightning_loco import ReplicaValidation

        callbacks.append(ReplicaValidation())
    if "early_stopping" in config:
        callbacks.append(L.pytorch.callbacks.EarlyStopping(**config["early_stopping"]))
    if "outer_checkpoint" in config:
        from lightning_loco import OuterStepCheckpoint

        callbacks.append(OuterStepCheckpoint(**config["outer_checkpoint"]))
    logger: Any = False
    if "monitor" in config:
        from lightning_loco.trainer.monitoring import OuterStepMonitor

        callbacks.append(OuterStepMonitor(**config["monitor"]))
        logger = [L.pytorch.loggers.CSVLogger(out_dir, name="csv", version=0)]
        if config.get("tensorboard"):  # configured as our example configs do: no placeholder hp_metric
            logger.append(L.pytorch.loggers.TensorBoardLogger(out_dir, name="tb", version=0, default_hp_metric=False))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=config["devices"],
        max_steps=config["max_steps"],
        max_epochs=config.get("max_epochs"),
        accumulate_grad_batches=config.get("accumulate", 1),
        gradient_clip_val=config.get("clip"),
        precision=None if config.get("fp16_scaler") else config.get("precision", "32-true"),
        plugins=([MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=16.0))]
                 if config.get("fp16_scaler") else None),
        callbacks=callbacks,
        limit_val_batches=None if config.get("then_validate") or "val_check_interval" in config
        or "validate_ckpt_path" in config else 0,
        logger=logger,
        val_check_interval=config.get("val_check_interval"),
        check_val_every_n_epoch=None if "val_check_interval" in config else 1,
        num_sanity_val_steps=0,
        enable_checkpointing="checkpoint" in config or "outer_checkpoint" in config,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options = {"mismatch": config["model_parallel"] == "mismatch"} if config.get("model_parallel") else {}
    model = (TinyModelParallel if options else TinyRegressor)(
        lr=config.get("lr", 0.05), manual=config.get("manual", False), batchnorm=config.get("batchnorm", False),
        scheduler=config.get("scheduler", False), inf_loss_at=config.get("inf_loss_at"),
        batch_size=config.get("batch_size", 4), momentum=config.get("momentum", 0.0),
        nominal_schedule=config.get("nominal_schedule"), val_sync_dist=config.get("val_sync_dist", True), **options)
    if config.get("rank_dependent_init"):  # a module whose ranks initialise differently (no seed_everything)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(os.environ.get("LOCAL_RANK", "0")))
        recorder.record["built"] = flat(model)
    if "hide_replica_files_on_rank" in config and os.environ.get("LOCAL_RANK", "0") == str(
        config["hide_replica_files_on_rank"]
    ):
        # a shared filesystem that lags on this node: it does not see the replica files yet
        isfile = os.path.isfile
        os.path.isfile = lambda path: False if "/.replicas/" in str(path) else isfile(path)
    if "validate_ckpt_path" in config:
        trainer.validate(model, ckpt_path=config["validate_ckpt_path"], verbose=False)
        os.makedirs(out_dir, exist_ok=True)
        torch.save(flat(model), os.path.join(out_dir, f"validated{trainer.global_rank}.pt"))
    try:
        trainer.fit(model, ckpt_path=config.get("ckpt_path"))
    except BaseException as err:  # what each rank saw, for tests of failures
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"error{trainer.global_rank}.json"), "w") as f:
            json.dump({"type": type(err).__name__, "message": str(err), "pid": os.getpid()}, f)
        raise
    if config.get("fit_twice"):
        trainer.fit_loop.epoch_loop.max_steps = 2 * config["max_steps"]
        trainer.fit(model)
    if config.get("then_validate"):
        trainer.validate(model, verbose=False)
        torch.save(flat(model), os.path.join(out_dir, f"after_validate{trainer.global_rank}.pt"))
    if config.get("then_resume"):
        # a new Trainer and model in this same process resume from the checkpoint (storage that lives
        # in one process, such as fsspec's memory://); their records go to OUT_DIR/resumed
        again = {k: v for k, v in config.items() if k not in ("then_resume", "checkpoint")}
        main(os.path.join(out_dir, "resumed"), {**again, "ckpt_path": config["then_resume"], "start_method": "popen"})


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], json.loads(sys.argv[2]))
