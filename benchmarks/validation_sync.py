"""What synchronises every replica during validation: torch.distributed calls per validation run, counted per
Lightning feature, with Lightning's default (global) validation and with ``ReplicaValidation``.

    python -m benchmarks.validation_sync            # ~1 min on 2 cores: every feature, 4 CPU replicas
    python -m benchmarks.validation_sync --quick    # ~15 s: all features together, both modes
    python -m benchmarks.validation_sync --wan      # the seconds per validation on an emulated WAN (root)

A small regressor (4 → 8 → 1) trains under NoLoCo (H = 4) on N CPU ranks forked as torchrun starts them,
``val_check_interval`` = 3 training batches, 2 validation runs. Each rank counts every torch.distributed call
made from the start of a validation run to the next training batch (ModelCheckpoint and EarlyStopping act at the
end of validation), as ``global`` (over all ranks) or ``subgroup`` (a replica's own ranks). Features:

* ``sync_dist``: ``self.log("val_loss", loss, sync_dist=True)`` in ``validation_step``;
* ``torchmetrics``: a ``MeanSquaredError`` object updated in ``validation_step`` and logged, without ``sync_dist``;
* ``OuterStepMonitor``: ours, with ``mean_over_replicas=True`` in the global mode (``val/loss_replicas``, as the
  example configs ask) and its default (each replica's own ``val/loss_local``) in the replica mode;
* ``ModelCheckpoint``: ``monitor="val_loss"``, ``save_top_k=2``, ``save_last=True`` (each save adds its own
  collectives: a broadcast, an all-reduce of the weights for the consensus, a barrier);
* ``EarlyStopping``: ``monitor="val_loss"``, ``patience`` large enough never to stop.

Every feature needs a logged ``val_loss``: the rows but ``sync_dist`` log it without ``sync_dist``. Writes
``validation_sync.json`` (``benchmarks/results``, or a temporary folder with ``--quick``, or
``$LOCO_BENCH_RESULTS``).

``--wan``: the same runs with one process per node on an emulated WAN (:mod:`benchmarks.netem`, packet-level, 100
Mbit/s and 50 ms one way between every two nodes; needs root), ``VALIDATIONS_WAN`` validation runs each, and the
wall time of each validation run on rank 0 (from its start to the next training batch: the validation itself,
the callbacks' decisions and saves, every collective), as a median with its range; also a run whose validation has
no feature at all (a plain ``self.log``), the floor. Writes ``validation_sync_wan.json``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import results_dir, table, write_json

FEATURES = ("sync_dist", "torchmetrics", "OuterStepMonitor", "ModelCheckpoint", "EarlyStopping")
MODES = ("global", "replica")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "barrier", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "scatter")
VAL_EVERY, VALIDATIONS, VALIDATIONS_WAN = 3, 2, 4


class Counter:
    """Wraps torch.distributed's collectives in this process; counts them while ``active``."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.active, self.counts = False, collections.Counter()
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        import torch.distributed as dist

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                try:
                    group = inspect.signature(original).bind(*args, **kwargs).arguments.get("group")
                except TypeError:
                    group = None
                everyone = group is None or group is dist.group.WORLD
                everyone = everyone or dist.get_world_size(group) == dist.get_world_size()
                self.counts[("global" if everyone else "subgroup") + ":" + name] += 1
            return original(*args, **kwargs)

        return counted


def make_module(features: tuple[str, ...]) -> Any:
    import lightning as L
    from torchmetrics import MeanSquaredError

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.val_mse = MeanSquaredError() if "torchmetrics" in features else None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            pred = self.net(x)
            loss = nn.functional.mse_loss(pred, y)
            self.log("val_loss", loss, sync_dist="sync_dist" in features)
            if self.val_mse is not None:
                self.val_mse(pred, y)
                self.log("val_mse", self.val_mse)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regressor()


def data(samples: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(samples, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=g))


def run_rank(out: Path, features: tuple[str, ...], mode: str, world: int, ranks_per_replica: int, rank: int,
             validations: int = VALIDATIONS, nodes: int = 1) -> None:
    """One rank's run; writes its counts (``rank<R>.json``) and the seconds of each validation run. ``nodes``: one
    process per node (the emulated network's way), else ``world`` processes on this node."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from lightning_loco import NoLoCoStrategy, ReplicaValidation
    from lightning_loco.trainer.monitoring import OuterStepMonitor

    torch.set_num_threads(1)
    counter = Counter()
    seconds: list[float] = []

    class Window(L.Callback):
        """Counts, and times, from a validation run's start to the next training batch (or the end of training)."""

        def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            counter.active = not trainer.sanity_checking
            self.start = time.perf_counter()

        def _close(self) -> None:
            if counter.active:
                seconds.append(time.perf_counter() - self.start)
            counter.active = False

        def on_train_batch_start(self, *args: Any) -> None:
            self._close()

        def on_train_end(self, *args: Any) -> None:
            self._close()

    callbacks: list[Any] = [Window()]
    if mode == "replica":
        callbacks.append(ReplicaValidation())
    if "OuterStepMonitor" in features:
        callbacks.append(OuterStepMonitor(mean_over_replicas=mode == "global"))
    if "ModelCheckpoint" in features:
        callbacks.append(ModelCheckpoint(dirpath=str(out / "ckpts"), monitor="val_loss", save_top_k=2,
                                         save_last=True, filename="{step}-{val_loss:.4f}"))
    if "EarlyStopping" in features:
        callbacks.append(EarlyStopping(monitor="val_loss", patience=1000, check_on_train_epoch_end=False))
    trainer = L.Trainer(
        strategy=NoLoCoStrategy(sync_every=4, ranks_per_replica=ranks_per_replica, start_method="popen"),
        accelerator="cpu", devices=world // nodes, num_nodes=nodes, max_steps=VAL_EVERY * validations,
        val_check_interval=VAL_EVERY,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=False, callbacks=callbacks,
        enable_checkpointing="ModelCheckpoint" in features, enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(data(), batch_size=4)
    trainer.fit(make_module(features), loader, DataLoader(data(32), batch_size=8))
    (out / f"rank{rank}.json").write_text(json.dumps(counter.counts))
    (out / f"seconds{rank}.json").write_text(json.dumps(seconds))


def measure(features: tuple[str, ...], mode: str, world: int, ranks_per_replica: int, folder: Path,
            validations: int = VALIDATIONS) -> dict[str, Any]:
    from lightning_loco.testing.launch import fork_ranks

    out = folder / f"{mode}-{'+'.join(features)}-{world}x{validations}"
    proc = fork_ranks(lambda rank: run_rank(out, features, mode, world, ranks_per_replica, rank, validations), world,
                      out, 300, ["validation_sync", mode, *features])
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    counts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    most = max(counts, key=lambda c: sum(c.values()))  # rank 0 saves: the busiest rank
    per_validation = {k: v / validations for k, v in sorted(most.items())}
    return {"features": list(features), "mode": mode, "per_validation": per_validation,
            "global": sum(v for k, v in per_validation.items() if k.startswith("global:")),
            "global_barriers": per_validation.get("global:barrier", 0.0),
            "subgroup": sum(v for k, v in per_validation.items() if k.startswith("subgroup:"))}


def measure_wan(features: tuple[str, ...], mode: str, world: int, folder: Path) -> dict[str, Any]:
    """One run on the emulated WAN (one process per node): the calls, and rank 0's seconds per validation run."""
    from benchmarks.netem.launch import run_workers
    from benchmarks.netem.links import uniform

    out = folder / f"wan-{mode}-{'+'.join(features) or 'none'}"
    out.mkdir(parents=True, exist_ok=True)
    job = json.dumps({"out": str(out), "features": list(features), "mode": mode, "world": world})
    run_workers("emulated", uniform(world), lambda i: ["-m", "benchmarks.validation_sync", "--worker", job],
                timeout=900)
    seconds = json.loads((out / "seconds0.json").read_text())
    counts = json.loads((out / "rank0.json").read_text())
    return {"features": list(features), "mode": mode, "validations": len(seconds), "seconds": seconds,
            "median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
            "global": sum(v for k, v in counts.items() if k.startswith("global:")) / max(1, len(seconds))}


def wan(world: int) -> None:
    """``--wan``: seconds per validation run on the emulated WAN, every feature and all together, both modes."""
    from benchmarks.netem.tun import available

    ok, why = available()
    if not ok:
        raise SystemExit(f"--wan needs the packet-level emulator: {why}")
    cases = [()] + [(f,) for f in FEATURES] + [FEATURES]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for features in cases:
            for mode in (MODES if features else ("global",)):
                rows.append(measure_wan(features, mode, world, Path(tmp)))
                print(f"{'+'.join(features) or 'none'} {mode}: {rows[-1]['median_s']:.3f} s", flush=True)
    floor = rows[0]["median_s"]
    for row in rows:
        row["feature"] = ("none (a plain self.log)" if not row["features"] else
                          "all of them" if len(row["features"]) > 1 else row["features"][0])
        row["over_floor_s"] = row["median_s"] - floor
    print(table(rows, [("feature", "feature", "s"), ("mode", "validation", "s"), ("global", "global calls", "g"),
                       ("median_s", "s per validation (median)", ".3f"), ("min_s", "min", ".3f"),
                       ("max_s", "max", ".3f"), ("over_floor_s", "over the floor", "+.3f")]))
    path = write_json("validation_sync_wan.json", {
        "world": world, "network": "emulated, 100 Mbit/s, 50 ms one way between every two nodes",
        "validations": VALIDATIONS_WAN, "strategy": "noloco, sync_every=4", "rows": rows,
        "command": "python -m benchmarks.validation_sync --wan",
    }, results_dir(False))
    print(f"wrote {path}")


def worker(job: dict[str, Any]) -> None:
    """One node's rank of a ``--wan`` run (torchrun's variables set by :func:`benchmarks.netem.launch.run_workers`)."""
    rank, world = int(os.environ["RANK"]), job["world"]
    run_rank(Path(job["out"]), tuple(job["features"]), job["mode"], world, 1, rank, VALIDATIONS_WAN, nodes=world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="all features together only, in both modes")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ranks-per-replica", type=int, default=1)
    parser.add_argument("--wan", action="store_true", help="seconds per validation on the emulated WAN (root)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.wan:
        wan(args.world)
        return
    cases = [(f,) for f in FEATURES] + [FEATURES]
    if args.quick:
        cases = [FEATURES]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for features in cases:
            for mode in MODES:
                rows.append(measure(features, mode, args.world, args.ranks_per_replica, Path(tmp)))
    for row in rows:
        row["feature"] = "all of them" if len(row["features"]) > 1 else row["features"][0]
        row["calls"] = ", ".join(f"{v:g} {k}" for k, v in row["per_validation"].items()) or "none"
    print(table(rows, [("feature", "feature", "s"), ("mode", "validation", "s"), ("global", "global", "g"),
                       ("global_barriers", "of them barriers", "g"), ("subgroup", "within a replica", "g"),
                       ("calls", "calls per validation run", "s")]))
    path = write_json("validation_sync.json", {
        "world": args.world, "ranks_per_replica": args.ranks_per_replica, "validations": VALIDATIONS,
        "strategy": "noloco, sync_every=4", "rows": rows,
        "command": "python -m benchmarks.validation_sync" + (" --quick" if args.quick else ""),
    }, results_dir(args.quick))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
