"""B2, time to loss: the Shakespeare GPT example on 4 replicas with the same token budget under DDP,
DiLoCo, NoLoCo, GASLoC, and independent replicas that never communicate (the floor).

    python -m benchmarks.b2_time_to_loss                 # ~10 min; the slow network is emulated where root
    python -m benchmarks.b2_time_to_loss --quick         # ~15 s: 2 replicas, 10 steps, 3 methods, slow network only

Every method runs twice: on loopback, which is the compute-only limit (the same work with next to no
network cost), and on the slow network (100 Mbit/s, 50 ms one way; packet-level emulation with root,
the in-process model otherwise, and the output says which). A rank-0 callback records the training
wall time (validation excluded) and the validation loss (mean over replicas) at each validation.
The target loss is the highest final loss among the communicating methods on loopback, so that all
of them reach it; time to target is interpolated between validations. Each method's ratio compares
its time to target on the slow network with its own compute-only time. ``--no-compute-only`` (the
default with ``--quick``) skips the loopback runs: the target then comes from the slow network's
final losses, and the compute-only times and ratios are left empty.

The strategies keep their defaults except H (``--sync-every``, 50 for all: the example's setting;
DiLoCo's paper uses 500, too long for a 300-step run). Writes ``benchmarks/results/<out>.json`` and ``.png``
(a ``--quick`` run writes them to a temporary folder instead, or to ``$LOCO_BENCH_RESULTS``).

With overlap (``--overlap 0 H/4 auto``; ~20 min) every low-communication method runs once per
``overlap_steps`` value, on both networks, and the table adds the final-loss change against τ = 0
and the exposed communication: the time landings (or synchronous outer steps) waited for the
network, as a share of the training wall time::

    python -m benchmarks.b2_time_to_loss --overlap 0 H/4 auto                       # b2_overlap.json
    python -m benchmarks.b2_time_to_loss --overlap 0 H/4 auto --network one_slow    # b2_overlap_one_slow.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import yaml

from benchmarks.common import RESULTS, ROOT, machine, results_dir, table, write_json
from benchmarks.netem import launch, tun
from benchmarks.netem.links import Network, one_slow, uniform

METHODS: dict[str, Any] = {
    "ddp": "ddp",
    "diloco": {"class_path": "lightning_loco.DiLoCoStrategy", "init_args": {"sync_every": 50}},
    "noloco": {"class_path": "lightning_loco.NoLoCoStrategy", "init_args": {"sync_every": 50}},
    "gasloc": {"class_path": "lightning_loco.GASLoCStrategy", "init_args": {"sync_every": 50}},
    "independent": {"class_path": "lightning_loco.NoLoCoStrategy",
                    "init_args": {"sync_every": 10**9, "average_at_end": False}},
}


def overlap_value(text: str, sync_every: int) -> Any:
    """``"auto"``, ``"H/4"`` (a quarter of H) or an integer."""
    if text == "auto":
        return "auto"
    if text.upper().startswith("H/"):
        return sync_every // int(text[2:])
    return int(text)


def config(method: str, n: int, steps: int, val_every: int, sync_every: int, out: str, root: str) -> dict:
    base = yaml.safe_load((ROOT / "examples" / "shakespeare" / "noloco.yaml").read_text())
    trainer = base["trainer"]
    name, _, overlap = method.partition("@")  # "noloco@12": NoLoCo with overlap_steps=12
    strategy = METHODS[name]
    if isinstance(strategy, dict) and name != "independent":
        init_args = {**strategy["init_args"], "sync_every": sync_every}
        if overlap:
            init_args["overlap_steps"] = overlap_value(overlap, sync_every)
        strategy = {**strategy, "init_args": init_args}
    trainer.update(
        strategy=strategy, devices=1, num_nodes=n, max_steps=steps, val_check_interval=val_every,
        limit_val_batches=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )
    data = base["data"]["init_args"]
    tokens_per_step = n * data["batch_size"] * data["block_size"]
    trainer["callbacks"] = [
        {"class_path": "benchmarks.netem.lightning_worker.TimeToLoss",
         "init_args": {"out": out, "tokens_per_step": tokens_per_step}},
        {"class_path": "benchmarks.netem.lightning_worker.ModelledNetwork"},
    ]
    base["model"]["init_args"]["max_steps"] = steps
    return base


def run(method: str, mode: str, network: Network, steps: int, val_every: int, sync_every: int) -> dict:
    """One training run: ``{"curve": [...], "rounds": [...], "train_seconds": ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "curve.json")
        cfg = Path(tmp) / "config.yaml"
        cfg.write_text(yaml.safe_dump(config(method, len(network.links), steps, val_every, sync_every, out, tmp)))
        launch.run_workers(mode, network,
                           lambda i: ["-m", "benchmarks.netem.lightning_worker", "fit", "--config", str(cfg)])
        return json.loads(Path(out).read_text())


def exposed_share(result: dict) -> Optional[float]:
    """The time outer steps kept training waiting for the network, over the training wall time."""
    if not result["rounds"] or not result["train_seconds"]:
        return None
    return sum(r["comm_seconds"] for r in result["rounds"]) / result["train_seconds"]


def time_to(curve: list[dict], target: float, key: str) -> Optional[float]:
    """Interpolated ``key`` (train_seconds or tokens) at which the validation loss first reaches target."""
    previous = {"val_loss": float("inf"), key: 0.0}
    for point in curve:
        if point["val_loss"] <= target:
            if previous["val_loss"] == float("inf"):
                return point[key]
            frac = (previous["val_loss"] - target) / (previous["val_loss"] - point["val_loss"])
            return previous[key] + frac * (point[key] - previous[key])
        previous = point
    return None


def plot(results: dict, target: float, slow_mode: str, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (method, runs) in enumerate(results.items()):
        color = f"C{i}"
        for mode, curve in runs.items():
            style = "--" if mode == "loopback" else "-"
            label = f"{method} ({'compute-only' if mode == 'loopback' else mode})"
            axes[0].plot([p["tokens"] / 1e6 for p in curve], [p["val_loss"] for p in curve], style, color=color,
                         label=label if mode != "loopback" else None)
            axes[1].plot([p["train_seconds"] for p in curve], [p["val_loss"] for p in curve], style, color=color,
                         label=label)
    for ax in axes:
        ax.axhline(target, color="grey", lw=0.7, ls=":")
        ax.set_ylabel("validation loss (mean over replicas)")
        ax.grid(alpha=0.3)
    axes[1].set_xscale("log")  # DDP on a slow network takes ten times longer than the rest
    axes[0].set_xlabel("tokens (millions)")
    axes[1].set_xlabel(f"training wall time, s (solid: {slow_mode} slow network; dashed: loopback)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def title(saved: dict) -> str:
    return (f"{saved['benchmark']}: {saved['replicas']} replicas, H = {saved['sync_every']}; slow network "
            f"{saved['network']['name']} ({saved['mode']}); {saved['machine']}")


def main(argv: Optional[list[str]] = None, default_network: str = "uniform", default_out: str = "b2_time_to_loss",
         benchmark: str = "B2 time to loss") -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="2 replicas, 10 steps, H = 5, DDP/NoLoCo/independent, slow network only")
    parser.add_argument("--mode", choices=["emulated", "modelled"], help="the slow network (default: emulated if root)")
    parser.add_argument("--network", choices=["uniform", "one_slow"], default=default_network)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS))
    parser.add_argument("--replicas", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--val-every", type=int)
    parser.add_argument("--sync-every", type=int, help="H for every low-communication method (default 50; quick: 5)")
    parser.add_argument("--compute-only", action=argparse.BooleanOptionalAction,
                        help="also run every method on loopback, the compute-only limit (default; quick: off)")
    parser.add_argument("--target", type=float,
                        help="default: the highest final compute-only loss of the communicating methods "
                        "(without compute-only runs: their highest final loss on the slow network)")
    parser.add_argument("--overlap", nargs="+", metavar="TAU",
                        help="run each low-communication method with these overlap_steps (integers, H/4, auto)")
    parser.add_argument("--out")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON of an earlier run")
    args = parser.parse_args(argv)
    if args.out is None:
        suffix = "_one_slow" if args.network == "one_slow" else ""
        args.out = default_out if not args.overlap else "b2_overlap" + suffix
    if args.replot:
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        plot(saved["curves"], saved["target"], saved["mode"], RESULTS / f"{args.out}.png", title(saved))
        return
    results_folder = results_dir(args.quick)
    emulated_ok, why = tun.available()
    mode = args.mode or ("emulated" if emulated_ok else "modelled")
    if mode == "emulated" and not emulated_ok:
        sys.exit(f"emulated mode unavailable: {why}; use --mode modelled")
    n = args.replicas or (2 if args.quick else 4)
    steps = args.steps or (10 if args.quick else 300)
    val_every = args.val_every or (5 if args.quick else 25)
    methods = args.methods or (["ddp", "noloco", "independent"] if args.quick else list(METHODS))
    sync_every = args.sync_every or (5 if args.quick else 50)
    compute_only = not args.quick if args.compute_only is None else args.compute_only
    if args.overlap:
        for value in args.overlap:
            overlap_value(value, sync_every)  # fails early on a bad value
        methods = [f"{m}@{v}" for m in methods if m in ("diloco", "noloco", "gasloc") for v in args.overlap]
    slow = uniform(n, mbit=100, one_way_ms=50) if args.network == "uniform" else one_slow(n)
    loopback = Network("loopback", slow.links)
    results: dict[str, dict[str, list[dict]]] = {}
    runs: dict[str, dict[str, dict]] = {}
    networks = ([("loopback", loopback)] if compute_only else []) + [(mode, slow)]
    for method in methods:
        results[method], runs[method] = {}, {}
        for which, net in networks:
            runs[method][which] = run(method, "loopback" if which == "loopback" else mode, net, steps, val_every,
                                      sync_every)
            results[method][which] = runs[method][which]["curve"]
            last = results[method][which][-1]
            print(f"{method:<12} {which:<9} final val loss {last['val_loss']:.4f}  train {last['train_seconds']:.1f} s",
                  flush=True)
    communicating = [m for m in methods if m != "independent"]
    reference = "loopback" if compute_only else mode
    target = args.target or round(max(results[m][reference][-1]["val_loss"] for m in communicating) + 0.005, 2)
    rows = []
    for method in methods:
        compute = time_to(results[method]["loopback"], target, "train_seconds") if compute_only else None
        network = time_to(results[method][mode], target, "train_seconds")
        rows.append({
            "method": method,
            "final_loss": results[method][mode][-1]["val_loss"],
            "tokens_to_target_m": (t / 1e6 if (t := time_to(results[method][mode], target, "tokens")) else None),
            "compute_only_s": compute,
            "network_s": network,
            "ratio": network / compute if network and compute else None,
            "total_network_s": results[method][mode][-1]["train_seconds"],
            "total_compute_only_s": results[method]["loopback"][-1]["train_seconds"] if compute_only else None,
            "exposed_share": exposed_share(runs[method][mode]),
        })
        if "@" in method:
            taus = [r["overlap_steps"] for r in runs[method][mode]["rounds"]]
            synchronous = f"{method.partition('@')[0]}@0"
            rows[-1].update(
                tau_used=sorted(taus)[len(taus) // 2] if taus else None,
                loss_change=(rows[-1]["final_loss"] - results[synchronous][mode][-1]["val_loss"]
                             if synchronous in results else None),
            )
    print(f"\nB2: time to validation loss {target} ({n} replicas, {steps} steps, H = {sync_every}, "
          f"slow network {slow.name}, {mode}); {machine()}")
    columns = [("method", "method", "s"), ("final_loss", "final loss", ".4f"),
               ("tokens_to_target_m", "M tokens to target", ".2f"), ("compute_only_s", "compute-only s", ".1f"),
               ("network_s", f"{mode} s", ".1f"), ("ratio", "ratio", ".2f"),
               ("total_network_s", "whole run s", ".1f"), ("exposed_share", "exposed comm share", ".3f")]
    if args.overlap:
        columns[1:1] = [("tau_used", "median τ", "d"), ("loss_change", "loss vs τ=0", "+.4f")]
    print(table(rows, columns))
    saved = {"benchmark": benchmark, "mode": mode, "network": slow.describe(), "replicas": n,
             "steps": steps, "sync_every": sync_every, "target": target, "rows": rows, "curves": results,
             "rounds": {m: {k: v["rounds"] for k, v in r.items()} for m, r in runs.items()}}
    path = write_json(f"{args.out}.json", saved, results_folder)
    plot(results, target, mode, results_folder / f"{args.out}.png", title(json.loads(path.read_text())))
    print(f"wrote {path} and {results_folder / (args.out + '.png')}")


if __name__ == "__main__":
    main()
