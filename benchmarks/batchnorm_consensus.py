"""BatchNorm statistics of the consensus model: the module's initial ones, the replicas' average (what fit ends
with), or re-estimated under the consensus weights (``BatchNormUpdate``), in the training simulator.

    python -m benchmarks.batchnorm_consensus            # 3 seeds × 2 splits: about a minute on 2 cores
    python -m benchmarks.batchnorm_consensus --quick    # seconds: one seed, a short run

An MLP with BatchNorm (8 → 64 → BN → ReLU → 64 → BN → ReLU → 1) learns a fixed random regression from 8
features, as 4 NoLoCo replicas (H = 10, AdamW at 3e-3, 300 steps, batches of 32) in one process
(:class:`lightning_loco.simulator.TrainingSimulator`: the strategies' own driver and outer step). Two splits:
``iid`` (every replica draws its inputs from one distribution) and ``shifted`` (replica i's inputs have
their mean moved by i along one direction: each replica's running statistics describe its own inputs).
The consensus model (the replicas' average weights) is evaluated on held-out data from all replicas'
distributions with three sets of statistics:

* ``init``: the module's as built (0 and 1: what the simulator's consensus used before it averaged buffers);
* ``averaged``: the replicas' running statistics averaged (what fit's ``average_at_end`` and a checkpoint's
  main file hold);
* ``re-estimated``: reset, then the cumulative average over 32 of each replica's own training batches under the
  consensus weights, averaged over the replicas (``lightning_loco.BatchNormUpdate``).

Reported: the mean squared error of each, median and spread over the seeds, and re-estimated ÷ averaged.
Writes ``benchmarks/results/batchnorm_consensus.json`` (``--quick``: a temporary folder, or ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import machine, results_dir, spread, table, write_json
from lightning_loco.algorithms import NoLoCo
from lightning_loco.replica.batchnorm import reestimate
from lightning_loco.simulator import TrainingSimulator

FEATURES, HIDDEN = 8, 64
FULL = {"replicas": 4, "sync_every": 10, "steps": 300, "batch_size": 32, "seeds": 3, "update_batches": 32}
QUICK = {"replicas": 4, "sync_every": 5, "steps": 20, "batch_size": 16, "seeds": 1, "update_batches": 4}


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def data(replica: int, split: str, seed: int, samples: int, held_out: bool = False) -> TensorDataset:
    """Replica ``replica``'s inputs (shifted by ``replica`` along the first feature in the shifted split) and the
    one target function of the seed, which every replica learns (``held_out``: other inputs, the same function)."""
    g = torch.Generator().manual_seed(1000 * seed + replica + (500 if held_out else 0))
    x = torch.randn(samples, FEATURES, generator=g)
    if split == "shifted":
        x[:, 0] += 2.0 * replica
    w = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(seed))
    y = torch.tanh(x @ w) + 0.1 * x[:, :1] ** 2
    return TensorDataset(x, y)


def one_run(split: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    n, bs = settings["replicas"], settings["batch_size"]
    torch.manual_seed(seed)
    module = Regressor()
    train = [data(i, split, seed, settings["steps"] * bs) for i in range(n)]
    shards = [DataLoader(d, batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(seed + i))
              for i, d in enumerate(train)]
    sim = TrainingSimulator(module, shards, NoLoCo(outer_lr=0.5, outer_momentum=0.25),
                            sync_every=settings["sync_every"], max_steps=settings["steps"], batched=False)
    for _ in range(settings["steps"]):
        sim.step()
    sim.finish()
    held_out = [data(i, split, seed, 512, held_out=True) for i in range(n)]
    x = torch.cat([d.tensors[0] for d in held_out])
    y = torch.cat([d.tensors[1] for d in held_out])

    def mse(model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            return nn.functional.mse_loss(model(x), y).item()

    consensus = sim.consensus_module()  # the averaged statistics
    averaged = mse(consensus)
    init = sim.consensus_module()
    with torch.no_grad():
        for buffer, fresh in zip(init.buffers(), Regressor().buffers()):
            buffer.copy_(fresh)
    initial = mse(init)
    per_replica = []
    for i in range(n):
        model = sim.consensus_module()
        batches = [train[i][j * bs:(j + 1) * bs] for j in range(settings["update_batches"])]
        reestimate(model, batches)
        per_replica.append(dict(model.named_buffers()))
    updated = sim.consensus_module()
    with torch.no_grad():
        for name, buffer in updated.named_buffers():
            if buffer.is_floating_point():
                buffer.copy_(torch.stack([b[name] for b in per_replica]).mean(0))
    return {"split": split, "seed": seed, "init": initial, "averaged": averaged, "reestimated": mse(updated)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, a short run (a smoke run)")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    started = time.perf_counter()
    runs = [one_run(split, seed, settings) for split in ("iid", "shifted") for seed in range(settings["seeds"])]
    rows = []
    for split in ("iid", "shifted"):
        mine = [r for r in runs if r["split"] == split]
        row: dict[str, Any] = {"split": split}
        for key in ("init", "averaged", "reestimated"):
            row[key] = spread([r[key] for r in mine])
            row[f"{key}_m"] = row[key]["median"]
        row["ratio"] = spread([r["reestimated"] / r["averaged"] for r in mine])
        row["ratio_m"] = row["ratio"]["median"]
        row["ratio_range"] = f"{row['ratio']['min']:.3f}-{row['ratio']['max']:.3f}"
        rows.append(row)
    print(f"\nBatchNorm MLP, {settings['replicas']} NoLoCo replicas, H = {settings['sync_every']}, "
          f"{settings['steps']} steps, {settings['seeds']} seed(s), on {machine()}; consensus MSE on held-out data "
          "(median over seeds)")
    print(table(rows, [("split", "split", ""), ("init_m", "init stats", ".4f"), ("averaged_m", "averaged", ".4f"),
                       ("reestimated_m", "re-estimated", ".4f"), ("ratio_m", "re-estimated / averaged", ".3f"),
                       ("ratio_range", "range", "")]))
    out = write_json("batchnorm_consensus.json", {
        "machine": machine(), "settings": settings, "seconds": round(time.perf_counter() - started, 1),
        "rows": rows, "runs": runs}, folder=results_dir(args.quick))
    print(f"wrote {out}")
    if any(math.isnan(r[k]) for r in runs for k in ("init", "averaged", "reestimated")):
        raise SystemExit("a loss is not a number")


if __name__ == "__main__":
    main()
