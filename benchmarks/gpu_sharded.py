"""The GPU check of FSDP2 inside a replica (``replica_sharding="fsdp"``): a mesh of one shard on CUDA.

    python -m benchmarks.gpu_sharded          # on a machine with CUDA (about a minute); a CPU dry run without

One process, a world of one (NCCL on CUDA, gloo on the CPU), one replica of one rank:
``ranks_per_replica=1`` with ``replica_sharding="fsdp"`` makes every parameter a ``DTensor`` on the
replica's (1, 1) device mesh, so a real ``Trainer`` runs the whole local-shard path: the automatic
policy (``FSDPConfig(blocks=...)``) with FSDP2's ``MixedPrecisionPolicy`` (bf16 compute, float32 reduction),
:class:`~lightning_loco.driver.flat.ShardedParameters` copying the CUDA shards into the float32 outer state
on the CPU through the pinned staging buffers (``outer_state_device="cpu"``), the transport told that
each rank is its own slice (DiLoCo's all-reduce on the world of one; NoLoCo's groups of one), a
checkpoint whose consensus model is full and loads into a plain module on the CPU, and a resumed fit
from it (sharded optimizer state back into ``DTensor``s on the device). It prints a table and writes
``gpu_sharded.json`` (``benchmarks/results/`` on a GPU; a temporary folder, or ``$LOCO_BENCH_RESULTS``,
for the dry run). Exit status 1 when a check failed.

The CPU dry run (no CUDA) takes the same path with a smaller model, gloo, and CPU tensors sent
through the staging buffers as CUDA ones would be (``stage_cpu_params``, ``stage_cpu_payloads``);
the tests run it. To make it a part of the GPU check, call :func:`check` in a process of its own
(it starts a world of one) and add its ``rows`` to the check's table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from typing import Any

from benchmarks.common import results_dir, table, write_json


def make_module(width: int, depth: int, lr: float = 1e-3) -> Any:
    import lightning as L
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.stem = nn.Linear(16, width)
            self.blocks = nn.Sequential(*(Block() for _ in range(depth)))
            self.head = nn.Linear(width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.stem(x)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=lr)

    module = Regressor()
    module.losses = []
    return module, Block


def data(steps: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * 8, 16, generator=g)
    y = x[:, :1] * 2.0 - x[:, 1:2]
    return DataLoader(TensorDataset(x, y), batch_size=8)


def fit(strategy: Any, module: Any, steps: int, accelerator: str, ckpt_path: Any = None) -> tuple[Any, dict]:
    """Fits ``module``; returns the trainer and what the driver held at the end of training (its
    flat parameters' staging and the transport's slicing)."""
    import lightning as L

    seen: dict[str, Any] = {}

    class Look(L.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            driver = trainer.strategy.driver
            seen["staged"] = [slot.flat._staged() for slot in driver.slots]
            seen["allocations"] = [slot.flat.staging.allocations for slot in driver.slots]
            seen["slices"] = driver.transport.slices_per_replica

    trainer = L.Trainer(strategy=strategy, accelerator=accelerator, devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Look()])
    trainer.fit(module, data(steps), ckpt_path=ckpt_path)
    return trainer, seen


def check(device: str, out_dir: str, width: int = 1024, depth: int = 4, steps: int = 8) -> dict[str, Any]:
    """Runs the checks on ``device`` ("cuda" or "cpu"); returns ``{"rows": [...], "ok": bool, ...}``."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from lightning_loco import DiLoCoStrategy, FSDPConfig, NoLoCoStrategy
    from lightning_loco.driver.flat import FlatParameters
    from lightning_loco.replica import checkpoints
    from lightning_loco.transport import TorchDistributedTransport

    cuda = device == "cuda"
    if not cuda:  # the staging path CUDA tensors take, on CPU tensors
        FlatParameters.stage_cpu_params = True
        TorchDistributedTransport.stage_cpu_payloads = True
    rows: list[dict[str, Any]] = []

    def add(name: str, ok: bool, result: str) -> None:
        rows.append({"check": name, "ok": "ok" if ok else "FAILED", "result": result})

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out: dict[str, Any] = {"device": device, "width": width, "depth": depth, "steps": steps}
    for name, cls in (("diloco", DiLoCoStrategy), ("noloco", NoLoCoStrategy)):
        module, block = make_module(width, depth)
        strategy = cls(sync_every=4, replica_sharding=FSDPConfig(blocks=(block,), kwargs={"mp_policy": policy}),
                       outer_state_device="cpu")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        trainer, seen = fit(strategy, module, steps, "gpu" if cuda else "cpu")
        seconds = time.perf_counter() - started
        params = list(module.parameters())
        sharded = all(isinstance(p, DTensor) and p.device.type == device for p in params)
        add(f"{name}: every parameter a {device} DTensor on the (1, 1) mesh", sharded,
            f"{sum(p.numel() for p in params) / 1e6:.1f} M parameters")
        reports = strategy.outer_step_reports
        add(f"{name}: outer steps landed", len(reports) == steps // 4,
            f"{len(reports)} rounds, {statistics(reports)}; fit {seconds:.1f} s")
        add(f"{name}: shards staged to the CPU outer state, buffers reused; transport unsliced",
            all(seen["staged"]) and max(seen["allocations"]) <= 1 and seen["slices"] == 1,
            f"staging allocations {seen['allocations']} over {len(reports)} rounds; slices {seen['slices']}")
        losses = [float(v) for v in module.losses]
        add(f"{name}: loss finite and falling (bf16 compute)", all(v == v for v in losses) and losses[-1] < losses[0],
            f"{losses[0]:.4f} -> {losses[-1]:.4f}")
        if cuda:
            out[f"{name}_peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
        if name == "noloco":
            path = os.path.join(out_dir, "sharded.ckpt")
            trainer.save_checkpoint(path)
            main = torch.load(path, map_location="cpu", weights_only=True)
            plain, _ = make_module(width, depth)
            plain.load_state_dict(main["state_dict"])  # full tensors, into an unsharded module on the CPU
            same = all(torch.equal(p.cpu(), q.full_tensor().cpu()) for p, q in zip(plain.parameters(), params))
            add("checkpoint: consensus model full, loads unsharded on the CPU", same and main["optimizer_states"] == [],
                f"{len(main['state_dict'])} tensors; shards per replica {main[checkpoints.META_KEY]['shards']}")
            resumed, block = make_module(width, depth)
            again = cls(sync_every=4, replica_sharding=FSDPConfig(blocks=(block,), kwargs={"mp_policy": policy}),
                        outer_state_device="cpu")
            later, _ = fit(again, resumed, steps + 4, "gpu" if cuda else "cpu", ckpt_path=path)
            states = [s for opt in later.optimizers for s in opt.state.values()]
            on_device = all(isinstance(s["exp_avg"], DTensor) and s["exp_avg"].device.type == device for s in states)
            add("resume: sharded inner optimizer state back as DTensors", on_device and later.global_step == steps + 4,
                f"{len(states)} states on {device}; resumed at step {steps}, ended at {later.global_step}")
    out["rows"] = rows
    out["ok"] = all(r["ok"] == "ok" for r in rows)
    return out


def statistics(reports: list[Any]) -> str:
    if not reports:
        return "no round"
    seconds = sorted(r.seconds for r in reports)
    return f"outer step {seconds[len(seconds) // 2] * 1e3:.1f} ms (median)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out = check(device, tmp) if cuda else check(device, tmp, width=64, depth=2, steps=8)
        except Exception:  # a failure is a result too: the table says where
            out = {"device": device, "ok": False, "rows": [], "error": traceback.format_exc()}
    print(("" if cuda else "CPU dry run (no CUDA here): ") + "FSDP2 inside a replica, a mesh of one shard")
    if out["rows"]:
        print(table(out["rows"], [("check", "check", "s"), ("ok", "", "s"), ("result", "result", "s")]))
    if "error" in out:
        print(out["error"], file=sys.stderr)
    path = write_json("gpu_sharded.json", out, results_dir(quick=not cuda))
    print(f"wrote {path}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
