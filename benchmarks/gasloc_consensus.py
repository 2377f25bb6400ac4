"""Pure consensus with GASLoC's mixing: how many rounds until replicas agree, by topology, α and γ.

    python -m benchmarks.gasloc_consensus [--quick]

Runs the strategies' own :class:`~lightning_loco.driver.OuterStepDriver` for every replica over the
in-process transport, one thread per replica, with no inner progress (g = 0): replicas start from
independent random vectors and only mix, one round per step.
A row reports the rounds until the RMS distance of the replicas from their mean falls below 1e-3 of
its start, "div" when it grows past 1e3 of its start (unstable), or ">max" when neither happens
within the round budget. Writes ``benchmarks/results/gasloc_consensus.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lightning_loco.algorithms import GASLoC
from lightning_loco.driver import OuterStepDriver
from lightning_loco.flat import FlatParameters
from lightning_loco.transport import InProcessNetwork


def spread(weights: list[torch.Tensor]) -> float:
    stacked = torch.stack(weights)
    return (stacked - stacked.mean(0)).pow(2).sum(1).mean().sqrt().item()


def rounds_to_consensus(topology: str, n: int, alpha: float, gamma: float, max_rounds: int, dim: int = 8) -> str:
    g = torch.Generator().manual_seed(0)
    flats = [FlatParameters([torch.randn(dim, generator=g)], "cpu") for _ in range(n)]
    algorithm = GASLoC(outer_momentum=gamma, gossip_step=alpha, topology=topology)
    network = InProcessNetwork(n, timeout=600.0)
    drivers = [OuterStepDriver(algorithm, network.transport(i), sync_every=1) for i in range(n)]
    for driver, flat in zip(drivers, flats):
        driver.add(flat)
    start = spread([flat.gather() for flat in flats])
    with ThreadPoolExecutor(max_workers=n) as pool:  # a round blocks each replica until its peers post
        for r in range(1, max_rounds + 1):
            for future in [pool.submit(driver.after_inner_step, 0) for driver in drivers]:
                future.result()
            s = spread([flat.gather() for flat in flats])
            if s < 1e-3 * start:
                return str(r)
            if not s < 1e3 * start:
                return "div"
    return ">max"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 16 only, fewer γ (a few seconds)")
    parser.add_argument("--max-rounds", type=int, default=5000)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gasloc_consensus.json"))
    args = parser.parse_args()
    alphas = [0.25, 0.5]
    gammas = [0.0, 0.5, 0.9] if args.quick else [0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
    cases = [("ring", 16), ("random_pairs", 16), ("exponential", 16)]
    if not args.quick:
        cases += [("ring", 64), ("random_pairs", 64), ("exponential", 64), ("random_pairs", 256), ("random_pairs", 1024)]
    rows = []
    print(f"rounds to 1e-3 of the initial spread (max {args.max_rounds}); columns: γ")
    print(f"{'topology':<13} {'N':>5} {'α':>5} " + " ".join(f"{g:>6}" for g in gammas))
    start = time.perf_counter()
    for topology, n in cases:
        for alpha in alphas:
            results = [rounds_to_consensus(topology, n, alpha, gamma, args.max_rounds) for gamma in gammas]
            rows += [{"topology": topology, "replicas": n, "gossip_step": alpha, "outer_momentum": g, "rounds": r}
                     for g, r in zip(gammas, results)]
            print(f"{topology:<13} {n:>5} {alpha:>5} " + " ".join(f"{r:>6}" for r in results), flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        with open(args.out, "w") as f:
            json.dump({"criterion": "RMS spread < 1e-3 of start", "max_rounds": args.max_rounds, "rows": rows}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
