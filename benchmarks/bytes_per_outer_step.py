"""Bytes each replica sends per outer step: NoLoCo, GASLoC's topologies and DiLoCo, N = 2, 4, 8, per
wire format.

    python -m benchmarks.bytes_per_outer_step [--params 1000000] [--replicas 2 4 8] [--rounds 5]
                                              [--codecs float32 bfloat16 float16 int8]

float32 runs every algorithm; the other wire formats run NoLoCo, GASLoC on random pairs and DiLoCo
(``CODEC_ALGORITHMS``), through ``rounds.step(algorithm, ..., wire=..., residual=...)`` as the driver does.

Runs the strategies' outer-step code (``algorithm.step`` over ``TorchDistributedTransport``) in N gloo
processes on loopback, with a flat model of ``--params`` float32 values. Two figures per row:

* payload: what the transport hands to torch.distributed (exact for point-to-point; for the
  all-reduce the nominal ring figure 2(N−1)/N model copies, since gloo picks its own algorithm);
* wire: bytes that crossed the loopback interface during the outer steps (its tx counter, so TCP/IP
  headers included), divided by N and by the number of rounds. Other traffic on loopback during the
  run would inflate it: run on a quiet machine.

Writes ``benchmarks/results/bytes_per_outer_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.rounds import step as outer_step
from lightning_loco.replica.options import WireConfig
from lightning_loco.testing.launch import free_port, init_gloo, start_ranks
from lightning_loco.transport import TorchDistributedTransport

LO_TX = "/sys/class/net/lo/statistics/tx_bytes"
ALGORITHMS = {
    "noloco": NoLoCo,
    "gasloc-random_pairs": lambda: GASLoC(topology="random_pairs"),
    "gasloc-ring": lambda: GASLoC(topology="ring"),
    "gasloc-exponential": lambda: GASLoC(topology="exponential"),
    "gasloc-complete": lambda: GASLoC(topology="complete"),
    "diloco": DiLoCo,
}
CODEC_ALGORITHMS = ("noloco", "gasloc-random_pairs", "diloco")
CODECS = ("float32", "bfloat16", "float16", "int8")


def _lo_tx() -> int:
    with open(LO_TX) as f:
        return int(f.read())


def _worker(rank: int, world: int, port: int, name: str, params: int, rounds: int, out: str, codec: str) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    init_gloo(rank, world, port=port, timeout_s=120)
    try:
        algorithm = ALGORITHMS[name]()
        transport = TorchDistributedTransport(torch.device("cpu"))
        g = torch.Generator().manual_seed(rank)
        state = algorithm.init_state(torch.zeros(params), [torch.Size([params])])
        wire = WireConfig(codec).resolve(algorithm.payload_is_pseudo_gradient)
        residual = torch.zeros(algorithm.payload_numel(state)) if wire.error_feedback else None
        wire_arg = wire if wire.lossy else None
        weights = state.anchor + 0.01 * torch.randn(params, generator=g)
        outer_step(algorithm, state, weights, 0, transport, wire=wire_arg, residual=residual)  # warm-up, not measured
        transport.stats = type(transport.stats)()
        seconds = []
        dist.barrier()
        before = _lo_tx()
        for t in range(1, rounds + 1):
            weights = state.anchor + 0.01 * torch.randn(params, generator=g)
            start = time.perf_counter()
            outer_step(algorithm, state, weights, t, transport, wire=wire_arg, residual=residual)
            seconds.append(time.perf_counter() - start)
        dist.barrier()
        after = _lo_tx()
        result = {
            "payload_sent": transport.stats.bytes_sent / rounds,
            "seconds": seconds,
            "lo_tx_delta": after - before,
        }
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measure(name: str, world: int, params: int, rounds: int, tmp: Path, codec: str = "float32") -> dict:
    out = tmp / f"{name}-{world}-{codec}"
    out.mkdir(parents=True, exist_ok=True)
    start_ranks(_worker, world, args=(world, free_port(), name, params, rounds, str(out), codec), start_method="spawn",
                timeout_s=900)
    res = [torch.load(out / f"{r}.pt") for r in range(world)]
    model_bytes = 4 * params
    wire = res[0]["lo_tx_delta"] / world / rounds  # rank 0 read the counter before and after
    slowest = [max(r["seconds"][k] for r in res) for k in range(rounds)]
    return {
        "algorithm": name,
        "codec": codec,
        "replicas": world,
        "params": params,
        "payload_bytes_sent": statistics.mean(r["payload_sent"] for r in res),
        "wire_bytes_sent": wire,
        "wire_model_copies": wire / model_bytes,
        "payload_model_copies": statistics.mean(r["payload_sent"] for r in res) / model_bytes,
        "outer_step_seconds_median": statistics.median(slowest),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bytes_per_outer_step.json"))
    args = parser.parse_args()
    if not os.path.exists(LO_TX):
        raise SystemExit(f"{LO_TX} is missing: this benchmark needs Linux loopback counters")
    rows = []
    tmp = Path(args.out).with_suffix(".tmp")
    for world in args.replicas:
        for codec in args.codecs:
            for name in ALGORITHMS if codec == "float32" else CODEC_ALGORITHMS:
                rows.append(measure(name, world, args.params, args.rounds, tmp, codec))
    for f in sorted(tmp.rglob("*.pt")):
        f.unlink()
    for d in sorted(tmp.rglob("*"), reverse=True):
        d.rmdir()
    tmp.rmdir()
    mb = 4 * args.params / 1e6
    print(f"\nbytes per replica per outer step, {args.params:,} float32 parameters ({mb:.1f} MB), "
          f"gloo on loopback, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")
    print(f"{'N':>3} {'algorithm':<20} {'codec':<9} {'payload MB':>11} {'payload/model':>14} {'wire MB':>9} "
          f"{'wire/model':>11} {'s/outer step':>13}")
    for r in rows:
        print(f"{r['replicas']:>3} {r['algorithm']:<20} {r['codec']:<9} {r['payload_bytes_sent'] / 1e6:>11.3f} "
              f"{r['payload_model_copies']:>14.4f} {r['wire_bytes_sent'] / 1e6:>9.3f} {r['wire_model_copies']:>11.3f} "
              f"{r['outer_step_seconds_median']:>13.4f}")
    for world in args.replicas:
        by = {r["algorithm"]: r for r in rows if r["replicas"] == world and r["codec"] == "float32"}
        if "diloco" in by and "noloco" in by:
            wire = by['diloco']['wire_bytes_sent'] / by['noloco']['wire_bytes_sent']
            seconds = by['diloco']['outer_step_seconds_median'] / by['noloco']['outer_step_seconds_median']
            print(f"N = {world}: DiLoCo/NoLoCo wire bytes {wire:.2f}, time {seconds:.2f} (loopback)")
        for name in CODEC_ALGORITHMS:
            base = by.get(name)
            coded = {r["codec"]: r for r in rows if r["replicas"] == world and r["algorithm"] == name}
            if base is not None and len(coded) > 1:
                ratios = ", ".join(f"{c} {r['payload_bytes_sent'] / base['payload_bytes_sent']:.4f}"
                                   for c, r in coded.items() if c != "float32")
                print(f"N = {world} {name}: payload bytes against float32: {ratios}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"network": "loopback", "machine": f"{os.cpu_count()} CPUs", "rounds": args.rounds, "rows": rows}, f,
                  indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
