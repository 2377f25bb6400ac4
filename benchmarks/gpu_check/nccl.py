"""Part 5, the NCCL path on a world of one: NoLoCo (groups of one) and DiLoCo with ``overlap_steps``
(an asynchronous NCCL all-reduce completed through a CUDA event), the transport alone, and a new
group's warm-up. The dry run takes the same paths on gloo."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

from benchmarks.gpu_check.settings import Budget, Setting, say
from benchmarks.gpu_check.training import fit, free_memory, guarded, strategy_for, trained
from lightning_loco.testing.launch import free_port, init_gloo


def part_nccl(setting: Setting, budget: Budget) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_loco.replica.process_groups import ProcessGroups
    from lightning_loco.transport.torch_dist import TorchDistributedTransport

    on_gpu = torch.cuda.is_available()
    backend = "nccl" if on_gpu else "gloo"
    h = setting.short_sync_every
    tau = max(1, h // 3)
    out: dict[str, Any] = {"backend": backend, "sync_every": h, "runs": {}, "errors": {}}

    class Seen(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            driver = trainer.strategy.driver
            self.event_completion = driver.transport._side_stream is not None
            self.watcher_threads = sum(t.name == "lightning_loco-exchange" for t in threading.enumerate())

    for name, kwargs in (("noloco-1", {}), ("diloco-1-overlap", {"overlap_steps": tau})):
        if not budget.allows(0.3, name):
            continue
        seen = Seen()
        algorithm = name.split("-")[0]
        model = guarded(out["errors"], name, lambda algorithm=algorithm, kwargs=kwargs, seen=seen: fit(
            setting, strategy_for(algorithm, h, process_group_backend=backend, **kwargs), 3 * h, [seen]))
        if model is None:
            continue
        reports = model.trainer_strategy.outer_step_reports
        out["runs"][name] = {
            "rounds": len(reports), "overlap_steps": [r.overlap_steps for r in reports],
            "event_completion": seen.event_completion, "watcher_threads": seen.watcher_threads,
            **trained(model),
        }
        say(f"part 5: {name} on {backend}: {out['runs'][name]}")
        del model
        free_memory()

    def transport_alone() -> dict[str, Any]:
        """The transport on a world of one: an all-reduce polled with ``done()``, then waited for;
        first a new group's warm-up."""
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
            if on_gpu:
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
                dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=60), device_id=device)
            else:  # gloo: a world of one meets through a file, no port at all
                init_gloo(0, 1, file=os.path.join(tmp, "store"), timeout_s=60)
            try:
                return exchange(device)
            finally:
                dist.destroy_process_group()

    def exchange(device: Any) -> dict[str, Any]:
        groups = ProcessGroups(1, backend, timedelta(seconds=60))
        groups.warm_up_groups = True  # as on NCCL, also in the dry run
        groups._warm_up(dist.new_group([0], backend=backend))
        transport = TorchDistributedTransport(device)
        payload = torch.arange(1 << 20, dtype=torch.float32, device=device)
        expected = payload.clone()
        threads = threading.active_count()
        pending = transport.start_all_reduce_sum(payload)
        polls, deadline = 0, time.perf_counter() + 30
        while not pending.done() and time.perf_counter() < deadline:
            polls += 1
            time.sleep(0.001)
        total = pending.wait()
        return {
            "done_seen": pending.done(), "polls": polls, "bitwise_equal": bool(torch.equal(total, expected)),
            "event_completion": pending._event is not None, "new_threads": threading.active_count() - threads,
            "group_warmed_up": True,
        }

    out["transport"] = guarded(out["errors"], "transport", transport_alone)
    say(f"part 5: transport on {backend}: {out['transport']}")
    return out
