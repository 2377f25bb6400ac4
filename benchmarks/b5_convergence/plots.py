"""B5's PNGs: consensus loss against tokens and bytes per N (``b5_convergence_n{N}.png``), and
against bytes per wire format (``b5_codecs.png``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.b5_convergence.grid import CODEC_METHODS, CODECS, MAIN_METHODS


def codec_plot(records: list[dict[str, Any]], folder: Path) -> list[str]:
    """Consensus loss against MB sent per replica, one panel per method, one line per wire format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["part"] == "codecs"]
    if not runs:
        return []
    methods = [m for m in CODEC_METHODS if any(r["method"] == m for r in runs)]
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.8), squeeze=False)
    for ax, method in zip(axes[0], methods):
        tops: list[float] = []
        for k, wire in enumerate(CODECS):
            chosen = [r for r in runs if r["method"] == method and r.get("wire") == wire]
            if not chosen:
                continue
            points = list(zip(*[[p["consensus"] for p in r["curve"]] for r in chosen]))
            mean = [statistics.mean(p) for p in points]
            mbytes = [p["bytes_per_replica"] / 1e6 for p in chosen[0]["curve"]]
            sent = [(b, m) for b, m in zip(mbytes, mean) if b > 0]
            ax.plot([b for b, _ in sent], [m for _, m in sent], marker=".", lw=1.1, color=f"C{k}",
                    label=f"{wire} ({len(chosen)} seeds)")
            tops.append(max(m for _, m in sent[1:]) if len(sent) > 1 else sent[-1][1])
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per replica (log)")
        ax.set_ylabel("consensus validation loss")
        ax.set_title(f"{method}, N=4 iid: loss against bytes", fontsize=9)
        ax.set_ylim(top=max(tops) + 0.02)  # from the second measuring point: the first one dwarfs the rest
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = folder / "b5_codecs.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path.name]


def plots(records: list[dict[str, Any]], folder: Path, quick: bool) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    mains = [r for r in records if r["part"] == "main"]
    for n in sorted({r["replicas"] for r in mains}):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
        for col, split in enumerate(("iid", "non_iid")):
            for method in MAIN_METHODS:
                runs = [r for r in mains if r["replicas"] == n and r["split"] == split and r["method"] == method]
                if not runs:
                    continue
                points = list(zip(*[[p["consensus"] for p in r["curve"]] for r in runs]))
                mean = [statistics.mean(p) for p in points]
                tokens = [p["tokens"] / 1e6 for p in runs[0]["curve"]]
                mbytes = [p["bytes_per_replica"] / 1e6 for p in runs[0]["curve"]]
                color = f"C{MAIN_METHODS.index(method)}"  # the same colour for a method in every panel
                axes[0][col].plot(tokens, mean, label=method, lw=1.2, color=color)
                if method != "independent":  # it sends nothing: no point on a log axis of bytes
                    sent = [(b, m) for b, m in zip(mbytes, mean) if b > 0]
                    axes[1][col].plot([b for b, _ in sent], [m for _, m in sent], label=method, lw=1.2, marker=".",
                                      color=color)
            axes[0][col].set_title(f"N={n}, {split}: consensus validation loss (mean of seeds)", fontsize=9)
            axes[0][col].set_xlabel("tokens (millions, all replicas)")
            axes[1][col].set_xscale("log")
            axes[1][col].set_xlabel("MB sent per replica (log)")
            for ax in (axes[0][col], axes[1][col]):
                ax.set_ylabel("loss")
                ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"b5_convergence_n{n}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path.name)
    return written
