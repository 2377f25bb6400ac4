"""The GPU check's CPU dry run, and the CUDA-path pieces that a machine without CUDA can run: the
staging buffers (reused, unpinned without CUDA, bitwise the same sums), the flat parameters' staged
copies, no host reads in an inner step, and the warm-up of new process groups."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks.gpu_check import report, runner, settings, training
from lightning_loco.algorithms import DiLoCo, NoLoCo
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.replica.process_groups import ProcessGroups
from lightning_loco.testing.host_reads import HostReadCounter, rounds_seen
from lightning_loco.testing.launch import init_gloo
from lightning_loco.transport import InProcessNetwork, TorchDistributedTransport
from lightning_loco.transport.staging import StagingPool

ROOT = Path(__file__).parent.parent


def run_forked(worker: str, world: int, out_dir: Path) -> None:
    """Runs ``worker`` of this module in ``world`` gloo processes forked from a fresh Python process
    (forking this one is unsafe once it has trained: a child can inherit a lock held by a thread)."""
    code = ("import sys, test_gpu_check as t; from lightning_loco.testing.launch import free_port, start_ranks; "
            "start_ranks(getattr(t, sys.argv[1]), int(sys.argv[2]), args=(int(sys.argv[2]), free_port(), sys.argv[3]), "
            "start_method='fork', timeout_s=100)")
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", code, worker, str(world), str(out_dir)], cwd=ROOT / "tests", env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


# ---------------------------------------------------------------- the staging pool


def test_staging_pool_hands_back_the_same_buffer_for_the_same_size():
    pool = StagingPool()
    first = pool.take(1000)
    pool.give_back(first)
    again = pool.take(1000)
    assert again.data_ptr() == first.data_ptr() and pool.allocations == 1
    other = pool.take(1000)  # the first is taken: a second buffer, not the same one twice
    assert other.data_ptr() != again.data_ptr() and pool.allocations == 2
    pool.give_back(again, other)
    assert {pool.take(1000).data_ptr(), pool.take(1000).data_ptr()} == {first.data_ptr(), other.data_ptr()}
    bigger = pool.take(1001)
    assert bigger.numel() == 1001 and pool.allocations == 3
    half = pool.take(1000, torch.float16)  # the dtype is part of the key
    assert half.dtype == torch.float16 and pool.allocations == 4


def test_staging_pool_pins_only_with_cuda():
    pool = StagingPool()
    assert pool.pinned == torch.cuda.is_available()
    assert pool.take(10).is_pinned() == torch.cuda.is_available()
    unpinned = StagingPool(pin=False)
    assert not unpinned.pinned and not unpinned.take(10).is_pinned()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_without_cuda_pinning_is_skipped_not_attempted():
    with pytest.raises(RuntimeError):  # what the pool avoids: pinning needs the CUDA driver
        torch.empty(4, pin_memory=True)
    assert not StagingPool().pinned


def test_staging_round_trip_is_exact():
    pool = StagingPool()
    x = torch.randn(3, 5)
    host = pool.to_host(x)
    assert host.shape == (15,) and torch.equal(host, x.reshape(-1))
    back = pool.to_device(host, torch.device("cpu"))
    assert back.data_ptr() != host.data_ptr() and torch.equal(back, x.reshape(-1))


# ---------------------------------------------------------------- flat parameters through the staging buffer


def test_staged_gather_and_scatter_equal_the_direct_copies(monkeypatch):
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4).to(torch.bfloat16)),
              torch.nn.Parameter(torch.randn(2, 2).t())]
    direct = FlatParameters(params, "cpu")
    expected = direct.gather()
    monkeypatch.setattr(FlatParameters, "stage_cpu_params", True)
    staged = FlatParameters(params, "cpu")
    assert staged._staged()
    first = staged.gather()
    assert torch.equal(first, expected)
    first.add_(1.0)  # a gathered vector is the caller's: the next gather is not affected
    second = staged.gather()
    assert torch.equal(second, expected) and second.data_ptr() != first.data_ptr()
    assert staged.staging.allocations == 1  # one staging buffer, reused by every call
    new = torch.arange(14, dtype=torch.float32) / 7
    staged.scatter(new)
    scattered = [p.detach().clone() for p in params]
    direct.scatter(new)
    assert all(torch.equal(a, p.detach()) for a, p in zip(scattered, params))
    assert staged.staging.allocations == 1


# ---------------------------------------------------------------- no host reads between outer steps


@pytest.mark.parametrize("n,algorithm,overlap",
                         [(1, NoLoCo(), 0), (2, NoLoCo(), 2), (1, DiLoCo(), 0), (2, DiLoCo(), 2)])
def test_inner_steps_read_nothing_back_to_the_host(n, algorithm, overlap):
    """The driver's per-step hook reads no tensor value to the host (on CUDA each read would
    synchronise) except at steps where a round starts or lands. (Lock-step replicas: two of them
    only with overlap, where posting does not wait.)"""
    network = InProcessNetwork(n)
    params = [torch.nn.Parameter(torch.randn(6) + i) for i in range(n)]
    drivers = [OuterStepDriver.of(algorithm, network.transport(i), sync_every=4, overlap_steps=overlap)
               for i in range(n)]
    for driver, p in zip(drivers, params):
        driver.add(FlatParameters([p], "cpu"))
    counter = HostReadCounter()
    inner, outer = [], []
    for _ in range(12):
        for driver, p in zip(drivers, params):
            with torch.no_grad():
                p.add_(0.01)  # an inner step's update
            before = rounds_seen(driver)
            counter.count = 0
            with counter.counting():
                driver.after_inner_step(0)
            (inner if rounds_seen(driver) == before else outer).append(counter.count)
    assert len(outer) == n * (5 if overlap else 3)  # 3 rounds start; with τ = 2, 2 land before the end
    assert inner and all(n == 0 for n in inner)


def test_host_read_counter_sees_reads_inside_the_driver():
    """The counter above could fail: with ``track_norms`` (the monitor's setting) the outer step's record
    reads norms with ``item()``, and the counter sees them."""
    network = InProcessNetwork(1)
    p = torch.nn.Parameter(torch.randn(6))
    driver = OuterStepDriver.of(NoLoCo(), network.transport(0), sync_every=2)
    driver.track_norms = True
    driver.add(FlatParameters([p], "cpu"))
    counter = HostReadCounter()
    with counter.counting():
        driver.after_inner_step(0)
        assert counter.count == 0
        driver.after_inner_step(0)  # a round
    assert counter.count >= 2 and any("record.py" in w for w in counter.where)  # the round's record (driver/record.py)
    assert torch.Tensor.item is not None and "counted" not in torch.Tensor.item.__name__  # uninstalled


# ---------------------------------------------------------------- the transport's staged exchange over gloo


def _exchange_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=30)
    try:
        direct = TorchDistributedTransport(torch.device("cpu"))
        staged = TorchDistributedTransport(torch.device("cpu"))
        staged.stage_cpu_payloads = True
        group = (0, 1) if rank < 2 else (2,)  # an odd world: one replica sits the round out
        results = []
        for t in range(3):
            payload = torch.randn(1001, generator=torch.Generator().manual_seed(10 * t + rank)) / 3
            results.append({
                "direct": direct.group_sum(payload, group), "staged": staged.group_sum(payload, group),
                "direct_all": direct.all_reduce_sum(payload.clone()),
                "staged_all": staged.all_reduce_sum(payload.clone()),
                "payload": payload, "allocations": staged.staging.allocations,
            })
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_staged_exchange_is_bitwise_the_unstaged_one_and_reuses_its_buffers(tmp_path):
    world = 3
    run_forked("_exchange_worker", world, tmp_path)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for r in range(world):
        for t, round_ in enumerate(res[r]):
            assert torch.equal(round_["staged"], round_["direct"]), (r, t)
            assert torch.equal(round_["staged_all"], round_["direct_all"]), (r, t)
    assert torch.equal(res[0][0]["staged"], res[0][0]["payload"] + res[1][0]["payload"])
    assert torch.equal(res[2][0]["staged"], res[2][0]["payload"])  # alone: its own payload
    # a pair takes send, receive and sum buffers, the all-reduce one more: all in the first round
    assert [round_["allocations"] for round_ in res[0]] == [3, 3, 3]
    assert [round_["allocations"] for round_ in res[2]] == [1, 1, 1]  # alone: only the all-reduce


# ---------------------------------------------------------------- warm-up of new NCCL groups


def _groups_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=30)
    try:
        calls = []
        original = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            calls.append(tuple(dist.get_process_group_ranks(kwargs["group"])))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        try:
            quiet = ProcessGroups(2, "gloo", None)  # gloo needs no warm-up: none
            quiet.create_replica_groups()
            quiet.overlap_group()
            silent = list(calls)
            warmed = ProcessGroups(2, "gloo", None)
            warmed.warm_up_groups = True  # what backend="nccl" sets
            warmed.create_replica_groups()
            warmed.overlap_group()
        finally:
            dist.all_reduce = original
        # after the warm-up, a point-to-point exchange of two ranks that leaves the others out
        transport = TorchDistributedTransport(torch.device("cpu"), process_group=warmed.overlap)
        pair = (0, 1) if rank < 2 else (2, 3)
        total = transport.group_sum(torch.full((4,), float(rank)), pair)
        torch.save({"silent": silent, "warm": calls[len(silent):], "total": total}, os.path.join(out_dir, f"{rank}.pt"))
        warmed.destroy([])
        quiet.destroy([])
    finally:
        dist.destroy_process_group()


def test_new_groups_are_warmed_up_by_all_their_ranks_when_asked(tmp_path):
    world = 4
    assert ProcessGroups(1, "nccl", None).warm_up_groups and not ProcessGroups(1, "gloo", None).warm_up_groups
    run_forked("_groups_worker", world, tmp_path)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for r in range(world):
        assert res[r]["silent"] == []
        replica = (0, 1) if r < 2 else (2, 3)
        slice_ = (0, 2) if r % 2 == 0 else (1, 3)
        assert res[r]["warm"] == [replica, slice_, (0, 1, 2, 3)]  # its replica, its slice, the overlap group
        assert torch.equal(res[r]["total"], torch.full((4,), 1.0 if r < 2 else 5.0))


# ---------------------------------------------------------------- the script


def test_a_failing_part_is_recorded_and_the_others_still_report(monkeypatch):
    def broken(setting, budget):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(runner.RUNNERS, 3, broken)
    result = runner.run_part_here(3, settings.DRY, 5.0)
    assert result["status"] == "error" and "illegal memory access" in result["error"]
    assert "RuntimeError" in result["traceback"]
    ok = {"status": "ran", "backend": "gloo", "runs": {}, "transport": {"bitwise_equal": True,
          "event_completion": False, "new_threads": 0}}
    rows = report.rows_of({3: result, 5: ok}, on_gpu=False)
    assert rows[0]["part"] == "3" and rows[0]["status"] == "FAILED" and "illegal memory access" in rows[0]["result"]
    assert rows[-1]["part"] == "5" and rows[-1]["status"] == "ok"


def test_a_failing_run_inside_a_part_is_recorded_and_the_part_goes_on():
    errors = {}

    def oom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 1.50 GiB")

    assert training.guarded(errors, "gasloc-1", oom) is None
    assert training.guarded(errors, "diloco-1", lambda: 42) == 42
    assert list(errors) == ["gasloc-1"] and "out of memory" in errors["gasloc-1"]
    part = {"status": "ran", "configs": {"plain": {"peak_bytes": None}, "diloco-1": {"peak_bytes": None}},
            "errors": errors}
    rows = report.rows_of({3: part}, on_gpu=False)
    assert [(r["check"], r["status"]) for r in rows if r["status"] == "FAILED"] == [("gasloc-1 failed", "FAILED")]
    assert any(r["check"].startswith("diloco-1") for r in rows)


def test_only_a_budget_turns_runs_down_and_a_run_it_turned_down_is_shown(monkeypatch):
    unlimited = settings.Budget(None)  # the dry run's: none
    assert unlimited.allows(1.0, "plain") and unlimited.left() == float("inf") and unlimited.skipped == []
    spent = settings.Budget(10.0)
    spent.started -= 100.0  # started 100 s ago: nothing fits any more
    assert not spent.allows(0.1, "noloco-1") and spent.skipped == ["noloco-1"]

    def part(setting, budget):
        assert budget.allows(1.0, "plain")  # no budget given: every run may start
        budget.skipped.append("gasloc-1")  # what allows() records for a run it turns down
        return {"configs": {}, "errors": {}}

    monkeypatch.setitem(runner.RUNNERS, 3, part)
    result = runner.run_part_here(3, settings.DRY, None)
    assert result["status"] == "ran" and result["skipped"] == ["gasloc-1"]
    rows = report.rows_of({3: result}, on_gpu=True)
    assert [(r["check"], r["status"]) for r in rows] == [("gasloc-1 skipped", "SKIPPED")]


def _dry_run(tmp_path, *parts, isolate=False):
    """The CPU dry run of ``parts``: it has no time budgets (only limits that stop a hang), so every
    configuration of every part must have run; nothing skipped, missed or failed."""
    env = {**os.environ, "LOCO_BENCH_RESULTS": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    flags = ["--isolate"] if isolate else []
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *flags, "--parts", *parts], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)  # a hang guard, not a budget
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "did not run on a GPU" in proc.stdout and "no time budget" in proc.stdout
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["cuda"] is False
    assert [int(p) for p in result["parts"]] == [int(p) for p in parts]
    assert all(part["status"] == "ran" for part in result["parts"].values())
    assert all(part["skipped"] == [] and not part.get("errors") for part in result["parts"].values())
    assert not [row for row in result["rows"] if row["status"] in ("MISSED", "FAILED", "SKIPPED")]
    return result


def test_cpu_dry_run(tmp_path):
    """The dry run of every part that needs no second process, in one process: it exits 0, says it
    did not run on a GPU, every configuration ran, and its checks that apply on the CPU pass. Part 4
    runs in the slow test."""
    result = _dry_run(tmp_path, "1", "2", "3", "5")
    overhead = result["parts"]["1"]["configs"]
    assert set(overhead) == {"plain", "noloco-1", "noloco-1-cpu-state"}
    assert overhead["noloco-1"]["outer_steps_timed"] >= 1
    assert set(result["parts"]["3"]["configs"]) == {
        "plain", *(f"{a}-1{s}" for a in ("noloco", "gasloc", "diloco") for s in ("", "-cpu-state"))}
    syncs = result["parts"]["2"]["configs"]
    assert set(syncs) == {"plain", "noloco-1", "noloco-1-cpu-state", "noloco-1-overlap", "diloco-1-overlap",
                          "noloco-1+monitor"}
    for config in ("noloco-1", "noloco-1-cpu-state", "noloco-1-overlap", "diloco-1-overlap"):
        assert syncs[config]["inner_steps"] > 0 and syncs[config]["hook_host_reads_per_inner_step"] == 0
        assert syncs[config]["host_reads_per_inner_step"] == syncs["plain"]["host_reads_per_inner_step"]
        # the counted steps: 3 rounds start in them, and with overlap each lands in a step of its own
        counted = result["parts"]["2"]["steps_counted"]
        assert syncs[config]["outer_steps"] == (6 if "overlap" in config else 3)
        assert syncs[config]["inner_steps"] + syncs[config]["outer_steps"] == counted
    nccl = result["parts"]["5"]
    assert nccl["backend"] == "gloo" and nccl["transport"]["bitwise_equal"]
    assert list(nccl["runs"]) == ["noloco-1", "diloco-1-overlap"]
    assert [run["rounds"] for run in nccl["runs"].values()] == [3, 3]
    # τ = 1: the first two rounds land a step after they started, the last one at once (the end of fit)
    assert [run["overlap_steps"] for run in nccl["runs"].values()] == [[0, 0, 0], [1, 1, 0]]


def test_cpu_dry_run_of_the_sharded_part(tmp_path):
    """Part 6 (FSDP2 inside a replica, a mesh of one shard): every one of its ten checks holds on the CPU."""
    result = _dry_run(tmp_path, "6")
    rows = [row for row in result["rows"] if row["part"] == "6"]
    assert len(rows) == 10 and all(row["status"] == "ok" for row in rows), rows


def test_cpu_dry_run_of_the_codecs_part(tmp_path):
    """Part 7 (the codecs against a copy): every call of every codec was timed, and the bytes each
    codec encodes, and the floats it decodes, are the CPU codec's. No timing is judged."""
    from benchmarks import codec_speed

    result = _dry_run(tmp_path, "7")
    part = result["parts"]["7"]
    codecs = set(codec_speed.CODECS)
    expected = {"copy/float32/clone", "copy/float32/copy_", "check/float32/after", "check/float16/after",
                *(f"{op}/{c}/after" for op in ("encode", "decode", "decode_add", "check+encode") for c in codecs)}
    assert part["device"] == "cpu" and set(part["configs"]) == expected
    assert {(r["op"], r["codec"], r["variant"]) for r in part["rows"]} == {tuple(c.split("/")) for c in expected}
    assert all(r["seconds"]["min"] > 0 and r["gbps"]["median"] > 0 for r in part["rows"])
    assert part["bytes_equal_cpu"] == part["decoded_equal_cpu"] == {c: True for c in codecs}
    assert all(part["same_bytes"].values()) and set(part["same_bytes"]) == {f"{c}/after" for c in codecs}
    checks = [row for row in result["rows"] if row["part"] == "7"]
    assert sum(row["status"] == "ok" for row in checks) == len(codecs)  # the bytes; the dry run judges no speed


@pytest.mark.slow
def test_cpu_dry_run_of_part_4_in_its_own_process(tmp_path):
    """Part 4 in a process of its own, as every part runs on a GPU, with its two processes (spawned,
    staging forced on the CPU). Every configuration must run, and each is judged by counts and bitwise
    agreement, not by a loss trend (8 steps of a tiny model): both ranks took every step, started
    and landed every round where it belongs (with overlap, τ steps after it started; the round of
    the last step at once), their weights moved, and after the final average they are bitwise equal.
    The other parts' dry run is the fast test above."""
    result = _dry_run(tmp_path, "4", isolate=True)
    configs = result["parts"]["4"]["configs"]
    dry = settings.DRY
    assert set(configs) == {f"noloco-2-overlap{tau}" for tau in (0, dry.pair_overlap)} and dry.pair_overlap > 0
    for config, row in configs.items():
        assert not row["errors"], config
        assert row["steps_per_rank"] == [dry.pair_steps] * 2, config
        assert row["rounds_per_rank"] == row["rounds_started_per_rank"] == [2, 2] and row["rounds"] == 2, config
        assert row["rounds_as_expected"], config
        tau = row["overlap_steps"]
        assert row["landings"] == [{"t": 0, "inner_step": 4 + tau, "overlap_steps": tau, "final": False},
                                   {"t": 1, "inner_step": 8, "overlap_steps": 0, "final": True}], config
        assert row["weights_moved"] and row["replicas_agree"] and row["staging_reused"], config
        assert row["staging_pinned"] is False, config


# ---------------------------------------------------------------- on a machine with CUDA (the GPU check covers more)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_is_pinned_and_exact():
    pool = StagingPool()
    x = torch.randn(1000, device="cuda")
    host = pool.to_host(x)
    assert pool.pinned and host.is_pinned() and torch.equal(host, x.cpu())
    back = pool.to_device(host, x.device)
    pool.give_back(host)
    assert torch.equal(back, x) and pool.take(1000).data_ptr() == host.data_ptr()
    params = [torch.nn.Parameter(torch.randn(3, 2, device="cuda")), torch.nn.Parameter(torch.randn(4, device="cuda"))]
    flat = FlatParameters(params, "cpu")
    assert flat._staged()
    gathered = flat.gather()
    whole = torch.cat([p.detach().cpu().reshape(-1) for p in params])
    assert gathered.device.type == "cpu" and torch.equal(gathered, whole)
    flat.scatter(gathered * 2)
    torch.cuda.synchronize()
    assert torch.equal(torch.cat([p.detach().cpu().reshape(-1) for p in params]), gathered * 2)
    assert flat.staging.allocations == 1
