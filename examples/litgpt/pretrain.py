"""LitGPT's GPT pretrained with NoLoCo across replicas, in a Fabric loop (docs/fabric.md).

    bash scripts/setup.sh                           # installs LitGPT too, without its CLI's pin (see below)
    .venv/bin/python examples/litgpt/pretrain.py    # 4 CPU processes, 200 steps, H = 25: about 40 s

The model is ``litgpt.GPT`` from LitGPT's named ``pythia-14m`` configuration with a byte vocabulary (256
tokens instead of Pythia's 50,304: nothing is downloaded, no tokenizer is needed, and the embedding no
longer dwarfs the rest), randomly initialised. The data is the example Shakespeare text as bytes, each
replica reading its own shard. The loop is written as LitGPT's ``pretrain.py`` writes its own: ``fabric.setup``
for the model, then the optimizer, the data loaders through Fabric, a warm-up and cosine learning rate set by
hand each step, gradient accumulation under ``fabric.no_backward_sync``, clipping, a validation loss now and
then, and a checkpoint at the end with ``fabric.save``. The strategy is the only change: NoLoCo instead of
FSDP, with ``max_steps`` so that the last step ends training (the replicas end on their average).

LitGPT 0.5.13 pins ``jsonargparse<=4.41`` for its command line, and ``lightning-loco`` needs 4.53 or newer for
LightningCLI; ``scripts/setup.sh`` installs LitGPT with ``--no-deps`` plus the packages its model
imports, and leaves torch, Lightning and jsonargparse as they are.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_loco
from lightning_loco.examples.text import TokenBlocks, shakespeare_files, split_each_file


def learning_rate(step: int, lr: float, warmup: int, max_steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak (LitGPT's schedule, by step)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def validate(fabric: L.Fabric, model: torch.nn.Module, loader: DataLoader, batches: int) -> float:
    """This replica's mean validation loss over ``batches`` batches (no collective: each replica its own)."""
    model.eval()
    losses = []
    for k, (x, y) in enumerate(loader):
        if k == batches:
            break
        logits = model(x)
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def main(args: argparse.Namespace) -> None:
    from litgpt import GPT, Config

    strategy = lightning_loco.NoLoCoFabricStrategy(sync_every=args.sync_every, max_steps=args.max_steps,
                                                   start_method=args.start_method)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(args.seed)  # the same initialisation on every replica (rank 0's is broadcast anyway)

    config = Config.from_name("pythia-14m", block_size=args.block_size, vocab_size=256, padded_vocab_size=256)
    with fabric.init_module():
        model = GPT(config)
    fabric.print(f"litgpt GPT from 'pythia-14m' with a byte vocabulary: "
                 f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {args.devices} replicas")
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)

    train_parts, val_tokens = split_each_file(shakespeare_files(), 0.05)
    train = TokenBlocks(torch.cat(train_parts), args.block_size)
    val = TokenBlocks(val_tokens, args.block_size)
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(train, batch_size=args.micro_batch_size, shuffle=True, drop_last=True),
        DataLoader(val, batch_size=args.micro_batch_size, shuffle=False),
    )

    step, epoch, started = 0, 0, time.perf_counter()
    batches = iter(train_loader)
    while step < args.max_steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.lr, args.warmup_steps, args.max_steps)
        for micro in range(args.accumulate):
            try:
                x, y = next(batches)
            except StopIteration:
                epoch += 1
                train_loader.sampler.set_epoch(epoch)
                batches = iter(train_loader)
                x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()  # every sync_every-th step: NoLoCo's outer step with one random peer
        optimizer.zero_grad()
        step += 1
        if step % args.log_every == 0 or step == args.max_steps:
            fabric.print(f"step {step}: train loss {loss.item():.3f} (replica 0), outer steps "
                         f"{fabric.strategy.outer_steps}, {time.perf_counter() - started:.1f} s")
    val_loss = validate(fabric, model, val_loader, args.val_batches)
    fabric.print(f"validation loss {val_loss:.3f} (replica 0, after the replicas' average at the end)")
    out = Path(args.out)
    fabric.save(out / "final.ckpt", {"model": model, "optimizer": optimizer, "step": step})
    fabric.print(f"saved {out / 'final.ckpt'} (the main file holds the replicas' average; each replica's own "
                 f"file is in the folder beside it)")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4, help="replicas, one process each (default 4)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=25, help="H (default 25: 8 outer steps in 200)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--start-method", default="popen", choices=["popen", "spawn", "fork"])
    parser.add_argument("--out", default="lightning_logs/litgpt")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
