"""Plots the TensorBoard metrics of the example runs into one PNG (used in docs/metrics.md).

    python examples/shakespeare/plot_metrics.py [--logdir lightning_logs/shakespeare] [--out docs/img/metrics.png]

Run the four configs in this folder first (``lightning-loco fit --config examples/shakespeare/<name>.yaml``).
Each run logs to ``<logdir>/<name>/version_<n>``; the latest version of each is plotted. The spread
panel shows ``outer/replica_spread`` where a run opted in to it (``spread_every``), otherwise the
free, local ``outer/peer_distance``.
"""

from __future__ import annotations

import argparse
import glob
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

RUNS = ("noloco", "gasloc", "diloco", "ddp")


def latest_version(logdir: str, run: str) -> str | None:
    """``<logdir>/<run>/version_<n>`` with the largest n (every run of a config gets a new version)."""
    versions = glob.glob(os.path.join(logdir, run, "version_*"))
    numbered = [(int(v.rsplit("_", 1)[1]), v) for v in versions if v.rsplit("_", 1)[1].isdigit()]
    return max(numbered)[1] if numbered else None


def load(path: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(path)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="lightning_logs/shakespeare")
    parser.add_argument("--out", default="docs/img/metrics.png")
    args = parser.parse_args()
    paths = {run: latest_version(args.logdir, run) for run in RUNS}
    runs = {run: load(path) for run, path in paths.items() if path is not None}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        ("val/loss_replicas", "validation loss, mean over replicas", axes[0, 0]),
        ("val/loss_consensus", "validation loss of the consensus model", axes[0, 1]),
        (("outer/replica_spread", "outer/peer_distance"),
         "replica spread (RMS distance from the mean) or peer distance",
         axes[1, 0]),
        ("outer/pseudo_gradient_norm", "pseudo-gradient norm (rank 0)", axes[1, 1]),
    ]
    for tags, title, ax in panels:
        tags = (tags,) if isinstance(tags, str) else tags
        for run, scalars in runs.items():
            tag = next((t for t in tags if t in scalars), None)
            if tag is not None:
                steps, values = zip(*scalars[tag])
                label = run if len(tags) == 1 else f"{run} ({tag.split('/')[1]})"
                ax.plot(steps, values, marker="o", label=label)
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
