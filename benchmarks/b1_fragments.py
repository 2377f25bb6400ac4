"""B1, streaming fragments: the time of an outer step and its exposed communication with overlap,
F = 1 against F = 4, on the emulated WAN.

    python -m benchmarks.b1_sync_latency --parts fragments --params 10e6               # both methods
    python -m benchmarks.b1_sync_latency --parts fragments --params 50e6 --methods noloco --out b1_fragments_50m_noloco
    python -m benchmarks.b1_sync_latency --parts fragments --quick                      # seconds: loopback, modelled

Each of N gloo processes (one per node, as in B1: ``benchmarks/netem``) runs the strategies' own
:class:`~lightning_loco.driver.driver.OuterStepDriver` over :class:`~lightning_loco.transport.TorchDistributedTransport`
with ``overlap_steps`` τ and ``fragments`` F, on :class:`~lightning_loco.driver.flat.FlatParameters` over a flat
float32 model of 16 equal blocks (so that F = 4 cuts it into exact quarters, 4 blocks each). There is no
Lightning and no real training: **compute is modelled** as X seconds of sleep per inner step, after a cheap
in-place change of every parameter (θ ← 0.999·θ, each replica from its own random start), so the payloads are
real values that change from step to step.

H and τ. H = 20 inner steps per outer step and one τ = 4 for both F: the largest that F = 4 allows
(τ < H/F = 5), so both F get the same overlap window of τ·X seconds and differ only in what must cross the link
within it, the whole model or a quarter. (τ = H/F − 1 for each F would give F = 1 a window of 19 steps, which
hides any exchange that fits in an outer step at all, and compare windows rather than fragments.)

X per inner step. Chosen so that the window τ·X hides a quarter of the model's exchange on the emulated
100 Mbit/s, 50 ms link but not the whole model's: X = ``STEP_SECONDS_PER_M[method]`` × parameters in
millions. B1 measured, at N = 4, a NoLoCo pair exchange of 4.1 s and a DiLoCo all-reduce of 9.0 s for 40 MB
(10 M parameters), 19.5 s and 44 s for 200 MB (50 M), so a quarter of 50 M (50 MB) takes about 5 s and 11 s:
NoLoCo X = 0.04 s per M parameters (τ·X = 8 s at 50 M), DiLoCo X = 0.08 s (τ·X = 16 s), about 1.5 times a
quarter and well under the whole. ``--step-seconds`` sets one X for every run instead. Every output states X.

Turns. Every (method, F) has its own driver and model; they take turns round by round, like B1's methods:
round r of NoLoCo F = 1, NoLoCo F = 4, DiLoCo F = 1, DiLoCo F = 4, then round r + 1, each turn after a
barrier. A turn is H inner steps that hold exactly one round of every fragment, posted and landed inside
the turn: fragment f's rounds start after steps f·H/F + kH (fragment 0 and F = 1 at kH) and land τ steps
later, so each driver first takes τ inner steps without a round (untimed) and every turn then covers steps
kH + τ + 1 … (k + 1)H + τ. Nothing is in flight between turns (checked). Round 0 is a warm-up without modelled
compute (its rounds are waited for at once) and is not reported.

Per turn and replica: the wall time of the H inner steps; the **exposed communication**, the time the
training loop spent inside ``driver.after_inner_step`` (posting, predicting, landing: what the outer step
takes from training), and of that the landing waits (``OuterStepReport.comm_seconds``); each round's
exchange time from posting to completion; the payload bytes sent. A turn's figure is the slowest replica's;
the table gives the median over rounds with [min, max], and F = 1 over F = 4 round by round (the same round r).
The wall time is H·X plus the exposed time: with everything hidden it would be H·X.

Writes ``benchmarks/results/b1_fragments.json`` (or ``--out``; a ``--quick`` run writes to a temporary folder,
or to ``$LOCO_BENCH_RESULTS``), with ``uptime`` before and after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import load_average, machine, spread, table, write_json
from benchmarks.netem import launch
from benchmarks.netem.links import Network

METHODS = ("noloco", "gasloc", "diloco")
BLOCKS = 16  # the flat model's tensors: F = 1, 2, 4, 8 and 16 cut it into equal fragments
SYNC_EVERY = 20
OVERLAP = 4  # τ: the largest below H/F = 5 at F = 4, the same for every F
# X, the modelled compute of one inner step, in seconds per million parameters (see the module docstring)
STEP_SECONDS_PER_M = {"noloco": 0.04, "gasloc": 0.04, "diloco": 0.08}


def step_seconds(method: str, params: int, override: float | None = None) -> float:
    """X for ``method`` at ``params`` parameters: ``override`` when given, else proportional to the size."""
    return override if override is not None else STEP_SECONDS_PER_M[method] * params / 1e6


def key(method: str, fragments: int) -> str:
    return f"{method} F={fragments}"


# ---------------------------------------------------------------- worker


def modelled_steps(model: list[Any], steps: int, seconds: float, after_step: Callable[[], None]) -> tuple[float, float]:
    """``steps`` inner steps of ``seconds`` each (a cheap in-place change of every tensor of ``model``, then
    sleep until the step's time is up), each followed by ``after_step`` (the method's own code); returns the
    wall time and the time spent in ``after_step``."""
    import torch

    start = time.perf_counter()
    in_hook = 0.0
    for _ in range(steps):
        step_end = time.perf_counter() + seconds
        with torch.no_grad():
            for p in model:
                p.mul_(0.999)
        time.sleep(max(0.0, step_end - time.perf_counter()))
        before = time.perf_counter()
        after_step()
        in_hook += time.perf_counter() - before
    return time.perf_counter() - start, in_hook


class Turns:
    """One (method, F): its driver over the shared transport, its model, and what each timed turn measured."""

    def __init__(self, method: str, fragments: int, params: int, transport: Any, sync_every: int, overlap: int,
                 seconds: float, rank: int) -> None:
        import torch

        from benchmarks.b1_shared import build
        from lightning_loco.driver.driver import OuterStepDriver
        from lightning_loco.driver.flat import FlatParameters

        generator = torch.Generator().manual_seed(rank)
        size = params // BLOCKS
        self.model = [torch.randn(size, generator=generator) for _ in range(BLOCKS)]
        algorithm, _ = build(method)
        self.driver = OuterStepDriver.of(algorithm, transport, sync_every, overlap_steps=overlap, fragments=fragments,
                                      label=f"Replica {rank}, {key(method, fragments)}")
        self.driver.add(FlatParameters(self.model, torch.device("cpu")))
        self.transport, self.sync_every, self.seconds = transport, sync_every, seconds
        for _ in range(overlap):  # steps 1 … τ: no round is due (τ < H/F), so every turn holds whole rounds
            self.driver.after_inner_step(0)
        self.turns: list[dict[str, Any]] = []

    def turn(self, seconds: float) -> dict[str, Any]:
        """H inner steps of ``seconds`` each (the parameter change, then sleep until the step's time is up),
        each followed by the driver; what they measured."""
        import torch.distributed as dist

        dist.barrier()
        reports, sent = len(self.driver.reports), self.transport.stats.bytes_sent
        wall, in_driver = modelled_steps(self.model, self.sync_every, seconds, lambda: self.driver.after_inner_step(0))
        landed = self.driver.reports[reports:]
        return {
            "wall_s": wall, "exposed_s": in_driver, "wait_s": sum(r.comm_seconds for r in landed),
            "exchange_s": [r.exchange_seconds for r in landed if r.exchange_seconds is not None],
            "rounds": len(landed), "fragments": sorted(r.fragment for r in landed),
            "bytes_sent": self.transport.stats.bytes_sent - sent, "exchange_bytes": [r.bytes_sent for r in landed],
            "in_flight_after": sum(slot.in_flight is not None for slot in self.driver.slots),
        }


def take_turns(runs: dict[str, Any], rounds: int, path: str, warmup: int = 1) -> None:
    """``warmup`` untimed rounds without modelled compute (round 0 warms the connections; B7 adds the rounds in
    which ``all_reduce="auto"`` decides), then ``rounds`` timed rounds, each run taking its turn in every round;
    writes every run's timed turns to ``path``."""
    for r in range(warmup + rounds):
        for run in runs.values():
            measured = run.turn(run.seconds if r >= warmup else 0.0)
            if r >= warmup:
                run.turns.append(measured)
    with open(path, "w") as f:
        json.dump({k: run.turns for k, run in runs.items()}, f)


def worker(options: dict[str, Any]) -> None:
    """Warms every pair, builds every (method, F), then runs round 0 (a warm-up without modelled compute)
    and the timed rounds, each (method, F) taking its turn in every round; writes this rank's turns."""
    import torch
    import torch.distributed as dist

    from benchmarks.b1_shared import STORE, WARM_NUMEL, warm_all_pairs
    from benchmarks.netem import modelled
    from lightning_loco.testing.launch import init_gloo
    from lightning_loco.transport import TorchDistributedTransport

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = options["out"]
    init_gloo(rank, world, file=os.path.join(out, STORE), timeout_s=900)
    try:
        network = modelled.from_env()
        transport = (modelled.ModelledTransport(torch.device("cpu"), network=network) if network is not None
                     else TorchDistributedTransport(torch.device("cpu")))
        warm_all_pairs(transport, min(options["params"], WARM_NUMEL))
        runs = {key(m, F): Turns(m, F, options["params"], transport, options["sync_every"], options["overlap"],
                                 options["step_seconds"][m], rank)
                for m in options["methods"] for F in options["fragments"]}
        take_turns(runs, options["rounds"], os.path.join(out, f"rank{rank}.json"))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def measure(mode: str, network: Network, params: int, rounds: int, methods: list[str], fragments: list[int],
            sync_every: int, overlap: int, seconds: dict[str, float]) -> dict[str, Any]:
    """One configuration: every (method, F) in turns on ``network``; per (method, F) the slowest replica's
    figures per round, their spreads, and F = 1 over every other F round by round."""
    options = {"params": params, "rounds": rounds, "methods": methods, "fragments": fragments,
               "sync_every": sync_every, "overlap": overlap, "step_seconds": seconds}
    with tempfile.TemporaryDirectory() as out:
        wall = launch.run_workers(mode, network, lambda i: ["-m", "benchmarks.b1_fragments", "--worker",
                                                            json.dumps({**options, "out": out})])
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(len(network.links))]
    row: dict[str, Any] = {"mode": mode, "network": network.name, "replicas": len(network.links), "params": params,
                           "sync_every": sync_every, "overlap_steps": overlap, "wall_s": wall, "runs": {}}
    slowest: dict[str, dict[str, list[float]]] = {}
    for method in methods:
        for F in fragments:
            k = key(method, F)
            turns = [rank[k] for rank in ranks]  # replica → its timed turns
            worst = {m: [max(t[r][m] for t in turns) for r in range(rounds)] for m in ("wall_s", "exposed_s", "wait_s")}
            slowest[k] = worst
            exchanges = [s for t in turns for turn in t for s in turn["exchange_s"]]
            row["runs"][k] = {
                "method": method, "fragments": F, "step_seconds": seconds[method],
                "compute_s": sync_every * seconds[method], "window_s": overlap * seconds[method],
                **{m: spread(v) for m, v in worst.items()},
                "exchange_s": spread(exchanges) if exchanges else None,
                "rounds_per_turn": sorted({turn["rounds"] for t in turns for turn in t}),
                "fragments_per_turn": sorted({tuple(turn["fragments"]) for t in turns for turn in t}),
                "in_flight_after_turn": max(turn["in_flight_after"] for t in turns for turn in t),
                "bytes_per_outer_step": [statistics.mean(turn["bytes_sent"] for turn in t) for t in turns],
                "peak_exchange_bytes": [max(b for turn in t for b in turn["exchange_bytes"]) for t in turns],
                "per_replica": {m: [statistics.median(turn[m] for turn in t) for t in turns]
                                for m in ("wall_s", "exposed_s", "wait_s")},
            }
        whole = key(method, 1)
        for F in fragments if 1 in fragments else []:
            if F != 1:
                ratios = {m: [a / b if b > 0 else float("inf") for a, b in
                              zip(slowest[whole][m], slowest[key(method, F)][m])] for m in ("wall_s", "exposed_s")}
                row["runs"][key(method, F)]["over_f1"] = {m: spread(v) for m, v in ratios.items()}
    return row


def report_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per (configuration, method, F), for the table."""
    flat = []
    for row in rows:
        for run in row["runs"].values():
            ratio = run.get("over_f1") or {}
            flat.append({
                "mode": row["mode"], "params_m": row["params"] / 1e6, "method": run["method"],
                "F": run["fragments"], "X": run["step_seconds"], "window": run["window_s"],
                "exchange": (run["exchange_s"] or {}).get("median"),
                "exchange_max": (run["exchange_s"] or {}).get("max"),
                "wall": run["wall_s"]["median"], "wall_min": run["wall_s"]["min"], "wall_max": run["wall_s"]["max"],
                "exposed": run["exposed_s"]["median"], "exposed_min": run["exposed_s"]["min"],
                "exposed_max": run["exposed_s"]["max"], "wait": run["wait_s"]["median"],
                "mb": statistics.mean(run["bytes_per_outer_step"]) / 1e6,
                "peak_mb": max(run["peak_exchange_bytes"]) / 1e6,
                "wall_ratio": ratio.get("wall_s", {}).get("median"),
                "exposed_ratio": ratio.get("exposed_s", {}).get("median"),
                "exposed_ratio_min": ratio.get("exposed_s", {}).get("min"),
                "exposed_ratio_max": ratio.get("exposed_s", {}).get("max"),
            })
    return flat


def print_table(rows: list[dict[str, Any]], rounds: int) -> None:
    if not rows:
        return
    first = rows[0]
    print(f"\nB1 fragments: seconds per outer step (H = {first['sync_every']} inner steps, "
          f"τ = {first['overlap_steps']}), "
          f"slowest replica, median [min, max] of {rounds} rounds. Compute is MODELLED: X s of sleep per inner step "
          f"(column X); window = τ·X; exposed = time in the driver (posting, landing), of which wait = landing "
          f"waits; exchange = a round's posting to completion (median, max); F=1/F = the ratio round by round; "
          f"networks: {'; '.join(sorted({r['mode'] + ': ' + r['network'] for r in rows}))}; {machine()}")
    print(table(report_rows(rows), [
        ("mode", "mode", "s"), ("params_m", "M params", "g"), ("method", "method", "s"), ("F", "F", "d"),
        ("X", "X s/step", ".3g"), ("window", "window s", ".3g"), ("exchange", "exchange s", ".3f"),
        ("exchange_max", "max", ".3f"), ("wall", "wall s", ".3f"), ("wall_min", "min", ".3f"),
        ("wall_max", "max", ".3f"), ("exposed", "exposed s", ".3f"), ("exposed_min", "min", ".3f"),
        ("exposed_max", "max", ".3f"), ("wait", "wait s", ".3f"), ("mb", "MB/outer step", ".2f"),
        ("peak_mb", "peak MB", ".2f"), ("wall_ratio", "wall F=1/F", ".2f"),
        ("exposed_ratio", "exposed F=1/F", ".2f"), ("exposed_ratio_min", "min", ".2f"),
        ("exposed_ratio_max", "max", ".2f")]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The fragments part's own options on B1's command line."""
    group = parser.add_argument_group("fragments part")
    group.add_argument("--fragments", nargs="+", type=int, default=[1, 4],
                       help="F of each run (default 1 4; the ratios need 1), each dividing --sync-every")
    group.add_argument("--sync-every", type=int,
                       help=f"H, inner steps per outer step (default {SYNC_EVERY}; 8 with --quick)")
    group.add_argument("--overlap", type=int, help=f"τ for every F, below H/max(F) (default {OVERLAP}; 1 with --quick)")
    group.add_argument("--step-seconds", type=float,
                       help="X, the modelled compute of one inner step, for every method and size (default: "
                            + ", ".join(f"{m} {s:g}" for m, s in STEP_SECONDS_PER_M.items()) + " s per M parameters)")


def run(args: argparse.Namespace, modes: list[str], networks: Any, results: Path, out: str) -> Path:
    """The part as B1's ``main`` calls it: every mode × N × size; prints the table, writes ``out``.json."""
    from lightning_loco.algorithms import NoLoCo
    from lightning_loco.rules import build_options

    methods = args.methods or ["noloco", "diloco"]
    if not set(methods) <= set(METHODS):
        raise SystemExit(f"--parts fragments: --methods {' '.join(methods)}: the fragments part runs the "
                         f"outer-step methods {', '.join(METHODS)} (DDP has no outer step to cut into fragments)")
    replicas = args.replicas or ([2] if args.quick else [4])
    sizes = [int(p) for p in (args.params or ([1e5] if args.quick else [10e6, 50e6]))]
    rounds = args.rounds or (2 if args.quick else 3)
    sync_every = args.sync_every or (8 if args.quick else SYNC_EVERY)
    overlap = args.overlap if args.overlap is not None else (1 if args.quick else OVERLAP)
    for F in args.fragments:
        try:
            build_options(NoLoCo(), sync_every, fragments=F, overlap_steps=overlap)  # the rule table refuses
        except ValueError as err:
            raise SystemExit(f"--fragments {F} --sync-every {sync_every} --overlap {overlap}: {err}") from None
    if overlap < 1:
        raise SystemExit("--overlap must be at least 1 here: the part measures what the overlap hides")
    if any(p % BLOCKS for p in sizes):
        raise SystemExit(f"--params must be multiples of {BLOCKS} (the model's blocks), got {sizes}")
    uptime_before = load_average()
    rows = []
    for mode in modes:
        for n in replicas:
            for params in sizes:
                seconds = {m: step_seconds(m, params, args.step_seconds) for m in methods}
                net = networks(n)["loopback" if mode == "loopback" else "wan"]
                row = measure(mode, net, params, rounds, methods, args.fragments, sync_every, overlap, seconds)
                rows.append(row)
                print(f"fragments part: {mode} {net.name} N={n} {params / 1e6:g} M done in {row['wall_s']:.0f} s",
                      flush=True)
    print_table(rows, rounds)
    modelled = "rows with mode 'modelled' are modelled, not measured"
    path = write_json(f"{out}.json", {
        "benchmark": "B1 streaming fragments", "rounds": rounds,
        "compute": "modelled: X s of sleep per inner step after an in-place change of every parameter "
                   "(step_seconds per run)",
        "modelled_note": modelled, "uptime_before": uptime_before, "uptime_after": load_average(), "rows": rows,
    }, results)
    print(f"wrote {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description="B1's fragments part: a worker (run it through "
                                     "benchmarks.b1_sync_latency --parts fragments)")
    parser.add_argument("--worker", required=True, help="JSON: the worker's options")
    worker(json.loads(parser.parse_args().worker))
    from benchmarks.common import skip_final_collection

    skip_final_collection()


if __name__ == "__main__":
    main()
