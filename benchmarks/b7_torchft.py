"""B7, torchft beside ours: torchft's DiLoCo and its streaming fragments, turn by turn with our DiLoCo, NoLoCo and
GASLoC on the same processes, the same flat model, the same link and the same modelled compute.

    python -m benchmarks.b7_torchft                                   # loopback and the emulated WAN; N = 2, 4
    python -m benchmarks.b7_torchft --quick                           # seconds: loopback, N = 2, 0.1 M parameters
    python -m benchmarks.b7_torchft --modes emulated --replicas 4 --overlap 4 --params 50e6

What a user would pick instead of us is torchft (``torchft.local_sgd.DiLoCo``), so B7 runs it as its docs set it
up: a Lighthouse (``torchft.coordination.LighthouseServer``, its defaults but ``min_replicas`` = N), and in every
replica group (here one process each) a ``TCPStore``, torchft's ``ProcessGroupGloo`` and a ``Manager`` with
``use_async_quorum=False`` (its DiLoCo refuses the asynchronous quorum). ``init_sync=False``: every replica
starts from its own seeded weights, as ours do here, so no first-quorum heal enters a timed turn. torchft runs
twice: with its defaults (``torchft``: one all-reduce per parameter tensor) and with ``use_bucketization=True``
(``torchft_buckets``: the tensors packed into buckets of ``bucket_cap_mb``, by default 1 GB, so one all-reduce),
since the flat model's 16 tensors stand for a real model's hundreds (``$TORCHFT_USE_BUCKETIZATION`` is cleared in
the workers, so that the first stays torchft's default). Every sync
of torchft's is one quorum (an RPC to the Lighthouse through the group's manager server; it also waits there for
the slowest replica to reach the sync), the all-reduce of the pseudo-gradients (one per parameter tensor with its
defaults) and one ``should_commit`` RPC; ours is the exchange alone (no membership: the torch.distributed
transport, as the strategies build it outside elastic mode: ``streams="auto"``, with as many stream groups as the
model's payload needs, none under 8 MB; results written before that default ran one stream). The table also gives
torchft's exposed time without its
quorum and commit calls, exchange against exchange.

Each of N processes (one per node: ``benchmarks/netem``, as B1) holds every (method, F) at once, each with its own
copy of the model, and they take turns round by round, as :mod:`benchmarks.b1_fragments` does: a turn is H
inner steps of X seconds of **modelled** compute (an in-place change of every parameter, then sleep until the
step's time is up), each followed by the method's own code: our :class:`~lightning_loco.driver.driver.OuterStepDriver`,
or torchft's inner ``optimizer.step()``, whose post-hook runs its syncs (the inner optimizer has no gradients,
so the step itself costs nothing). Exposed time is what that code took from the loop. With ``--overlap`` τ = 0
every sync blocks and X = 0 (there is nothing to hide). With τ > 0 ours post a round at its step and land it
τ steps later, and torchft prepares a fragment τ steps before its sync (``fragment_sync_delay`` = τ). X is the
same for every method, B1's figure for DiLoCo (:data:`benchmarks.b1_fragments.STEP_SECONDS_PER_M`): compute
belongs to the model, not to the method. Streaming (F = 4): torchft syncs fragment f at steps (f + 1)·H/F + kH
of a turn, having prepared it τ steps earlier, with one outer optimizer per fragment (its documented form); ours
post and land at the same steps. Each turn holds whole rounds of every fragment, and none is in flight after
it (checked on both sides, and reported).

The emulator's own timing is reported too (:meth:`benchmarks.netem.tun.EmulatedNetwork.lateness`: the share of
packets its forwarder wrote late, and of its time it was busy), so a row the forwarder limited shows it.

Reported per (method, F), the slowest replica per round, median [min, max] over the rounds: the turn's wall
time and exposed seconds, and ours ÷ torchft's round by round for the same F; for torchft also where its exposed
time went: the quorum (``Manager.start_quorum``) and the commit vote (``Manager.should_commit``), the rest being
its all-reduce and its copies; for ours the time its landings waited for the exchange (``wait``: the rest of
its exposed time is the outer step's own arithmetic and copies). The first :data:`SETTLE_ROUNDS` rounds are
untimed (no compute, not reported; ``--quick``: one): round 0 warms the connections, and our default
``all_reduce="auto"`` tries the candidates in its first six rounds and decides in the seventh
(:mod:`lightning_loco.transport.choice`), so the timed rounds show what a run gets after that; the decision, with
the replicas' summed times, is reported and written, and so is every replica's every trial time
(``all_reduce_trials``; results before this ran one untimed round, when our all-reduce was fixed), and for the pair
exchanges each replica's connection counts (``pair_streams``: the count it found faster, what each pair proposed at
its last exchange, the times by count; :mod:`lightning_loco.transport.pair_streams`, whose trials end within the
untimed rounds). Every pair of
replicas exchanges 4 MB once before round 0 (B1's ``warm_all_pairs``, on our group; torchft builds its group at its
first quorum, in round 0, and keeps it while the membership stays the same). On the emulated WAN the namespaces
set ``net.ipv4.tcp_slow_start_after_idle = 0``: torchft's connections idle while the other methods take their
turns, ours less, and a connection must not restart slow start for that (the congestion control, inherited
from the host, is recorded).

Limits. torchft's manager server and checkpoint server bind the wildcard address (``[::]``); in emulated
mode that is inside each node's own namespace, on loopback it is the host's. The modelled network is not
offered: torchft's traffic would not pass through it. Heal time and the link's achievable bandwidth (issue
items beside this table) are separate measurements.

Writes ``benchmarks/results/b7_torchft.json`` (or ``--out``; ``--quick``: a temporary folder or
``$LOCO_BENCH_RESULTS``), with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.b1_fragments import BLOCKS, STEP_SECONDS_PER_M, Turns, key, modelled_steps, take_turns
from benchmarks.common import load_average, machine, results_dir, skip_final_collection, spread, table, write_json
from benchmarks.netem import launch, tun
from benchmarks.netem.links import Network, uniform
from benchmarks.netem.tcp import host_congestion

# torchft's DiLoCo with its defaults (one all-reduce per parameter tensor), and with use_bucketization=True
TORCHFT = ("torchft", "torchft_buckets")
DEFAULT_METHODS = (*TORCHFT, "diloco", "noloco", "gasloc")
STREAMS = 4  # the *_streams methods: ours over a transport of WireConfig(streams=4)'s 4 connections per pair
# the *_onestream methods: ours over the transport as it was built before streams="auto" and our own all-reduces:
# one connection per pair and gloo's all-reduce whatever N (the baseline for "nothing got slower")
METHODS = (*DEFAULT_METHODS, "diloco_streams", "noloco_streams", "diloco_onestream", "noloco_onestream",
           "gasloc_onestream", "diloco_fan1", "diloco_fan2", "diloco_fan3")
SYNC_EVERY = 20
SECONDS_PER_M = STEP_SECONDS_PER_M["diloco"]  # X per M parameters, every method alike
TIMEOUT_S = 900
IDLE_KEEPS_WINDOW = {"net.ipv4.tcp_slow_start_after_idle": "0"}  # set in the emulated namespaces only
# untimed rounds before the timed ones: round 0 warms the connections, and with all_reduce="auto" (our default) a
# payload's all-reduce is decided after its trials and the round that carries their times (transport.choice)
SETTLE_ROUNDS = 7  # len(transport.choice.TRIALS_CUT) + 1 (not imported: this process does not load torch)


def staged_transport(k: int) -> Any:
    """A study, for the ``diloco_fan<k>`` methods: our transport whose float32 all-reduce is our reduce-scatter
    and all-gather with at most k peers in flight at a time (shift s sends to replica me + s and receives from
    me − s, k shifts a stage, each stage waited for: it blocks, so only for τ = 0), the sums in replica order
    as the transport's own. Our default sends to all N − 1 peers at once."""
    import torch

    from lightning_loco.transport import TorchDistributedTransport
    from lightning_loco.transport.base import sum_in_group_order

    class Staged(TorchDistributedTransport):
        def start_all_reduce_sum(self, payload: Any, codec: Any = None, round_id: Any = None) -> Any:
            n, me = self.num_replicas, self.replica
            chunks = torch.tensor_split(payload.view(-1), n)
            received = {}
            for first in range(1, n, k):
                shifts = range(first, min(first + k, n))
                recv = {(me - s) % n: torch.empty_like(chunks[me]) for s in shifts}
                for w in self.exchange({(me + s) % n: chunks[(me + s) % n] for s in shifts}, recv):
                    w.wait()
                received.update(recv)
            chunks[me].copy_(sum_in_group_order({**received, me: chunks[me]}, range(n)))
            for first in range(1, n, k):
                shifts = range(first, min(first + k, n))
                sends = {(me + s) % n: chunks[me] for s in shifts}
                for w in self.exchange(sends, {(me - s) % n: chunks[(me - s) % n] for s in shifts}):
                    w.wait()
            return self.resolved(payload)

    return Staged


def networks(n: int, wan_mbit: float = 100.0) -> dict[str, Network]:
    """The modes' networks: loopback, the emulated WAN (``wan_mbit`` per node), and the emulated long fat pipe
    (``fat``)."""
    return {"loopback": Network("loopback", uniform(n).links), "emulated": uniform(n, mbit=wan_mbit, one_way_ms=50),
            "fat": uniform(n, mbit=1000, one_way_ms=100)}


def node_address(mode: str, rank: int) -> str:
    """This node's address: loopback, or its namespace's (``benchmarks.netem.tun``: node i is ``subnet.(i + 1)``)."""
    if mode == "loopback":
        return "127.0.0.1"
    return f"{os.environ['MASTER_ADDR'].rsplit('.', 1)[0]}.{rank + 1}"


# ---------------------------------------------------------------- worker


class TorchftTurns:
    """torchft's DiLoCo over F fragments of the same flat model as :class:`~benchmarks.b1_fragments.Turns`, with
    its own Lighthouse (served by rank 0) and Manager; the same ``turn(seconds)`` as ours."""

    def __init__(self, fragments: int, params: int, sync_every: int, overlap: int, seconds: float, rank: int,
                 world: int, address: str, lighthouse: str, bucketed: bool) -> None:
        from datetime import timedelta

        import torch
        from torch import nn
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        generator = torch.Generator().manual_seed(rank)
        size = params // BLOCKS
        self.blocks = [nn.Parameter(torch.randn(size, generator=generator)) for _ in range(BLOCKS)]
        per = BLOCKS // fragments
        parts = [nn.ParameterList(self.blocks[f * per:(f + 1) * per]) for f in range(fragments)]
        self.inner = torch.optim.SGD(self.blocks, lr=0.0)  # no gradients: the step is the hook alone
        # DiLoCo's outer step (Nesterov 0.9, lr 0.7), one optimizer per fragment as torchft's streaming form takes
        outer = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
        timeout = timedelta(seconds=TIMEOUT_S)
        self.store = TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, load_state_dict=None, state_dict=None,
            replica_id=f"b7_f{fragments}{'_buckets' if bucketed else ''}_{rank}", lighthouse_addr=lighthouse,
            hostname=address,
            store_addr=address, store_port=self.store.port, rank=0, world_size=1, use_async_quorum=False,
            init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        )
        self.diloco = DiLoCo(self.manager, parts, self.inner, outer, sync_every=sync_every,
                             fragment_sync_delay=overlap, use_bucketization=bucketed)
        self.diloco.__enter__()
        self.spent = {"quorum_s": 0.0, "commit_s": 0.0}
        for name, what in (("start_quorum", "quorum_s"), ("should_commit", "commit_s")):
            setattr(self.manager, name, self._timed(getattr(self.manager, name), what))
        self.sync_every, self.seconds, self.fragments = sync_every, seconds, fragments
        self.turns: list[dict[str, Any]] = []

    def _timed(self, method: Any, what: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[what] += time.perf_counter() - start

        return timed

    def turn(self, seconds: float) -> dict[str, Any]:
        import torch.distributed as dist

        dist.barrier()
        commits, spent = self.manager.current_step(), dict(self.spent)
        wall, in_step = modelled_steps(self.blocks, self.sync_every, seconds, self.inner.step)
        in_flight = self.diloco._local_step != 0 or any(f._allreduce_work for f in self.diloco._fragments)
        return {"wall_s": wall, "exposed_s": in_step, "rounds": self.manager.current_step() - commits,
                "in_flight_after": int(in_flight), **{what: self.spent[what] - spent[what] for what in spent}}

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def worker(options: dict[str, Any]) -> None:
    """Builds every (method, F) (rank 0 serving one Lighthouse per torchft run), warms every pair on our group,
    then runs round 0 (no compute) and the timed rounds, turn by turn; writes this rank's turns."""
    import torch
    import torch.distributed as dist

    from benchmarks.b1_shared import STORE, WARM_NUMEL, warm_all_pairs
    from lightning_loco.elastic.lighthouse import start_lighthouse
    from lightning_loco.testing.launch import init_gloo
    from lightning_loco.transport import TorchDistributedTransport
    from lightning_loco.transport.streams import auto_stream_groups

    torch.set_num_threads(1)
    os.environ.pop("TORCHFT_USE_BUCKETIZATION", None)  # would make torchft's default run bucketed
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out, mode = options["out"], options["mode"]
    address = node_address(mode, rank)
    init_gloo(rank, world, file=os.path.join(out, STORE), timeout_s=TIMEOUT_S)
    servers: list[Any] = []
    runs: dict[str, Any] = {}
    try:
        # ours as the strategies build it: streams="auto" with as many groups as the model's payload needs
        groups = auto_stream_groups(4 * options["params"], "gloo", 1)
        extra = [dist.new_group(backend="gloo") for _ in range(groups - 1)]
        transport = TorchDistributedTransport(torch.device("cpu"), streams="auto", stream_groups=extra)
        warm_all_pairs(transport, min(options["params"], WARM_NUMEL))
        others: dict[str, Any] = {"": transport}
        if any(m.endswith("_streams") for m in options["methods"]):  # every rank builds it (its groups), once
            others["streams"] = TorchDistributedTransport(torch.device("cpu"), streams=STREAMS)
            warm_all_pairs(others["streams"], min(options["params"], WARM_NUMEL))
        for m in options["methods"]:
            if "_fan" in m:  # the fan-out study (staged_transport), its own stream groups
                extra_fan = [dist.new_group(backend="gloo") for _ in range(groups - 1)]
                others[m.partition("_")[2]] = staged_transport(int(m[-1]))(torch.device("cpu"), streams="auto",
                                                                          stream_groups=extra_fan)
        if any(m.endswith("_onestream") for m in options["methods"]):
            others["onestream"] = TorchDistributedTransport(torch.device("cpu"), streams=1, all_reduce="backend")
        for m in options["methods"]:
            for F in options["fragments"]:
                if m in TORCHFT:
                    bind = f"{address}:0"
                    if rank == 0:
                        servers.append(start_lighthouse(bind=bind, min_replicas=world))
                    # torchft reports its host name; the replicas reach it at this node's address
                    port = servers[-1].address().rstrip("/").rpartition(":")[2] if rank == 0 else ""
                    lighthouse = [f"http://{address}:{port}" if rank == 0 else None]
                    dist.broadcast_object_list(lighthouse, src=0)
                    runs[key(m, F)] = TorchftTurns(F, options["params"], options["sync_every"], options["overlap"],
                                                   options["step_seconds"][m], rank, world, address, str(lighthouse[0]),
                                                   bucketed=m == "torchft_buckets")
                else:
                    base, _, variant = m.partition("_")
                    runs[key(m, F)] = Turns(base, F, options["params"], others[variant],
                                            options["sync_every"], options["overlap"], options["step_seconds"][m],
                                            rank)
        take_turns(runs, options["rounds"], os.path.join(out, f"rank{rank}.json"), warmup=options["settle"])
        ours = {id(t): t for t in others.values() if isinstance(t, TorchDistributedTransport)}.values()
        choices = {f"{t.all_reduce}:{k[0]}/{k[1]}/{k[2]}": c for t in ours for k, c in t.choices.items()}
        chosen = {name: (c.chosen, c.totals) for name, c in choices.items()}
        trials = {name: c.seconds for name, c in choices.items()}
        Path(out, f"choice{rank}.json").write_text(json.dumps(chosen))
        Path(out, f"trials{rank}.json").write_text(json.dumps(trials))
        # the pair exchanges' connection counts (transport.pair_streams): what each replica found faster, what each
        # pair proposed at its last exchange, and the times by count
        pairs = {f"{t.all_reduce}:{k[0]}/{k[1]}/{k[2]}": {"preferred": p.preferred(), "met": p.met,
                                                          "seconds": p.seconds}
                 for t in ours for k, p in t.pair_streams.items()}
        Path(out, f"pair_streams{rank}.json").write_text(json.dumps(pairs))
        dist.barrier()  # nobody's Lighthouse or manager goes while another replica may still sync
    finally:
        for run in runs.values():
            if isinstance(run, TorchftTurns):
                run.close()
        for server in servers:
            server.shutdown()
        dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def measure(mode: str, n: int, params: int, rounds: int, methods: list[str], fragments: list[int], sync_every: int,
            overlap: int, wan_mbit: float = 100.0, settle: int = SETTLE_ROUNDS) -> dict[str, Any]:
    """One configuration; per (method, F) the slowest replica's wall and exposed seconds per round, their spreads,
    and ours ÷ torchft's round by round."""
    seconds = {m: (SECONDS_PER_M * params / 1e6 if overlap else 0.0) for m in methods}
    network = networks(n, wan_mbit)[mode]
    options = {"mode": mode, "params": params, "rounds": rounds, "methods": methods, "fragments": fragments,
               "sync_every": sync_every, "overlap": overlap, "step_seconds": seconds, "settle": settle}
    with tempfile.TemporaryDirectory() as out:
        emulated = mode != "loopback"
        wall = launch.run_workers("emulated" if emulated else mode, network,
                                  lambda i: ["-m", "benchmarks.b7_torchft", "--worker",
                                             json.dumps({**options, "out": out})], timeout=3600,
                                  sysctls=IDLE_KEEPS_WINDOW if emulated else None)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(n)]
        choices = [json.loads(Path(out, f"choice{r}.json").read_text()) for r in range(n)]
        trials = [json.loads(Path(out, f"trials{r}.json").read_text()) for r in range(n)]
        pair_streams = [json.loads(Path(out, f"pair_streams{r}.json").read_text()) for r in range(n)]
    row: dict[str, Any] = {"mode": mode, "network": network.name, "replicas": n, "params": params,
                           "tcp": host_congestion() if emulated else None,
                           "sync_every": sync_every, "overlap_steps": overlap, "wall_s": wall,
                           "emulator": dict(launch.emulator) or None, "settle_rounds": settle,
                           "all_reduce_choice": choices[0], "choices_agree": all(c == choices[0] for c in choices),
                           "all_reduce_trials": trials, "pair_streams": pair_streams, "runs": {}}
    slowest: dict[str, dict[str, list[float]]] = {}
    for m in methods:
        for F in fragments:
            k = key(m, F)
            turns = [rank[k] for rank in ranks]
            slowest[k] = {q: [max(t[r][q] for t in turns) for r in range(rounds)] for q in ("wall_s", "exposed_s")}
            if m in TORCHFT:  # exchange against exchange: without its quorum and commit calls
                slowest[k]["net_s"] = [max(t[r]["exposed_s"] - t[r]["quorum_s"] - t[r]["commit_s"] for t in turns)
                                       for r in range(rounds)]
            # torchft's quorum and commit, ours' wait for the exchange at the landing: the slowest replica's
            parts = [q for q in ("quorum_s", "commit_s", "wait_s") if q in turns[0][0]]
            worst = [max(range(n), key=lambda i: turns[i][r]["exposed_s"]) for r in range(rounds)]
            row["runs"][k] = {"method": m, "fragments": F, "step_seconds": seconds[m],
                              "compute_s": sync_every * seconds[m],
                              **{q: spread(v) for q, v in slowest[k].items()},
                              **{q: spread([turns[i][r][q] for r, i in enumerate(worst)]) for q in parts},
                              "in_flight_after_turn": max(turn["in_flight_after"] for t in turns for turn in t),
                              "rounds_per_turn": sorted({turn["rounds"] for t in turns for turn in t})}
    for m in methods:
        for F in fragments:
            for reference in TORCHFT if m not in TORCHFT else ():
                against = key(reference, F)
                if against in slowest:
                    ratios = {q: [a / b if b > 0 else float("inf") for a, b in
                                  zip(slowest[key(m, F)][q], slowest[against][q])] for q in ("wall_s", "exposed_s")}
                    ratios["net_s"] = [a / b if b > 0 else float("inf") for a, b in
                                       zip(slowest[key(m, F)]["exposed_s"], slowest[against]["net_s"])]
                    row["runs"][key(m, F)][f"over_{reference}"] = {q: spread(v) for q, v in ratios.items()}
            before = key(f"{m}_onestream", F)  # ours as built now over ours as built before, round by round
            if before in slowest:
                row["runs"][key(m, F)]["over_onestream"] = {
                    q: spread([a / b if b > 0 else float("inf") for a, b in zip(slowest[key(m, F)][q],
                                                                                slowest[before][q])])
                    for q in ("wall_s", "exposed_s")}
    return row


def flat_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    flat = []
    for row in rows:
        for run in row["runs"].values():
            ratio = {m: (run.get(f"over_{m}") or {}).get("exposed_s", {}) for m in TORCHFT}
            net = (run.get("over_torchft_buckets") or {}).get("net_s", {})
            onestream = (run.get("over_onestream") or {}).get("exposed_s", {})
            flat.append({
                "mode": row["mode"], "n": row["replicas"], "params_m": row["params"] / 1e6,
                "tau": row["overlap_steps"], "method": run["method"], "F": run["fragments"],
                "X": run["step_seconds"], "rounds": ",".join(map(str, run["rounds_per_turn"])),
                "wall": run["wall_s"]["median"], "exposed": run["exposed_s"]["median"],
                "exposed_min": run["exposed_s"]["min"], "exposed_max": run["exposed_s"]["max"],
                "quorum": run.get("quorum_s", {}).get("median"), "commit": run.get("commit_s", {}).get("median"),
                "wait": run.get("wait_s", {}).get("median"),
                "net": run.get("net_s", {}).get("median"), "net_ratio": net.get("median"),
                "net_ratio_min": net.get("min"), "net_ratio_max": net.get("max"),
                **{f"{m}_{q}": ratio[m].get(q) for m in TORCHFT for q in ("median", "min", "max")},
                **{f"onestream_{q}": onestream.get(q) for q in ("median", "min", "max")},
            })
    return flat


def print_table(rows: list[dict[str, Any]], rounds: int) -> None:
    first = rows[0]
    print(f"\nB7: seconds per outer step (H = {first['sync_every']} inner steps), slowest replica, median "
          f"[min, max] of {rounds} rounds; X = MODELLED compute per inner step (0 when τ = 0: every sync blocks); "
          f"exposed = the time the method's own code took from the loop; ours ÷ torchft (its defaults) and ÷ bucketed "
          f"(torchft with use_bucketization=True): exposed, round by round, the same F "
          f"(rounds = syncs per turn; torchft counts its commits); quorum, commit = torchft's time in "
          f"start_quorum and should_commit (the slowest replica's), w/o quorum = its exposed time without them; "
          f"÷ bucketed w/o quorum = ours over that; ÷ one stream = ours over the same method's *_onestream run "
          f"(one connection per pair, gloo's all-reduce: the transport as built before streams='auto'); {machine()}")
    print(table(flat_rows(rows), [
        ("mode", "mode", "s"), ("n", "N", "d"), ("params_m", "M params", "g"), ("tau", "τ", "d"),
        ("method", "method", "s"), ("F", "F", "d"), ("X", "X s", ".3g"), ("rounds", "rounds", "s"),
        ("wall", "wall s", ".3f"), ("exposed", "exposed s", ".3f"), ("exposed_min", "min", ".3f"),
        ("exposed_max", "max", ".3f"), ("quorum", "quorum s", ".3f"), ("commit", "commit s", ".3f"),
        ("wait", "wait s", ".3f"), ("net", "w/o quorum s", ".3f"),
        ("torchft_median", "÷ torchft", ".2f"), ("torchft_min", "min", ".2f"), ("torchft_max", "max", ".2f"),
        ("torchft_buckets_median", "÷ bucketed", ".2f"), ("torchft_buckets_min", "min", ".2f"),
        ("torchft_buckets_max", "max", ".2f"), ("net_ratio", "÷ bucketed w/o quorum", ".2f"),
        ("net_ratio_min", "min", ".2f"), ("net_ratio_max", "max", ".2f"),
        ("onestream_median", "÷ one stream", ".2f"), ("onestream_min", "min", ".2f"),
        ("onestream_max", "max", ".2f")]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="loopback, N = 2, 0.1 M parameters, H = 4, 2 rounds")
    parser.add_argument("--modes", nargs="+", choices=("loopback", "emulated", "fat"),
                        help="default: loopback, and emulated (100 Mbit/s, 50 ms one way) where root; fat: "
                        "the emulated long fat pipe (1 Gbit/s, 100 ms one way)")
    parser.add_argument("--replicas", nargs="+", type=int, help="default 2 4")
    parser.add_argument("--wan-mbit", type=float, default=100.0,
                        help="the emulated WAN's bandwidth per node (default 100 Mbit/s; 50 ms one way)")
    parser.add_argument("--params", nargs="+", type=float, help="default 10e6 (multiples of 16)")
    parser.add_argument("--methods", nargs="+", choices=METHODS,
                        help="default: all but the *_streams ones (ours with WireConfig(streams=4)) and the "
                        "*_onestream ones (ours with one connection per pair and gloo's all-reduce, as built before "
                        "streams='auto') and the diloco_fan<k> study (our all-reduce, k peers at a time, τ = 0 "
                        "only); torchft (its defaults) and torchft_buckets (use_bucketization=True) are the "
                        "references")
    parser.add_argument("--fragments", nargs="+", type=int, default=[1, 4], help="F (default 1 4)")
    parser.add_argument("--sync-every", type=int, help=f"H (default {SYNC_EVERY}; 4 with --quick)")
    parser.add_argument("--overlap", nargs="+", type=int,
                        help="τ per configuration (default 0 4; 0 with --quick): 0 blocks at every sync")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 3; 2 with --quick)")
    parser.add_argument("--out", default="b7_torchft", help="the results' name (default b7_torchft)")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        skip_final_collection()
        return
    emulated_ok, why = tun.available()
    modes = args.modes or (["loopback"] if args.quick else ["loopback"] + (["emulated"] if emulated_ok else []))
    if {"emulated", "fat"} & set(modes) and not emulated_ok:
        sys.exit(f"emulated mode unavailable: {why}; use --modes loopback")
    replicas = args.replicas or ([2] if args.quick else [2, 4])
    sizes = [int(p) for p in (args.params or ([1e5] if args.quick else [10e6]))]
    methods = args.methods or list(DEFAULT_METHODS)
    sync_every = args.sync_every or (4 if args.quick else SYNC_EVERY)
    overlaps = args.overlap if args.overlap is not None else ([0] if args.quick else [0, 4])
    rounds = args.rounds or (2 if args.quick else 3)
    if not set(TORCHFT) & set(methods):
        parser.error(f"--methods must include {' or '.join(TORCHFT)}: B7 compares with torchft")
    for F in args.fragments:
        for tau in overlaps:
            if F < 1 or sync_every % F or BLOCKS % F or not 0 <= tau < sync_every // F:
                parser.error(f"--fragments {F} --overlap {tau}: F must divide H = {sync_every} and the model's "
                             f"{BLOCKS} tensors, and τ be below H/F = {sync_every // max(F, 1)} (torchft's rule, "
                             "and ours)")
    if any("_fan" in m for m in methods) and any(overlaps):
        parser.error("the diloco_fan<k> study blocks in its all-reduce: run it with --overlap 0")
    if any(p % BLOCKS for p in sizes):
        parser.error(f"--params must be multiples of {BLOCKS} (the model's blocks), got {sizes}")
    results = results_dir(args.quick)
    before = load_average()
    rows = []
    for mode in modes:
        for n in replicas:
            for params in sizes:
                for tau in overlaps:
                    row = measure(mode, n, params, rounds, methods, args.fragments, sync_every, tau,
                                  args.wan_mbit, settle=1 if args.quick else SETTLE_ROUNDS)
                    rows.append(row)
                    print(f"B7: {mode} N={n} {params / 1e6:g} M τ={tau} done in {row['wall_s']:.0f} s", flush=True)
                    if row["emulator"]:
                        print(f"    the emulator: {row['emulator']}", flush=True)
                    if row["all_reduce_choice"]:
                        print(f"    all_reduce='auto' chose (per transport:optimizer/fragment/size, with the summed "
                              f"times of p2p, backend and backend_whole): {row['all_reduce_choice']}; the same on "
                              f"every replica: {row['choices_agree']}", flush=True)
    print_table(rows, rounds)
    path = write_json(f"{args.out}.json", {
        "benchmark": "B7 torchft beside ours", "rounds": rounds, "torchft": _version("torchft"),
        "compute": "modelled: X s of sleep per inner step after an in-place change of every parameter",
        "uptime_before": before, "uptime_after": load_average(), "rows": rows}, results)
    print(f"wrote {path}")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
