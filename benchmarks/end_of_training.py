"""The end of training: a run that ends exactly on an outer step, with and without the outer step's
momentum extrapolation in that last round (``final_outer_step``).

    python -m benchmarks.end_of_training              # ~1 min on 2 cores: every row, 3 seeds
    python -m benchmarks.end_of_training --quick      # ~10 s: NoLoCo "average" and "outer", 1 seed

A 2-layer MLP (8 → 32 → 1, tanh) regresses a fixed smooth function with noise (4096 training
samples, a held-out set of 2048), inner Adam (lr 0.01, batch 32), 2 CPU replicas forked by Lightning's
own launcher, H = 50 for every algorithm (DiLoCo's paper default is 500, which would give no outer
step here), every other argument the strategies' default, ``average_at_end=True``. Each run trains
for ``max_steps`` = 300 (the 6th outer step is the last step of ``fit``) or 320 (20 inner steps after
it), and the table gives the held-out MSE of the model ``fit`` leaves in memory (the replicas'
average). DDP is the reference; "NoLoCo, α = 0" is NoLoCo with ``outer_momentum=0`` and the papers'
plain last outer step. Writes ``benchmarks/results/end_of_training.json`` (a ``--quick`` run writes
to a temporary folder instead, or to ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import machine, results_dir, table

IN, HIDDEN = 8, 32
SYNC_EVERY = 50
LENGTHS = (300, 320)  # ends on the 6th outer step; 20 inner steps later
# name: (strategy, strategy arguments)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "noloco average": ("noloco", {"final_outer_step": "average"}),
    "noloco outer": ("noloco", {"final_outer_step": "outer"}),
    "noloco outer, α = 0": ("noloco", {"final_outer_step": "outer", "outer_momentum": 0.0}),
    "gasloc average": ("gasloc", {"final_outer_step": "average"}),
    "gasloc outer": ("gasloc", {"final_outer_step": "outer"}),
    "diloco average": ("diloco", {"final_outer_step": "average"}),
    "diloco outer": ("diloco", {"final_outer_step": "outer"}),
}
QUICK_CONFIGS = ("noloco average", "noloco outer")


def regression_data(samples: int, seed: int) -> TensorDataset:
    """y = tanh(x·A)·b + 0.1·noise, with A and b fixed whatever ``seed`` (which draws x and the noise)."""
    a = torch.randn(IN, 16, generator=torch.Generator().manual_seed(7)) / IN**0.5
    b = torch.randn(16, 1, generator=torch.Generator().manual_seed(8))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, IN, generator=g)
    return TensorDataset(x, torch.tanh(x @ a) @ b + 0.1 * torch.randn(samples, 1, generator=g))


def make_module(seed: int, lr: float) -> Any:
    import lightning as L

    class MLPRegressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=lr)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(regression_data(4096, seed=1), batch_size=32, shuffle=True)

    return MLPRegressor()


def held_out_mse(module: nn.Module) -> float:
    x, y = regression_data(2048, seed=99).tensors
    with torch.no_grad():
        return nn.functional.mse_loss(module(x), y).item()


def train(config: str, max_steps: int, seed: int = 0, lr: float = 0.01) -> float:
    """One fit on 2 forked CPU replicas; the held-out MSE of the model it leaves in memory (rank 0's,
    which ``average_at_end`` made the replicas' average)."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_loco.testing.launch import strategy_class

    name, kwargs = CONFIGS[config]
    L.seed_everything(seed, verbose=False)  # also seeds the DistributedSampler's shuffle (PL_GLOBAL_SEED)
    if name == "ddp":
        strategy: Any = DDPStrategy(start_method="fork")
    else:
        strategy = strategy_class(name)(sync_every=SYNC_EVERY, start_method="fork", **kwargs)
    module = make_module(seed, lr)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)  # the fork launcher loads rank 0's final weights into ``module``
    return held_out_mse(module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_CONFIGS)} only, seed 0")
    parser.add_argument("--seeds", type=int, help="seeds per row (default 3; quick: 1)")
    parser.add_argument("--lr", type=float, default=0.01, help="inner Adam learning rate")
    parser.add_argument("--out", help="default: end_of_training.json in benchmarks/results (quick: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import logging
    import warnings

    import lightning  # noqa: F401  (sets its loggers' level on import: quieten them afterwards)

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    configs = QUICK_CONFIGS if args.quick else tuple(CONFIGS)
    started = time.perf_counter()
    mse: dict[str, dict[int, list[float]]] = {c: {n: [] for n in LENGTHS} for c in configs}
    for seed in seeds:
        for config in configs:
            for steps in LENGTHS:
                mse[config][steps].append(train(config, steps, seed, args.lr))
                print(f"seed {seed} {config} max_steps={steps}: {mse[config][steps][-1]:.4f}", flush=True)
    rows = []
    for config in configs:
        ends, later = mse[config][LENGTHS[0]], mse[config][LENGTHS[1]]
        ratios = [a / b for a, b in zip(ends, later)]
        rows.append({"config": config, "strategy": CONFIGS[config][0], "kwargs": CONFIGS[config][1],
                     f"mse_{LENGTHS[0]}": ends, f"mse_{LENGTHS[1]}": later,
                     "median_end": statistics.median(ends), "median_later": statistics.median(later),
                     "ratio": ratios, "median_ratio": statistics.median(ratios)})
    print(f"\nheld-out MSE after fit, 2 replicas, H = {SYNC_EVERY}, inner Adam lr {args.lr}, median of "
          f"{len(seeds)} seed(s); ratio = MSE at {LENGTHS[0]} / MSE at {LENGTHS[1]} (per seed, median)")
    print(table(rows, [("config", "config", ""), ("median_end", f"max_steps={LENGTHS[0]}", ".4f"),
                       ("median_later", f"max_steps={LENGTHS[1]}", ".4f"), ("median_ratio", "ratio", ".2f")]))
    out = Path(args.out or results_dir(args.quick) / "end_of_training.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": machine(), "replicas": 2, "sync_every": SYNC_EVERY, "inner_lr": args.lr, "seeds": seeds,
        "lengths": list(LENGTHS), "seconds": round(time.perf_counter() - started, 1), "rows": rows,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
