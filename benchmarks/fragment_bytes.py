"""Peak bytes per exchange with streaming fragments: F = 1, 2, 4, 8, for NoLoCo, GASLoC and DiLoCo.

    python -m benchmarks.fragment_bytes [--layers 8] [--width 256] [--replicas 4] [--sync-every 16]
                                        [--fragments 1 2 4 8] [--overlap 1] [--step-seconds 0.5]
    python -m benchmarks.fragment_bytes --quick     # a second: a 2-layer, 64-wide model

The parameters are the example GPT's (``lightning_loco.examples.gpt.GPT``, ``--layers`` blocks of
``--width``), in module order, as float32 tensors; N replicas (``--replicas``) run the driver
(``OuterStepDriver.of(..., fragments=F)``) over the in-process transport in lock-step for 2H inner steps
(a closed-form inner step, θ ← 0.999·θ, stands in for training: bytes do not depend on values). From
replica 0's reports:

* peak: the largest ``bytes_sent`` of one exchange (what the link must carry at once);
* per H steps: all bytes sent over H inner steps (the same for every F: F rounds of 1/F each);
* share: peak over the F = 1 peak, against the target 1/F (fragments are whole parameters, so the
  largest fragment is a little over 1/F when the parameters do not split evenly);
* link rate: the peak over τ inner steps of ``--step-seconds`` each, the rate at which a link hides
  the exchange behind τ inner steps (``--overlap`` τ, which must stay below H/F).

Payload bytes as the transports count them: NoLoCo and GASLoC send one copy of what a round covers to
each peer, DiLoCo's all-reduce the nominal ring figure 2(N−1)/N copies. Writes
``benchmarks/results/fragment_bytes.json`` (a ``--quick`` run writes to a temporary folder, or to
``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from benchmarks.common import results_dir, table, write_json
from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.driver.fragments import layout
from lightning_loco.transport import InProcessNetwork

ALGORITHMS: dict[str, Callable[[], Any]] = {"noloco": NoLoCo, "gasloc": GASLoC, "diloco": DiLoCo}


def model_shapes(layers: int, width: int) -> list[torch.Size]:
    """The example GPT's parameter shapes, in module order."""
    from lightning_loco.examples.gpt import GPT

    return [p.shape for p in GPT(n_layer=layers, n_embd=width, n_head=4).parameters()]


def peak_bytes(name: str, shapes: list[torch.Size], replicas: int, sync_every: int, fragments: int,
               overlap: int) -> dict[str, Any]:
    """One run of 2H lock-step inner steps; replica 0's bytes per exchange."""
    network = InProcessNetwork(replicas)
    drivers, params = [], []
    for i in range(replicas):
        mine = [torch.nn.Parameter(torch.full(shape, 1.0 + i)) for shape in shapes]
        driver = OuterStepDriver.of(ALGORITHMS[name](), network.transport(i), sync_every, overlap_steps=overlap,
                                 fragments=fragments)
        driver.add(FlatParameters(mine, torch.device("cpu")))
        drivers.append(driver)
        params.append(mine)
    for _ in range(2 * sync_every):
        for driver, mine in zip(drivers, params):
            with torch.no_grad():
                for p in mine:
                    p.mul_(0.999)
            driver.after_inner_step(0)
    for driver in drivers:
        driver.land_all()
    sent = [x.bytes_sent for x in drivers[0].reports]
    return {"exchanges": len(sent), "peak_bytes": max(sent), "bytes_per_H": sum(sent) // 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 2-layer, 64-wide model")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--fragments", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--overlap", type=int, default=1,
                        help="τ >= 1 (the replicas run in lock-step), below H / max(fragments)")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="an inner step's time, for the link rate")
    args = parser.parse_args()
    torch.set_num_threads(1)  # bytes do not depend on speed, and small tensors gain nothing from threads
    layers = args.layers or (2 if args.quick else 8)
    width = args.width or (64 if args.quick else 256)
    shapes = model_shapes(layers, width)
    numels = [s.numel() for s in shapes]
    rows = []
    for name in ALGORITHMS:
        whole = None
        for F in args.fragments:
            row = {"algorithm": name, "fragments": F,
                   **peak_bytes(name, shapes, args.replicas, args.sync_every, F, args.overlap)}
            whole = whole or row["peak_bytes"]
            row["share"] = row["peak_bytes"] / whole
            row["target"] = 1 / F
            row["largest_fragment_share"] = max(sum(numels[a:b]) for a, b in layout(numels, F)) / sum(numels)
            row["link_MBps"] = row["peak_bytes"] / (args.overlap * args.step_seconds) / 1e6
            rows.append(row)
    print(f"{sum(numels):,} parameters in {len(shapes)} tensors (GPT, {layers} layers, width {width}), "
          f"N = {args.replicas}, H = {args.sync_every}, τ = {args.overlap}, inner step {args.step_seconds} s")
    print(table(rows, [("algorithm", "algorithm", "s"), ("fragments", "F", "d"), ("exchanges", "exchanges / 2H", "d"),
                       ("peak_bytes", "peak bytes", ",d"), ("bytes_per_H", "bytes per H steps", ",d"),
                       ("share", "peak / F=1", ".3f"), ("target", "1/F", ".3f"),
                       ("link_MBps", "MB/s to hide in τ steps", ".1f")]))
    path = write_json("fragment_bytes.json", {
        "parameters": sum(numels), "tensors": len(shapes), "layers": layers, "width": width,
        "replicas": args.replicas, "sync_every": args.sync_every, "overlap_steps": args.overlap,
        "step_seconds": args.step_seconds, "rows": rows}, results_dir(args.quick))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
