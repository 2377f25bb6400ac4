"""VerifyState's cost per round on loopback and on an emulated WAN: the digests of a model's parameters and their
all-gather, against the DiLoCo round's own all-reduce of the model.

    python -m benchmarks.verify_state [--params 1e6 1e7] [--replicas 2 4] [--tensors 20] [--repeats 5]
    python -m benchmarks.verify_state --quick      # a few seconds: 10^5 parameters, 2 replicas
    python -m benchmarks.verify_state --wan        # one process per node, 100 Mbit/s and 50 ms one way (root)

N processes on gloo over loopback, one thread each. Each holds a model of ``--params`` float32 parameters in
``--tensors`` tensors of equal size, and per repeat, all at once (a barrier before each part):

* digest: :func:`lightning_loco.replica.state_digest.digests` of every tensor (where the tensors live: the CPU);
* gather: :func:`~lightning_loco.replica.state_digest.compare_over_world`, the all-gather of 2 int64 numbers per
  tensor and the comparison;
* all-reduce: the DiLoCo round's exchange of the whole model (one float32 all-reduce), for scale.

Median [min, max] of rank 0's times over the repeats. Writes ``benchmarks/results/verify_state.json`` (a
``--quick`` run writes to a temporary folder, or to ``$LOCO_BENCH_RESULTS``). ``--wan`` runs the same ranks each
in a network namespace of its own on the packet-level emulator (:mod:`benchmarks.netem`, every two nodes 100 Mbit/s
and 50 ms apart; needs root) and writes ``verify_state_wan.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import load_average, results_dir, spread, table, write_json
from lightning_loco.replica.state_digest import compare_over_world, digests
from lightning_loco.testing.launch import free_port, init_gloo, init_gloo_from_env, start_ranks


def _timed(fn: Any) -> float:
    dist.barrier()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _rank(rank: int, world: int, port: int, params: int, tensors: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    if port:
        init_gloo(rank, world, port=port, timeout_s=300)
    else:  # a node of the emulated network: torchrun's variables
        rank, world = init_gloo_from_env(timeout_s=300)
    torch.manual_seed(0)
    model = [torch.randn(params // tensors) for _ in range(tensors)]
    flat = torch.cat(model)
    named = [(f"layer{i}.weight", t) for i, t in enumerate(model)]
    mine = digests(named)
    times: dict[str, list[float]] = {"digest": [], "gather": [], "all_reduce": []}
    for _ in range(repeats + 1):  # the first is a warm-up
        times["digest"].append(_timed(lambda: digests(named)))
        times["gather"].append(_timed(lambda: compare_over_world(mine, torch.device("cpu"), 1, 0)))
        times["all_reduce"].append(_timed(lambda: dist.all_reduce(flat)))
    if rank == 0:
        Path(out).write_text(json.dumps({k: v[1:] for k, v in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def measure(params: int, world: int, tensors: int, repeats: int, out: Path, wan: bool = False) -> dict[str, Any]:
    path = out / f"verify_state_{params}_{world}.json"
    if wan:
        from benchmarks.netem.launch import run_workers
        from benchmarks.netem.links import uniform

        job = json.dumps([world, params, tensors, repeats, str(path)])
        run_workers("emulated", uniform(world), lambda i: ["-m", "benchmarks.verify_state", "--worker", job],
                    timeout=900)
    else:
        start_ranks(_rank, world, args=(world, free_port(), params, tensors, repeats, str(path)), timeout_s=600)
    times = json.loads(path.read_text())
    path.unlink()
    row: dict[str, Any] = {"params": params, "replicas": world, "tensors": tensors}
    for key, values in times.items():
        row[key] = spread([1e3 * v for v in values])  # ms
    row["check_ms"] = row["digest"]["median"] + row["gather"]["median"]
    row["share_of_all_reduce"] = row["check_ms"] / row["all_reduce"]["median"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--wan", action="store_true", help="on the emulated WAN, one process per node (root)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        world, params, tensors, repeats, out = json.loads(args.worker)
        _rank(0, world, 0, params, tensors, repeats, out)
        return
    if args.quick:
        args.params, args.replicas, args.repeats = [1e5], [2], 3
    folder = results_dir(args.quick)
    folder.mkdir(parents=True, exist_ok=True)
    before = load_average()
    rows = [measure(int(p), n, args.tensors, args.repeats, folder, args.wan) for p in args.params
            for n in args.replicas]
    shown = [{**r, "digest_ms": r["digest"]["median"], "gather_ms": r["gather"]["median"],
              "all_reduce_ms": r["all_reduce"]["median"]} for r in rows]
    print(table(shown, [("params", "parameters", ".0e"), ("replicas", "N", "d"), ("tensors", "tensors", "d"),
                        ("digest_ms", "digest ms", ".2f"), ("gather_ms", "all-gather ms", ".2f"),
                        ("check_ms", "check ms", ".2f"), ("all_reduce_ms", "round all-reduce ms", ".2f"),
                        ("share_of_all_reduce", "check / all-reduce", ".3f")]))
    where = ("an emulated WAN (100 Mbit/s, 50 ms one way between every two nodes; one process per node)" if args.wan
             else "loopback")
    path = write_json("verify_state_wan.json" if args.wan else "verify_state.json", {
        "what": f"VerifyState per round on {where} (gloo, one thread per rank): digests and their all-gather, "
                "against the round's float32 all-reduce of the model; ms, median [min, max] over repeats, rank 0",
        "uptime_before": before, "uptime_after": load_average(), "rows": rows}, folder)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
