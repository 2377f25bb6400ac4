"""The NoLoCo paper's latency model (its Eq. 5), fitted to B1's measurements and extended to N = 1024:
a pair exchange against a tree all-reduce, both of log-normally jittered message times, beside a
ring all-reduce of chunks on the emulated link, and our chunked all-reduce (``lightning_loco.transport.chunked``).

``python -m benchmarks.latency_model`` refits it to the rows of a saved B1 result (default
``b1_sync_latency.json``) and writes ``b1_latency_model.json``."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

from benchmarks.netem.links import uniform


def latency_model(rows: list[dict], sigma: float = 0.3, trials: int = 100, largest: int = 1024) -> dict:
    """The paper's latency model, fitted to our measurements and extended to N = ``largest`` (a power of two).
    Each N draws after the smaller ones, so a smaller ``largest`` gives the same values for the N it has.

    A message time m = t·LN(σ) (log-normal jitter with mean t). t is fitted as half the measured
    pair exchange on the slow network at the smallest model (the paper counts a pair exchange as
    2·t: a send and a receive). A pair exchange costs two message times and waits for nobody else.
    A tree all-reduce has 2·log2 N levels (reduce, then broadcast), each waiting for the slowest of
    its N/2^(k+1) parallel messages. A ring all-reduce (what gloo and NCCL use for large buffers) has
    2(N−1) steps, each waiting for the slowest of N parallel chunk transfers of 1/N of the model
    (link latency plus chunk at the link's bandwidth).

    Our chunked all-reduce (what ``TorchDistributedTransport`` runs on gloo for N ≥ 3) is two exchanges, a
    reduce-scatter and an all-gather, each with all N − 1 peers at once: each waits for the slowest of the
    N(N − 1) messages' latencies (jittered as above), plus the N − 1 chunks a replica sends through its access
    link. It leaves out what N − 1 connections per replica cost to open and keep, and the incast of N − 1
    senders on one link (which TCP shares without loss in the emulator): at N in the hundreds those are the
    open questions, not the latency.
    """
    slow = [r for r in rows if r["network"] != "loopback"]
    if not slow:
        return {}
    params = min(r["params"] for r in slow)
    points = [r for r in slow if r["params"] == params]
    t = statistics.median(r["noloco"]["median"] for r in points) / 2
    link = uniform(2, mbit=100, one_way_ms=50)
    latency, rate = link.one_way_s(0, 1), link.links[0].bytes_per_s
    rng = random.Random(0)
    direct_rng = random.Random(1)  # its own draws: the other columns stay as published

    def slowest_of_many(k: int, scale: float) -> float:  # the same as slowest(k, scale), one draw: F⁻¹(U^(1/k))
        q = direct_rng.random() ** (1 / k)
        return scale * math.exp(-sigma**2 / 2 + sigma * statistics.NormalDist().inv_cdf(min(q, 1 - 1e-16)))

    def slowest(k: int, scale: float) -> float:  # the slowest of k jittered messages
        return scale * max(rng.lognormvariate(-sigma**2 / 2, sigma) for _ in range(k))

    predictions = []
    for n in [2**k for k in range(1, int(math.log2(largest)) + 1)]:
        pair = statistics.mean(slowest(1, t) + slowest(1, t) for _ in range(trials))
        tree = statistics.mean(
            2 * sum(slowest(max(1, n >> (level + 1)), t) for level in range(int(math.log2(n)))) for _ in range(trials)
        )
        chunk = latency + 4 * params / n / rate
        ring = statistics.mean(sum(slowest(n, chunk) for _ in range(2 * (n - 1))) for _ in range(max(1, trials // 10)))
        sends = (n - 1) * 4 * params / n / rate  # a replica's N − 1 chunks through its access link
        direct = statistics.mean(sum(slowest_of_many(n * (n - 1), latency) + sends for _ in range(2))
                                 for _ in range(trials))
        predictions.append({"replicas": n, "pair_s": pair, "tree_allreduce_s": tree, "ring_allreduce_s": ring,
                            "chunked_allreduce_s": direct, "tree_over_pair": tree / pair,
                            "ring_over_pair": ring / pair, "chunked_over_pair": direct / pair})
    measured = [{"replicas": r["replicas"], "noloco_s": r["noloco"]["median"], "diloco_s": r["diloco"]["median"],
                 "mode": r["mode"]} for r in points]
    return {"params": params, "message_s": t, "jitter_sigma": sigma, "link": link.name,
            "predictions": predictions, "measured": measured}


def main() -> None:
    from benchmarks import b1_report
    from benchmarks.common import RESULTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=Path, default=RESULTS / "b1_sync_latency.json",
                        help="a saved B1 result whose rows the model is fitted to")
    parser.add_argument("--out", default="b1_latency_model")
    args = parser.parse_args()
    model = latency_model(json.loads(args.rows.read_text())["rows"])
    if not model:
        raise SystemExit(f"{args.rows} has no row on a slow network to fit the model to")
    b1_report.print_latency_model(model)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"fitted_to": args.rows.name, **model}, indent=1))


if __name__ == "__main__":
    main()
