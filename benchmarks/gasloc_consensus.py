"""Pure consensus with GASLoC's mixing: how many rounds until replicas agree, by topology, α and γ.

    python -m benchmarks.gasloc_consensus [--quick]
    python -m benchmarks.gasloc_consensus --forms mixed sent [--quick]

Runs the strategies' own :class:`~lightning_loco.driver.driver.OuterStepDriver` for every replica over the
in-process transport, one thread per replica, with no inner progress (g = 0): replicas start from
independent random vectors and only mix, one round per step.
A row reports the rounds until the RMS distance of the replicas from their mean falls below 1e-3 of
its start, "div" when it grows past 1e3 of its start (unstable), or ">max" when neither happens
within the round budget. Writes ``benchmarks/results/gasloc_consensus.json``.

``--forms`` compares where the outer momentum acts (``GASLoC(momentum_on=...)``): "mixed", our
reconstruction (with g = 0, Nesterov-style gossip θ ← x + γ·(x − x_prev)) against "sent", the public
summary's form (heavy-ball gossip θ ← x + γ·(θ − θ_prev)), on rings, random pairs and exponential
rounds of N = 16, 32, 64 replicas. Writes ``benchmarks/results/gasloc_consensus_forms.json``.
``--quick`` runs N = 16 only and fewer γ, and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lightning_loco.algorithms import GASLoC
from lightning_loco.algorithms.gasloc import MOMENTUM_ON
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.transport import InProcessNetwork

RESULTS = Path(__file__).parent / "results"


def spread(weights: list[torch.Tensor]) -> float:
    stacked = torch.stack(weights)
    return (stacked - stacked.mean(0)).pow(2).sum(1).mean().sqrt().item()


def rounds_to_consensus(topology: str, n: int, alpha: float, gamma: float, max_rounds: int, dim: int = 8,
                        momentum_on: str = "mixed") -> str:
    g = torch.Generator().manual_seed(0)
    flats = [FlatParameters([torch.randn(dim, generator=g)], "cpu") for _ in range(n)]
    algorithm = GASLoC(outer_momentum=gamma, gossip_step=alpha, topology=topology, momentum_on=momentum_on)
    network = InProcessNetwork(n, timeout=600.0)
    drivers = [OuterStepDriver.of(algorithm, network.transport(i), sync_every=1) for i in range(n)]
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


def study(cases: list[tuple[str, int]], forms: list[str], alphas: list[float], gammas: list[float],
          max_rounds: int) -> list[dict]:
    """Prints one row per (topology, N, α, form), columns γ; returns the rows for the JSON."""
    rows = []
    print(f"rounds to 1e-3 of the initial spread (max {max_rounds}); columns: γ")
    print(f"{'topology':<13} {'N':>5} {'α':>5} {'form':>6} " + " ".join(f"{g:>6}" for g in gammas))
    for topology, n in cases:
        for alpha in alphas:
            for form in forms:
                results = [rounds_to_consensus(topology, n, alpha, gamma, max_rounds, momentum_on=form)
                           for gamma in gammas]
                rows += [{"topology": topology, "replicas": n, "gossip_step": alpha, "momentum_on": form,
                          "outer_momentum": g, "rounds": r} for g, r in zip(gammas, results)]
                print(f"{topology:<13} {n:>5} {alpha:>5} {form:>6} " + " ".join(f"{r:>6}" for r in results),
                      flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 16 only, fewer γ (a few seconds); writes nothing")
    parser.add_argument("--forms", nargs="+", choices=MOMENTUM_ON, default=None,
                        help="compare these values of momentum_on (rings, random pairs, exponential; N = 16, 32, 64)")
    parser.add_argument("--max-rounds", type=int, default=5000)
    parser.add_argument("--out", default=None, help="the results JSON (default: benchmarks/results/gasloc_consensus"
                                                    "[_forms].json)")
    args = parser.parse_args()
    alphas = [0.25, 0.5]
    if args.forms is None:
        forms = ["mixed"]
        gammas = [0.0, 0.5, 0.9] if args.quick else [0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
        cases = [("ring", 16), ("random_pairs", 16), ("exponential", 16)]
        if not args.quick:
            cases += [("ring", 64), ("random_pairs", 64), ("exponential", 64), ("random_pairs", 256),
                      ("random_pairs", 1024)]
        out = args.out or str(RESULTS / "gasloc_consensus.json")
    else:
        forms = list(dict.fromkeys(args.forms))
        gammas = [0.0, 0.5, 0.9] if args.quick else [0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
        sizes = [16] if args.quick else [16, 32, 64]
        cases = [(topology, n) for topology in ("ring", "random_pairs", "exponential") for n in sizes]
        out = args.out or str(RESULTS / "gasloc_consensus_forms.json")
    start = time.perf_counter()
    rows = study(cases, forms, alphas, gammas, args.max_rounds)
    if args.forms is None:  # the original study's rows, as before
        rows = [{k: v for k, v in row.items() if k != "momentum_on"} for row in rows]
    print(f"({time.perf_counter() - start:.0f} s)")
    if not args.quick:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            json.dump({"criterion": "RMS spread < 1e-3 of start", "max_rounds": args.max_rounds, "rows": rows}, f,
                      indent=2)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
