"""Part 4, two processes on one GPU over gloo, with and without ``overlap_steps``: outer-step time,
the pinned staging buffers (allocated once, reused), every round started and landed on both ranks,
and the replicas' weights bitwise equal after the final average (and, on a GPU, their losses fell).

NCCL refuses two ranks on one device, so the two replicas meet over gloo; in the dry run they share
the CPU and the staging path is forced on (``TorchDistributedTransport.stage_cpu_payloads``)."""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.common import spread
from benchmarks.gpu_check.settings import DRY_RUN_HANG_S, Budget, Setting, say
from benchmarks.gpu_check.training import cuda_sync, make_model, step_loader, trained, weights_digest
from lightning_loco.testing.launch import init_gloo


def _replica_worker(rank: int, store: str, setting: Setting, overlap: int, out: str, stage_cpu: bool) -> None:
    """One of two replicas sharing the GPU (or the CPU in the dry run) over gloo. They meet through
    the file ``store`` (no port); the strategy takes the process group made here."""
    import lightning as L
    import torch

    from lightning_loco.transport.torch_dist import TorchDistributedTransport

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
    if stage_cpu:
        TorchDistributedTransport.stage_cpu_payloads = True  # the staging path, without CUDA
    result: dict[str, Any] = {"rank": rank}
    try:
        init_gloo(rank, 2, file=store, timeout_s=60)

        class Record(L.Callback):
            def on_train_start(self, trainer: Any, module: Any) -> None:
                result["weights_at_start"] = weights_digest(module)

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                driver = trainer.strategy.driver
                if driver is not None and driver.reports and "allocations_after_first_round" not in result:
                    transport = driver.transport
                    result["allocations_after_first_round"] = transport.staging.allocations
                if driver is not None:
                    result["staging_allocations"] = driver.transport.staging.allocations
                    result["staging_pinned"] = driver.transport.staging.pinned

        h = setting.pair_sync_every
        strategy = harness.strategy(
            "noloco", sync_every=h, overlap_steps=overlap, process_group_backend="gloo",
            cluster_environment=harness.cluster_environment(rank, 2), timeout=timedelta(seconds=60),
        )
        steps = setting.pair_steps
        model = make_model(setting, steps)
        trainer = harness.quiet_trainer(
            strategy=strategy, accelerator=setting.accelerator, devices=1, num_nodes=2, precision=setting.precision,
            max_steps=steps, callbacks=[Record()],
        )
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, train_dataloaders=step_loader(steps))
        cuda_sync()
        result["fit_seconds"] = time.perf_counter() - started
        reports = strategy.outer_step_reports
        result["steps"] = trainer.global_step
        result["rounds"] = len(reports)
        result["rounds_started"] = len(strategy.rounds_started)
        result["landings"] = [{"t": r.outer_step, "inner_step": r.inner_step, "overlap_steps": r.overlap_steps,
                               "final": r.final} for r in reports]
        result["outer_step_s"] = [r.seconds for r in reports]
        result["comm_s"] = [r.comm_seconds for r in reports]
        result["exchange_s"] = [r.exchange_seconds for r in reports]
        result["device"] = str(next(model.parameters()).device)
        result.update(trained(model))
        result["weights_at_end"] = weights_digest(model)  # after the strategy's final average
    except Exception as err:  # noqa: BLE001 (recorded for the parent, which reports it)
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-3000:]
    Path(out).write_text(json.dumps(result))


def expected_landings(steps: int, sync_every: int, overlap: int) -> list[dict[str, Any]]:
    """The rounds every rank must have landed: one started every ``sync_every`` steps; with
    ``overlap`` > 0 each lands ``overlap`` steps after it started, except the one started at the
    last step, which lands at once as the end of training."""
    rounds = []
    for t in range(steps // sync_every):
        start = (t + 1) * sync_every
        last = start == steps
        tau = 0 if last else overlap
        rounds.append({"t": t, "inner_step": start + tau, "overlap_steps": tau, "final": last})
    return rounds


def part_two_processes(setting: Setting, budget: Budget) -> dict[str, Any]:
    import torch

    on_gpu = torch.cuda.is_available()
    h, steps = setting.pair_sync_every, setting.pair_steps
    out: dict[str, Any] = {"sync_every": h, "steps": steps, "configs": {}}
    for overlap in (0, setting.pair_overlap):
        if not budget.allows(0.3, f"overlap_steps={overlap}"):
            continue
        if budget.limited:
            remaining = budget.left() if overlap else budget.left() * 0.55  # leave the second its share
            limit, what = max(remaining, 10.0), "the part's budget"
        else:  # the dry run: no budget, only a limit that stops a hang
            limit, what = DRY_RUN_HANG_S, f"the dry run's hang limit of {DRY_RUN_HANG_S:.0f} s (a hang)"
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            files = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
            hung = harness.run_ranks(_replica_worker, [(r, store, setting, overlap, files[r], not on_gpu)
                                                       for r in range(2)], limit)
            ranks = [json.loads(Path(f).read_text()) if os.path.exists(f) else {"error": "no result"} for f in files]
        errors = [r.get("error") for r in ranks if r.get("error")]
        if hung:
            errors.append(f"{hung} worker(s) still running after {what}; killed")
        config = f"noloco-2-overlap{overlap}"
        row: dict[str, Any] = {"overlap_steps": overlap, "errors": errors}
        if not errors:
            expected = expected_landings(steps, h, overlap)
            row.update(
                rounds=ranks[0]["rounds"],
                rounds_per_rank=[r["rounds"] for r in ranks],
                rounds_started_per_rank=[r["rounds_started"] for r in ranks],
                steps_per_rank=[r["steps"] for r in ranks],
                rounds_expected=len(expected),
                landings=ranks[0]["landings"],
                # every rank took every step, started every round, and landed each where it should
                rounds_as_expected=all(r["steps"] == steps and r["rounds_started"] == len(expected)
                                       and r["landings"] == expected for r in ranks),
                outer_step_s=spread([s for r in ranks for s in r["outer_step_s"]]),
                comm_s=spread([s for r in ranks for s in r["comm_s"]]),
                fit_s=max(r["fit_seconds"] for r in ranks),
                loss_first=[r["loss_first"] for r in ranks], loss_last=[r["loss_last"] for r in ranks],
                trained=all(r["loss_last"] < r["loss_first"] for r in ranks),
                weights_moved=all(r["weights_at_end"] != r["weights_at_start"] for r in ranks),
                replicas_agree=ranks[0]["weights_at_end"] == ranks[1]["weights_at_end"],  # bitwise
                staging_pinned=ranks[0].get("staging_pinned"),
                staging_allocations=[r.get("staging_allocations") for r in ranks],
                staging_reused=all(r.get("staging_allocations") == r.get("allocations_after_first_round")
                                   for r in ranks),
                device=ranks[0]["device"],
            )
        out["configs"][config] = row
        say(f"part 4: {config}: " + (f"errors {errors}" if errors else f"{row['rounds']} rounds, outer step "
                                                                       f"{row['outer_step_s']['median'] * 1e3:.1f} ms"))
    return out
