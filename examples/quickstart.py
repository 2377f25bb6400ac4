"""Train a small byte-level GPT on Shakespeare with NoLoCo, GASLoC and DiLoCo, 4 CPU replicas each.

    python examples/quickstart.py                       # all three, then a comparison table
    python examples/quickstart.py --strategy noloco     # one run
    python examples/quickstart.py --strategy gasloc --strategy-args '{"topology": "ring"}'

All runs use the same model, data, seed, token budget and H; they differ only in the strategy
(each with its defaults, except H). Two validation losses: "replicas" is each replica's loss on its
share of the validation set, averaged over replicas (the papers' metric; replicas differ under NoLoCo
and GASLoC); "consensus" is the loss of the replicas' average, the model one would deploy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import lightning as L
import torch

from lightning_loco.examples.gpt import GPT
from lightning_loco.examples.text import ByteTextDataModule
from lightning_loco.testing.launch import strategy_class


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # several replicas share the machine's cores
    L.seed_everything(args.seed, verbose=False)
    # average_at_end=False keeps the replicas apart after fit, to measure them before averaging below.
    kwargs = {"sync_every": args.sync_every, "average_at_end": False, **json.loads(args.strategy_args)}
    strategy = strategy_class(args.strategy)(**kwargs)
    data = ByteTextDataModule(block_size=64, batch_size=16)
    model = GPT(block_size=64, max_steps=args.steps, warmup_steps=args.steps // 10)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        check_val_every_n_epoch=None,
        val_check_interval=10**9,  # validate once, after training
        limit_val_batches=args.val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_seconds = time.perf_counter() - start
    report = trainer.strategy.last_outer_step
    (replicas,) = trainer.validate(model, datamodule=data, verbose=False)
    trainer.strategy.average_replicas()
    (consensus,) = trainer.validate(model, datamodule=data, verbose=False)
    if trainer.global_rank == 0:
        result = {
            "strategy": args.strategy,
            "strategy_args": json.loads(args.strategy_args),
            "seed": args.seed,
            "replicas": trainer.world_size,
            "steps": args.steps,
            "sync_every": args.sync_every,
            "outer_steps": trainer.strategy.outer_steps,
            "bytes_sent_per_outer_step": report.bytes_sent if report else 0,
            "fit_seconds": round(fit_seconds, 1),
            "val_loss": replicas["val_loss"],
            "val_loss_consensus": consensus["val_loss"],
        }
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)


def compare(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("noloco", "gasloc", "diloco"):
            out = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, __file__, "--strategy", name, "--out", out, "--steps", str(args.steps),
                   "--devices", str(args.devices), "--sync-every", str(args.sync_every)]
            print(f"training {name} on {args.devices} CPU replicas for {args.steps} steps ...", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            with open(out) as f:
                rows.append(json.load(f))
    print(f"\nbyte-level GPT on Shakespeare, {args.devices} replicas, H = {args.sync_every}, {args.steps} steps")
    print(f"{'strategy':<8} {'val loss: replicas':>18} {'consensus':>10} {'outer steps':>12} "
          f"{'MB sent/outer step':>19} {'fit s':>7}")
    for r in rows:
        mb = r["bytes_sent_per_outer_step"] / 1e6
        print(f"{r['strategy']:<8} {r['val_loss']:>18.4f} {r['val_loss_consensus']:>10.4f} {r['outer_steps']:>12} "
              f"{mb:>19.3f} {r['fit_seconds']:>7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["noloco", "gasloc", "diloco"], help="one run; default: all, compared")
    parser.add_argument("--strategy-args", default="{}", help="JSON of extra strategy arguments (single run)")
    parser.add_argument("--steps", type=int, default=300, help="inner optimizer steps per replica")
    parser.add_argument("--devices", type=int, default=4, help="replicas (CPU processes)")
    parser.add_argument("--sync-every", type=int, default=50, help="H, inner steps between outer steps")
    parser.add_argument("--val-batches", type=int, default=40, help="validation batches per replica")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model's initialisation and the data order")
    parser.add_argument("--out", help="write the result of a single run as JSON")
    args = parser.parse_args()
    train(args) if args.strategy else compare(args)


if __name__ == "__main__":
    main()
