"""Plots the TensorBoard metrics of the example runs into one PNG (used in docs/metrics.md).

    python examples/shakespeare/plot_metrics.py [--logdir lightning_logs/shakespeare] [--out docs/img/metrics.png]

Run the four configs in this folder first (``lightning-loco fit --config examples/shakespeare/<name>.yaml``).
"""

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

RUNS = ("noloco", "gasloc", "diloco", "ddp")


def load(logdir: str, run: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(os.path.join(logdir, run))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="lightning_logs/shakespeare")
    parser.add_argument("--out", default="docs/img/metrics.png")
    args = parser.parse_args()
    runs = {run: load(args.logdir, run) for run in RUNS if os.path.isdir(os.path.join(args.logdir, run))}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        ("val/loss_replicas", "validation loss, mean over replicas", axes[0, 0]),
        ("val/loss_consensus", "validation loss of the consensus model", axes[0, 1]),
        ("outer/replica_spread", "replica spread (RMS distance from the mean)", axes[1, 0]),
        ("outer/pseudo_gradient_norm", "pseudo-gradient norm (rank 0)", axes[1, 1]),
    ]
    for tag, title, ax in panels:
        for run, scalars in runs.items():
            if tag in scalars:
                steps, values = zip(*scalars[tag])
                ax.plot(steps, values, marker="o", label=run)
        ax.set_title(title)
        ax.set_xlabel("global step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("byte-level GPT on Shakespeare, 4 CPU replicas, H = 50 (examples/shakespeare/*.yaml)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
