"""Elastic healing's speed: the time to heal a replica against the time to send its weights once, by model size.

    python -m benchmarks.elastic_heal            # ~40 s on 2 cores: 1 M, 10 M, 100 M parameters, 5 repeats
    python -m benchmarks.elastic_heal --quick    # ~10 s: 1 M and 10 M, 2 repeats

Two forked processes on one machine (loopback), a donor and a joiner, over torchft's ``ProcessGroupGloo``
(the elastic membership's process group) and a ``TCPStore`` (its rendezvous store). The donor holds the
state a real heal carries for a model of N float32 parameters in about 100 weight matrices, each with a
bias (NoLoCo with AdamW): the outer state (anchor and momentum), AdamW's two moments and step count per
parameter, and the counters; the live weights travel as the anchor, which they equal bitwise between rounds
(a heal sends them apart only when they differ: overlap, or a round dropped), so 4 × N float32 in all.
Per repeat, interleaved (the machine's load drifts alike over all four):

* ``weights once``: the donor sends its flat weights (N float32) in one message, the joiner receives them
  into a buffer it used before; ``into fresh memory``: the same into a new buffer, as a joiner's receive is
  (the first touch of fresh pages costs the kernel's page faults, here about as much as the transfer);
* ``heal``: :mod:`lightning_loco.elastic.state_transfer` as a membership runs it: the donor prepares the state and
  writes the header to the store, then sends the tensors point to point in messages of at most 64 MB;
  the joiner takes the header, receives the tensors (the outer state in place, into its own anchor and
  momentum, set up before it joined; the rest into fresh memory) and rebuilds the state; ``heal, all
  fresh``: the same with every tensor received into fresh memory (as before the outer state landed in place);
* ``weights apart``: the same heal with the live weights sent apart from the anchor (5 × N float32), as
  every heal did before the weights equal to the anchor travelled once;
* ``without the optimizer``: the heal of a donor with ``heal_optimizer=False`` (AdamW's moments left out:
  the outer state, 2 × N float32);
* ``verified``: the heal of a donor with ``verify_heal=True``: the donor digests every tensor into the header,
  the joiner digests what it received and compares (:mod:`lightning_loco.elastic.heal_digests`); ``digests``:
  the joiner's digests alone (:func:`~lightning_loco.elastic.heal_digests.sign` of the healed state, one
  thread), the cost each side adds;
* ``torchft``: the same state through torchft's own recovery path, the checkpoint transport its ``Manager``
  uses by default (``torchft.checkpointing.HTTPTransport``, ``num_chunks=0``): the donor stages the state
  (``send_checkpoint``), the joiner fetches it over HTTP and loads it (``recv_checkpoint``), all into fresh
  memory, as a restarted torchft replica does;
* ``store`` (the path healing took before, up to ``--store-max`` parameters): the donor ``torch.save``s the
  whole state into one store value, the joiner ``get``s and loads it. The membership's store (torch's
  default ``TCPStore``, libuv) refuses values above 8 MiB, so that path failed for any state above about
  0.4 M parameters with AdamW; it is timed here on a store without that limit (``use_libuv=False``).

Each is timed on the joiner from a barrier to the state in its hands (so the donor's preparation counts).
Writes ``benchmarks/results/elastic_heal.json`` (``--quick``: a temporary folder, or ``$LOCO_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from datetime import timedelta
from typing import Any

from benchmarks.common import machine, results_dir, spread, table, write_json

SIZES = {"1M": 1_000_000, "10M": 10_000_000, "100M": 100_000_000}


def layout(n: int) -> list[tuple[int, ...]]:
    """About 100 square matrices d × d and a bias of d each, N parameters in all (the last matrix cut short)."""
    d = max(8, int((n / 100) ** 0.5))
    shapes: list[tuple[int, ...]] = []
    left = n
    while left > 0:
        rows = min(d, max(1, (left - d) // d)) if left > d else 0
        if rows:
            shapes.append((rows, d))
            left -= rows * d
        bias = min(d, left)
        if bias:
            shapes.append((bias,))
            left -= bias
    return shapes


def training_state(n: int) -> dict[str, Any]:
    """What a NoLoCo replica with AdamW hands a joiner (the shapes of :meth:`ElasticPlugin.export_state`)."""
    import torch

    g = torch.Generator().manual_seed(0)
    weights = torch.randn(n, generator=g)
    shapes = layout(n)
    state = {i: {"step": torch.tensor(1000.0), "exp_avg": torch.randn(s, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(s, generator=g) * 1e-6} for i, s in enumerate(shapes)}
    return {
        "driver": [{"numel": n, "inner_steps": 1000, "outer_steps": 100, "in_flight": None, "phase": None,
                    "state": {"anchor": weights.clone(), "momentum": torch.randn(n, generator=g) * 1e-3}}],
        "weights": [None],  # between rounds (τ = 0) the live weights are the anchor, bitwise: they travel as it
        "extra": {"optimizers": [{"state": state, "param_groups": [
            {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(state)}]}],
            "schedulers": [{"last_epoch": 1000, "_step_count": 1001}], "loops": {"global_step": 1000}},
    }


def worker(rank: int, address: str, whole_address: str, sizes: list[str], repeats: int, store_max: int,
           conn: Any) -> None:
    """One of the two processes: rank 0 the donor, rank 1 the joiner, which sends its timings to ``conn``."""
    import torch
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo, create_store_client

    from lightning_loco.elastic import state_transfer as heal
    from lightning_loco.elastic.heal_digests import sign

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=600))
    pg.configure(f"{address}/pg", f"r{rank}", rank, 2)
    store = create_store_client(f"{address}/heal", timedelta(seconds=600))
    whole_store = create_store_client(f"{whole_address}/whole", timedelta(seconds=600))
    from torchft.checkpointing import HTTPTransport

    http = HTTPTransport(timeout=timedelta(seconds=600), num_chunks=0)  # torchft's Manager's default
    if rank == 0:  # its address names this host; the joiner is on the same one
        store.set("torchft", "http://127.0.0.1:" + http.metadata().split("://", 1)[1].split(":", 1)[1])
    torchft_url = store.get("torchft").decode()

    def barrier() -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        pg.allreduce([torch.zeros(1)], options).wait()

    results: list[dict[str, Any]] = []
    for label in sizes:
        n = SIZES[label]
        state = training_state(n) if rank == 0 else None
        weights = state["driver"][0]["state"]["anchor"] if state is not None else torch.empty(n)
        head = heal.header(1, 100, ["r1"], "r0")
        # the joiner's own outer state, set up (and so touched) before it joins, as its driver's is: a heal of
        # the whole state lands there (ElasticPlugin.landing); AdamW's moments arrive in fresh memory
        own = None if rank == 0 else {"driver": [{"state": {"anchor": torch.zeros(n), "momentum": torch.zeros(n)}}]}
        for repeat in range(repeats):
            row: dict[str, Any] = {"size": label, "parameters": n, "repeat": repeat}
            barrier()
            started = time.perf_counter()
            (pg.send([weights], 1, 7) if rank == 0 else pg.recv([weights], 0, 7)).wait()
            row["once_s"] = time.perf_counter() - started
            barrier()
            started = time.perf_counter()
            fresh = weights if rank == 0 else torch.empty(n)
            (pg.send([fresh], 1, 8) if rank == 0 else pg.recv([fresh], 0, 8)).wait()
            row["fresh_s"] = time.perf_counter() - started
            del fresh
            # the heal, and the same with the weights sent apart from the anchor (as before they travelled once)
            lean = {**state, "extra": {**state["extra"], "optimizers": None}} if rank == 0 else None  # no moments
            variants = (("heal", state, True), ("fresh_heal", state, False),
                        ("apart", {**state, "weights": [weights]} if rank == 0 else None, True), ("lean", lean, True),
                        ("verified", state, True))
            for name, sent, in_place in variants:
                key = f"{name}/{label}/{repeat}"
                barrier()
                started = time.perf_counter()
                if rank == 0:
                    heal.prepare(sent, head, verify=name == "verified").send(pg, store, key, [1], 600.0)
                else:
                    incoming = heal.Incoming(heal.take(store, key, 1), head)
                    into = heal.in_place(incoming.skeleton, own, incoming.metas) if in_place else None
                    healed = incoming.receive(pg, 0, 600.0, into)
                    row[f"{name}_s"] = time.perf_counter() - started
                    row[f"{name}_bytes"] = incoming.nbytes
                    if name == "heal":  # the digests one side adds, alone
                        tensors: list[Any] = []
                        heal.split(healed, tensors)
                        started = time.perf_counter()
                        sign(tensors)
                        row["digests_s"] = time.perf_counter() - started
                    del healed, incoming
            barrier()
            step = 1000 * sizes.index(label) + repeat
            started = time.perf_counter()
            if rank == 0:
                http.send_checkpoint([1], step, state, timedelta(seconds=600))
            else:
                received = http.recv_checkpoint(0, torchft_url, step, timedelta(seconds=600))
                row["torchft_s"] = time.perf_counter() - started
                del received
            barrier()
            if rank == 0:
                http.disallow_checkpoint()  # as the Manager does after a quorum: the next step's is staged anew
            if n <= store_max:
                barrier()
                started = time.perf_counter()
                if rank == 0:
                    heal.put(whole_store, key, heal.encode(state, head))
                else:
                    raw = heal.take(whole_store, key, 1)
                    loaded = heal.decode(raw, head)
                    row["store_s"] = time.perf_counter() - started
                    del raw, loaded
            results.append(row)
        del state, weights, own
    barrier()
    http.shutdown(wait=False)
    if rank == 1:
        conn.send(results)
    conn.close()
    os._exit(0)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 M and 10 M parameters, 2 repeats")
    parser.add_argument("--repeats", type=int, help="repeats per size (default 5; quick: 2)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), help="model sizes (default: all; quick: 1M 10M)")
    parser.add_argument("--store-max", type=int, default=10_000_000,
                        help="largest model (parameters) also healed through the store, the path taken before "
                             "(default 10 M: at 100 M it holds three 2 GB copies at once)")
    args = parser.parse_args()
    sizes = args.sizes or (["1M", "10M"] if args.quick else list(SIZES))
    repeats = args.repeats or (2 if args.quick else 5)
    begun = time.perf_counter()
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=600))
    whole = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=600), use_libuv=False)
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    addresses = (f"127.0.0.1:{store.port}", f"127.0.0.1:{whole.port}")
    procs = [ctx.Process(target=worker, args=(r, *addresses, sizes, repeats, args.store_max, send)) for r in range(2)]
    for proc in procs:
        proc.start()
    send.close()
    try:
        runs = receive.recv()
    finally:
        for proc in procs:
            proc.join(60)
    rows = []
    for label in sizes:
        mine = [r for r in runs if r["size"] == label]
        once, healed = [r["once_s"] for r in mine], [r["heal_s"] for r in mine]
        fresh = [r["fresh_s"] for r in mine]
        through_store = [r["store_s"] for r in mine if "store_s" in r]
        apart = [r["apart_s"] for r in mine]
        weight_bytes, heal_bytes = 4 * SIZES[label], mine[0]["heal_bytes"]
        rows.append({
            "size": label, "heal_mb": heal_bytes / 1e6, "bytes_ratio": heal_bytes / weight_bytes,
            "once": spread(once), "fresh": spread(fresh), "heal": spread(healed),
            "fresh_ratio": statistics.median(healed) / statistics.median(fresh),
            "store": spread(through_store) if through_store else None,
            "ratio": statistics.median(healed) / statistics.median(once),
            "ratios": spread([h / o for h, o in zip(healed, once)]),
            "store_ratio": statistics.median(through_store) / statistics.median(once) if through_store else None,
            "once_gb_s": weight_bytes / statistics.median(once) / 1e9,
            "heal_gb_s": heal_bytes / statistics.median(healed) / 1e9,
            "apart": spread(apart), "apart_mb": mine[0]["apart_bytes"] / 1e6,
            "apart_ratio": statistics.median(apart) / statistics.median(once),
            "heal_vs_apart": spread([h / a for h, a in zip(healed, apart)]),
            "fresh_heal": spread([r["fresh_heal_s"] for r in mine]),
            "in_place_vs_fresh": spread([r["heal_s"] / r["fresh_heal_s"] for r in mine]),
            "lean": spread([r["lean_s"] for r in mine]), "lean_mb": mine[0]["lean_bytes"] / 1e6,
            "lean_ratio": statistics.median([r["lean_s"] for r in mine]) / statistics.median(once),
            "lean_ratios": spread([r["lean_s"] / r["once_s"] for r in mine]),
            "verified": spread([r["verified_s"] for r in mine]),
            "verified_vs_heal": spread([r["verified_s"] / r["heal_s"] for r in mine]),
            "digests": spread([r["digests_s"] for r in mine]),
            "digests_vs_heal": spread([r["digests_s"] / r["heal_s"] for r in mine]),
            "torchft": spread([r["torchft_s"] for r in mine]),
            "torchft_vs_heal": spread([r["torchft_s"] / r["heal_s"] for r in mine]),
        })
    flat = [{**r, "once_s": r["once"]["median"], "once_range": f"{r['once']['min']:.3f}-{r['once']['max']:.3f}",
             "fresh_s": r["fresh"]["median"], "heal_s": r["heal"]["median"],
             "heal_range": f"{r['heal']['min']:.3f}-{r['heal']['max']:.3f}",
             "store_s": r["store"]["median"] if r["store"] else None, "apart_s": r["apart"]["median"],
             "vs_apart": r["heal_vs_apart"]["median"], "lean_s": r["lean"]["median"],
             "fresh_heal_s": r["fresh_heal"]["median"], "in_place": r["in_place_vs_fresh"]["median"],
             "lean_range": f"{r['lean_ratios']['min']:.2f}-{r['lean_ratios']['max']:.2f}",
             "verified_s": r["verified"]["median"], "verified_vs_heal": r["verified_vs_heal"]["median"],
             "verified_range": f"{r['verified_vs_heal']['min']:.2f}-{r['verified_vs_heal']['max']:.2f}",
             "digests_s": r["digests"]["median"], "digests_vs_heal": r["digests_vs_heal"]["median"],
             "torchft_s": r["torchft"]["median"], "torchft_vs_heal": r["torchft_vs_heal"]["median"],
             "torchft_range": f"{r['torchft_vs_heal']['min']:.2f}-{r['torchft_vs_heal']['max']:.2f}"} for r in rows]
    print(f"\nhealing over loopback gloo on {machine()}, median of {repeats} repeats (min-max)")
    print(table(flat, [("size", "parameters", ""), ("heal_mb", "healed MB", ".0f"),
                       ("bytes_ratio", "× weights", ".2f"),
                       ("once_s", "weights once s", ".3f"), ("once_range", "range", ""),
                       ("fresh_s", "into fresh memory s", ".3f"),
                       ("heal_s", "heal s", ".3f"), ("heal_range", "range", ""), ("ratio", "heal / once", ".2f"),
                       ("fresh_ratio", "heal / fresh", ".2f"), ("fresh_heal_s", "heal, all fresh s", ".3f"),
                       ("in_place", "heal / all fresh", ".2f"), ("apart_s", "weights apart s", ".3f"),
                       ("apart_ratio", "apart / once", ".2f"), ("vs_apart", "heal / apart", ".2f"),
                       ("lean_mb", "no optimizer MB", ".0f"), ("lean_s", "no optimizer s", ".3f"),
                       ("lean_ratio", "no optimizer / once", ".2f"), ("lean_range", "per repeat", ""),
                       ("once_gb_s", "once GB/s", ".2f"), ("heal_gb_s", "heal GB/s", ".2f"),
                       ("verified_s", "verified s", ".3f"), ("verified_vs_heal", "verified / heal", ".2f"),
                       ("verified_range", "per repeat", ""), ("digests_s", "digests (one side) s", ".3f"),
                       ("digests_vs_heal", "digests / heal", ".2f"),
                       ("store_s", "store path s", ".3f"), ("store_ratio", "store / once", ".2f"),
                       ("torchft_s", "torchft HTTP s", ".3f"), ("torchft_vs_heal", "torchft / heal", ".2f"),
                       ("torchft_range", "per repeat", "")]))
    path = write_json("elastic_heal.json", {"repeats": repeats, "seconds": round(time.perf_counter() - begun, 1),
                                            "rows": rows, "runs": runs}, folder=results_dir(args.quick))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
