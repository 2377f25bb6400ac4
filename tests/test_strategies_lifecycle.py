"""A real cluster job's life: signals, repeated trainer calls, teardown, checkpoints seen differently
by different ranks, and the private Lightning symbols we depend on.

Multi-process runs are ``tests/tiny.py`` under Lightning's popen launcher, the launcher of torchrun,
SLURM and plain scripts. Signal tests send real signals to real processes and give the process
group a 30-minute timeout, so a hang fails the test through the subprocess's own limit.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_loco import NoLoCoStrategy, _compat
from lightning_loco.testing.launch import free_port
from lightning_loco.transport import PendingSum

import tiny

HANG_LIMIT_S = 150  # far below the process group's 30 minutes: a rank stuck on a dead peer fails the test


def errors(out: Path, world: int) -> dict[int, dict]:
    found = {}
    for r in range(world):
        path = out / f"error{r}.json"
        if path.exists():
            found[r] = json.loads(path.read_text())
    return found


def start_long_run(tmp_path: Path, devices: int, **extra) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out"
    config = {
        "strategy": "noloco", "strategy_kwargs": {"sync_every": 2}, "devices": devices, "max_steps": 100_000,
        "pg_timeout_s": 1800, "ready_at_step": 4, "step_sleep_s": 0.01, **extra,
    }
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen(
        [sys.executable, tiny.__file__, str(out), json.dumps(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    return proc, out


def wait_ready(proc: subprocess.Popen, out: Path, devices: int) -> list[int]:
    deadline = time.monotonic() + HANG_LIMIT_S
    while time.monotonic() < deadline:
        files = [out / f"ready{r}" for r in range(devices)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        if proc.poll() is not None:
            pytest.fail(f"the run ended before training started:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail("the ranks never reached the step at which the signal is sent")


def finish(proc: subprocess.Popen, pids: list[int]) -> str:
    try:
        output, _ = proc.communicate(timeout=HANG_LIMIT_S)
    except subprocess.TimeoutExpired:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        output, _ = proc.communicate()
        pytest.fail(f"a rank hung after the signal:\n{output[-4000:]}")
    deadline = time.monotonic() + HANG_LIMIT_S
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in pids), "a rank outlived the run"
    return output


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_it_and_its_peer_names_it(tmp_path):
    proc, out = start_long_run(tmp_path, devices=2)
    pids = wait_ready(proc, out, 2)
    os.kill(pids[1], signal.SIGTERM)  # a preempted node: only rank 1 is told
    output = finish(proc, pids)
    assert proc.returncode != 0
    seen = errors(out, 2)
    assert seen[1]["type"] == "SIGTERMException", output[-3000:]
    assert seen[0]["type"] == "PeerError", output[-3000:]
    assert "replica(s) [1]" in seen[0]["message"] and "global rank(s) [1]" in seen[0]["message"]


@pytest.mark.slow
def test_sigterm_to_rank_zero_stops_every_rank_and_leaves_whole_checkpoints(tmp_path):
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "every_n_train_steps": 3, "save_top_k": 2, "monitor": "step",
                  "mode": "max", "filename": "{step}"}
    proc, out = start_long_run(tmp_path, devices=3, checkpoint=checkpoint)
    pids = wait_ready(proc, out, 3)
    os.kill(pids[0], signal.SIGTERM)  # the launcher: Lightning forwards the signal to the other ranks
    output = finish(proc, pids)
    seen = errors(out, 3)  # (Lightning's SIGTERMException is a SystemExit with no code: exit status 0)
    assert set(seen) == {0, 1, 2}
    # Every rank stops at its next batch; a rank still inside an exchange when its peer stopped (rank 0
    # too, if it was waiting on a forwarded rank) stops with a PeerError naming that peer instead.
    assert all(e["type"] in ("SIGTERMException", "PeerError") for e in seen.values()), seen
    assert any(e["type"] == "SIGTERMException" for e in seen.values()), output[-3000:]
    # every checkpoint there is whole: it loads and all its replica files are there
    from lightning_loco.replica.checkpoints import META_KEY, check_replica_files

    files = glob.glob(str(ckpts / "*.ckpt"))
    assert files
    for path in files:
        meta = torch.load(path, weights_only=False)[META_KEY]
        check_replica_files(path, meta)


@pytest.mark.slow
def test_validate_with_a_checkpoint_then_fit_starts_fresh_outer_state(tmp_path):
    h = 2
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": 5, "save_top_k": -1}
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": h, "average_at_end": False}, "devices": 2}
    tiny.launch(tmp_path / "first", checkpoint=checkpoint, max_steps=5, **common)
    recs = tiny.launch(tmp_path / "second", validate_ckpt_path=str(ckpts / "step=5.ckpt"), max_steps=4, **common)
    validated = [torch.load(tmp_path / "second" / "out" / f"validated{r}.pt") for r in range(2)]
    assert not torch.equal(validated[0], validated[1])  # validate loaded each replica's own weights
    for rec in recs:
        # the outer state starts fresh: rounds 0 and 1 after steps 2 and 4, not rounds 2 and 3 after 6 and 8
        assert [(r["outer_step"], r["inner_step"]) for r in rec["reports"]] == [(0, h), (1, 2 * h)]
        # from the module's current weights, rank 0's
        assert torch.equal(rec["starts"][0], validated[0])


def test_fit_frees_the_outer_state_and_keeps_the_reports(tmp_path):
    kwargs = {"sync_every": 3, "overlap_steps": 2}  # the round started at step 6 is in flight at step 7
    tiny.launch(tmp_path, strategy="diloco", strategy_kwargs=kwargs, devices=2, max_steps=7, track_release=True)
    for r in range(2):
        end = torch.load(tmp_path / "out" / f"after_fit{r}.pt")
        assert end["outer_state_tracked"] >= 12  # replica, state, flat, anchor, gradient, momentum, flight...
        assert end["outer_state_alive"] == []
        assert end["slots_left"] == 0
        assert [x["outer_step"] for x in end["reports"]] == [0, 1] and end["outer_steps"] == 2


@pytest.mark.slow
def test_a_replica_file_missing_on_one_rank_only_fails_every_rank_alike(tmp_path):
    ckpts = tmp_path / "ckpts"
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": 2}, "devices": 2}
    tiny.launch(tmp_path / "first", max_steps=4, save_to=str(ckpts / "run.ckpt"), **common)
    proc = tiny.launch(tmp_path / "second", expect_failure=True, max_steps=6, ckpt_path=str(ckpts / "run.ckpt"),
                       hide_replica_files_on_rank=1, **common)
    seen = errors(tmp_path / "second" / "out", 2)
    assert set(seen) == {0, 1}, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert seen[0]["type"] == seen[1]["type"] == "CheckpointError"
    assert seen[0]["message"] == seen[1]["message"] and "replica file(s) missing" in seen[0]["message"]


@pytest.mark.slow
def test_peer_distance_is_half_the_distance_between_the_pair(tmp_path):
    for algorithm in ("noloco", "diloco"):
        recs = tiny.launch(tmp_path / algorithm, strategy=algorithm, strategy_kwargs={"sync_every": 3}, devices=2,
                           max_steps=6, monitor={})
        for rec in recs:
            snaps = [other["snapshots"] for other in recs]
            distances = [r["peer_distance"] for r in rec["reports"]]
            expected = [torch.linalg.vector_norm(a - b).item() / 2 for a, b in zip(*snaps)]
            assert len(distances) == 2
            assert distances == pytest.approx(expected, rel=1e-4), algorithm


@pytest.mark.slow
def test_warnings_for_a_single_replica_and_for_no_outer_step(tmp_path):
    with pytest.warns(UserWarning, match="single replica"):
        L.Trainer(strategy=NoLoCoStrategy(), accelerator="cpu", devices=1, logger=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        L.Trainer(strategy=NoLoCoStrategy(), accelerator="cpu", devices=2, logger=False)
    recs = tiny.launch(tmp_path, strategy="diloco", strategy_kwargs={}, devices=2, max_steps=6)  # H = 500
    assert "No outer step will happen in this fit" in recs[0]["stderr"]
    assert "sync_every=500" in recs[0]["stderr"]


class _BlockedWork:
    """A posted operation that never completes until released (a peer that never answers)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def wait(self, timeout=None) -> bool:
        self.release.wait()
        return True

    def is_completed(self) -> bool:
        return self.release.is_set()


class _CpuTransport:
    device = torch.device("cpu")


def test_a_group_still_awaited_by_an_abandoned_round_is_never_destroyed(monkeypatch):
    from lightning_loco.algorithms import NoLoCo
    from lightning_loco.driver.driver import OuterStepDriver
    from lightning_loco.driver.flat import FlatParameters
    from lightning_loco.driver.overlap import InFlight
    from lightning_loco.replica.process_groups import ProcessGroups
    from lightning_loco.transport import InProcessNetwork

    driver = OuterStepDriver.of(NoLoCo(), InProcessNetwork(2).transport(0), sync_every=4, overlap_steps=2)
    slot = driver.add(FlatParameters([torch.zeros(3)], torch.device("cpu")))
    work = _BlockedWork()
    pending = PendingSum(_CpuTransport(), [work], lambda: torch.zeros(1), 4, (1,)).watch()
    slot.in_flight = InFlight(outer_step=0, start_step=4, land_step=6, group=(0, 1), pending=pending,
                              reference=torch.zeros(3), merge="predict_correct")
    groups = ProcessGroups(2, "gloo", None)
    group, other = object(), object()
    groups.overlap, groups.replica = group, other
    destroyed = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda g=None: destroyed.append((g, pending.watcher.is_alive())))
    with pytest.warns(UserWarning, match="was in flight"):
        lingering = driver.abandon_all(timeout=0.05)
    assert lingering == [pending.watcher] and slot.in_flight is None
    groups.destroy(lingering)
    assert destroyed == [(other, True)]  # the replica group goes; the overlap group is left to the exit
    assert groups.overlap is None
    work.release.set()
    pending.watcher.join(5)
    assert not pending.watcher.is_alive()


def test_the_private_lightning_symbols_we_use_are_all_there():
    assert _compat.missing_symbols() == []
    _compat.check_lightning()


def test_a_lightning_without_one_of_them_fails_naming_it(monkeypatch):
    from lightning.pytorch.overrides import distributed

    monkeypatch.delattr(distributed, "_sync_module_states")
    with pytest.raises(_compat.LightningCompatibilityError, match="_sync_module_states") as err:
        _compat.check_lightning()
    assert "pip install" in str(err.value)


@pytest.mark.parametrize("module, name", [
    ("lightning.fabric.strategies.model_parallel", "_FSDPNoSync"),
    ("lightning.fabric.strategies.strategy", "_validate_keys_for_strict_loading"),
    ("lightning.fabric.utilities.types", "_Stateful"),
])
def test_a_lightning_without_one_of_fabrics_fails_naming_it(monkeypatch, module, name):
    """Fabric's private names are checked with the Trainer's, at import, not met mid-run."""
    import importlib

    monkeypatch.delattr(importlib.import_module(module), name)
    with pytest.raises(_compat.LightningCompatibilityError, match=name):
        _compat.check_lightning()


def test_a_fabric_strategy_without_its_backward_sync_control_fails_naming_it(monkeypatch):
    from lightning.fabric.strategies import DDPStrategy

    init = DDPStrategy.__init__

    def without(self, *args, **kwargs):
        init(self, *args, **kwargs)
        del self._backward_sync_control

    monkeypatch.setattr(DDPStrategy, "__init__", without)
    with pytest.raises(_compat.LightningCompatibilityError, match="_backward_sync_control"):
        _compat.check_lightning()
