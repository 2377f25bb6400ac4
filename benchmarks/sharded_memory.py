"""Memory per rank with FSDP2 inside each replica against DDP inside, at k = 2 and 4 ranks per replica.

    python -m benchmarks.sharded_memory            # 50 M parameters; 4 and 8 processes on the CPU (~10 min)
    python -m benchmarks.sharded_memory --quick    # ~1 M parameters, k = 2 only, results to a temporary folder

Each configuration is one NoLoCo run through a real ``Trainer`` on the CPU (gloo), AdamW inside,
H = 2, a few steps, started with Lightning's popen launcher:

* DDP inside (``ranks_per_replica=k``): every rank holds the whole model, its gradients, AdamW's
  state and the float32 outer state (NoLoCo's anchor and momentum: two model copies);
* FSDP2 inside (``replica_sharding="fsdp"``): each rank holds its own shards of all of them; the
  module builds its blocks on the meta device in ``configure_model`` and shards them, so no rank ever
  allocates the whole model.

Memory is measured two ways on every rank at the end of training: **tracked tensor bytes** (the
storage of the parameters, gradients, inner optimizer state and outer state each rank holds, summed
by walking those objects: exact, and what the target is about) and the process's **peak RSS**
(``ru_maxrss``: everything, Python, torch and Lightning included, and transient buffers). The row
also has the outer step's time (the median of the rounds of the slowest rank, through the reports)
and the bytes each rank sent per outer step. Target: parameters + optimizer + outer state per rank
within 1.15 × (1/k) of DDP inside's.

Replicas: k = 2 runs as 2 replicas of 2 ranks (4 processes). k = 4 runs DDP inside with one replica
of 4 ranks (4 processes: 8 whole-model processes do not fit a 24 GB machine next to other work), whose
memory per rank does not depend on the number of replicas, and FSDP2 inside with 2 replicas of 4 ranks
(8 processes), which also measures the bytes; DDP inside's bytes per rank at k = 4 are its sliced
exchange's, 1/k of the model, and are left out of the table. Prints a table; writes
``benchmarks/results/sharded_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    forking,
    machine,
    results_dir,
    run_python,
    skip_final_collection,
    table,
    wait_for_files,
    write_json,
)

# (k, replicas, mode): the configurations, in order
CONFIGS = ((2, 2, "ddp"), (2, 2, "fsdp"), (4, 1, "ddp"), (4, 2, "fsdp"))


def tensor_bytes(tensors: Any) -> int:
    """Storage bytes of ``tensors`` (a DTensor counts its local shard), each storage once."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def make_module(width: int, depth: int) -> Any:
    import lightning as L
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Stack(L.LightningModule):
        """Blocks built in ``configure_model``: on the meta device and sharded block by block when the
        strategy gives a device mesh (FSDP2 inside), whole otherwise."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks: Any = None

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if self.blocks is not None:
                return
            if self.device_mesh is None:
                self.blocks = nn.Sequential(*(Block() for _ in range(depth)))
                return
            with torch.device("meta"):
                self.blocks = nn.Sequential(*(Block() for _ in range(depth)))
            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.blocks, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.blocks(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Stack()


def worker(mode: str, k: int, width: int, depth: int, steps: int, out: str) -> None:
    """One rank of one configuration (Lightning's popen launcher runs this command on every rank)."""
    import resource

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_loco import NoLoCoStrategy

    torch.set_num_threads(1)
    measured: dict[str, Any] = {}

    class Measure(L.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            strategy = trainer.strategy
            params = list(pl_module.parameters())
            inner = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values()
                     if torch.is_tensor(t)]
            outer = []
            for slot in strategy.outer_slots:
                outer += [t for t in slot.state.state_dict().values() if torch.is_tensor(t)]
                outer += [t for t in (slot.residual, slot.outer_weights) if t is not None]
            measured.update(
                numel=sum(p.numel() for p in params), local_numel=sum(slot.flat.numel for slot in strategy.outer_slots),
                params=tensor_bytes(params), grads=tensor_bytes(p.grad for p in params), inner=tensor_bytes(inner),
                outer=tensor_bytes(outer),
                outer_seconds=[r.seconds for r in strategy.outer_step_reports],
                bytes_sent=[r.bytes_sent for r in strategy.outer_step_reports],
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # kilobytes on Linux
            )
            path = os.path.join(out, f"rank{trainer.global_rank}.json")  # on every rank
            with open(path + ".part", "w") as f:
                json.dump(measured, f)
            os.replace(path + ".part", path)  # whole or absent to the reader

    kwargs = {"replica_sharding": "fsdp"} if mode == "fsdp" else {}
    # the ranks are new interpreters (Lightning's popen launcher), or forked children in the suite's smoke run
    # (DDP inside only: a sharded model is never launched by fork)
    start = "fork" if forking() and mode == "ddp" else "popen"
    strategy = NoLoCoStrategy(sync_every=2, ranks_per_replica=k, average_at_end=False, start_method=start, **kwargs)
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["BENCH_WORLD"]), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Measure()])
    trainer.fit(make_module(width, depth), DataLoader(TensorDataset(x), batch_size=4))


def measure(mode: str, k: int, replicas: int, width: int, depth: int, steps: int) -> dict[str, Any]:
    world = k * replicas
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "benchmarks.sharded_memory", "--worker", mode, str(k), str(width), str(depth),
                   str(steps), out]
        env = {**os.environ, "BENCH_WORLD": str(world)}
        proc = run_python(command[1:], env=env, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} k={k}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        files = [Path(out, f"rank{r}.json") for r in range(world)]
        missing = wait_for_files(files)  # the other ranks may end after rank 0's process
        if missing:
            raise RuntimeError(f"{mode} k={k}: {[f.name for f in missing]} not written within 120 s of rank 0's "
                               f"end\n{proc.stderr[-3000:]}")
        ranks = [json.loads(f.read_text()) for f in files]
    worst = max(ranks, key=lambda r: r["params"] + r["inner"] + r["outer"])
    rounds = [max(r["outer_seconds"][i] for r in ranks) for i in range(len(ranks[0]["outer_seconds"]))]
    sent = max(max(r["bytes_sent"], default=0) for r in ranks)
    return {
        "mode": mode, "ranks_per_replica": k, "replicas": replicas, "processes": world,
        "m_params": ranks[0]["numel"] / 1e6,  # a DTensor's numel is the whole parameter's
        "params_mb": worst["params"] / 1e6, "grads_mb": worst["grads"] / 1e6, "inner_mb": worst["inner"] / 1e6,
        "outer_mb": worst["outer"] / 1e6, "state_mb": (worst["params"] + worst["inner"] + worst["outer"]) / 1e6,
        "peak_rss_mb": max(r["peak_rss"] for r in ranks) / 1e6,
        "outer_step_s": statistics.median(rounds) if rounds else None,
        "mb_sent_per_rank": sent / 1e6 if replicas > 1 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~1 M parameters, k = 2 only")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, k, width, depth, steps, out = args.worker
        worker(mode, int(k), int(width), int(depth), int(steps), out)
        skip_final_collection()
        return
    width, depth, steps = (128, 8, 4) if args.quick else (1024, 6, 4)  # 8·width² + 5·width per block
    rows = []
    configs = [c for c in CONFIGS if c[0] == 2] if args.quick else CONFIGS  # quick: k = 2 only (4 processes a run)
    for k, replicas, mode in configs:
        rows.append(measure(mode, k, replicas, width, depth, steps))
        print(f"{mode} k={k} x {replicas}: {rows[-1]['state_mb']:.1f} MB of state per rank", flush=True)
    for row in rows:
        ddp = next(r for r in rows if r["mode"] == "ddp" and r["ranks_per_replica"] == row["ranks_per_replica"])
        row["state_vs_ddp"] = row["state_mb"] / ddp["state_mb"]
        row["target"] = 1.15 / row["ranks_per_replica"] if row["mode"] == "fsdp" else None
        row["met"] = None if row["target"] is None else row["state_vs_ddp"] <= row["target"]
        row["met_text"] = {None: "-", True: "yes", False: "NO"}[row["met"]]
    print(f"\nPer rank, the largest rank; NoLoCo, AdamW inside, {steps} steps at H = 2, CPU (gloo); {machine()}")
    print("state = parameters + inner optimizer + outer state (tracked tensor bytes); peak RSS = whole process")
    print(table(rows, [("mode", "inside", "s"), ("ranks_per_replica", "k", "d"), ("replicas", "N", "d"),
                       ("m_params", "M params", ".1f"), ("params_mb", "params MB", ".1f"),
                       ("grads_mb", "grads MB", ".1f"), ("inner_mb", "AdamW MB", ".1f"),
                       ("outer_mb", "outer MB", ".1f"), ("state_mb", "state MB", ".1f"),
                       ("state_vs_ddp", "vs DDP", ".3f"), ("target", "target", ".3f"), ("met_text", "met", "s"),
                       ("peak_rss_mb", "peak RSS MB", ".0f"), ("outer_step_s", "outer step s", ".3f"),
                       ("mb_sent_per_rank", "MB sent/rank", ".2f")]))
    path = write_json("sharded_memory.json", {"benchmark": "sharded memory", "width": width, "depth": depth,
                                              "steps": steps, "rows": rows}, results_dir(args.quick))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
