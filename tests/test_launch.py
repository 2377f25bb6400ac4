"""The launch helpers of ``lightning_loco.testing``: ranks of a function (a real gloo all-reduce, a rank
that raises, one that hangs, one that crashes, ranks forked beside the parent's uncollected gloo group, threads
starting together in a fresh fork), a
strategy's class by its name, and a Lighthouse on a free port."""

import gc
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning.fabric.plugins.environments.lightning as lightning_environment
import pytest
import torch
import torch.distributed as dist

from lightning_loco import DiLoCoStrategy, GASLoCStrategy, NoLoCoStrategy
from lightning_loco.testing.launch import (
    RanksFailed,
    free_port,
    init_gloo,
    start_ranks,
    strategy_class,
)
from lightning_loco.testing.ports import _ephemeral_range


def _all_reduce(rank: int, store: str, out: str) -> None:
    init_gloo(rank, 2, file=store, timeout_s=30)
    try:
        total = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
        dist.all_reduce(total)
        torch.save(total, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_free_port_is_drawn_below_the_ephemeral_range_and_binds() -> None:
    """The ports a test listens on come from below the range outgoing connections take their local ports
    from, so no connection of a parallel test can hold one between the draw and the bind (the EADDRINUSE of
    a rendezvous). Lightning's own choice in this worker draws the same way (``conftest.py``)."""
    import socket

    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= port < low for port in ports), ports
    assert len(ports) > 1  # drawn at random, not one fixed port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert lightning_environment.find_free_network_port is free_port


def test_two_ranks_all_reduce_over_a_file_store(tmp_path: Path) -> None:
    start_ranks(_all_reduce, 2, args=(str(tmp_path / "store"), str(tmp_path)), start_method="fork", timeout_s=120)
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"{rank}.pt"), torch.tensor([3.0, 30.0]))


def _wait_forever() -> None:
    while True:
        time.sleep(1)


def _one_raises(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gave up on purpose")
    _wait_forever()  # a peer left waiting: start_ranks must stop it


def _one_hangs(rank: int) -> None:
    if rank == 1:
        _wait_forever()


def _gone(pid: int) -> bool:
    """Whether no process has this id (start_ranks reaps what it stops: not even a zombie is left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_rank_that_raises_is_named_and_its_peers_are_stopped() -> None:
    with pytest.raises(RanksFailed) as err:
        start_ranks(_one_raises, 2, start_method="fork", timeout_s=300)
    message = str(err.value)
    assert "rank 1 exited with code 1" in message and "ValueError: rank 1 gave up on purpose" in message
    assert "ranks [0] were still running and were stopped" in message
    assert list(err.value.failed) == [1]
    assert _gone(err.value.pids[0]) and _gone(err.value.pids[1])


def test_a_rank_that_hangs_is_stopped_at_the_bound_and_named() -> None:
    with pytest.raises(RanksFailed) as err:
        start_ranks(_one_hangs, 2, start_method="fork", timeout_s=5)
    assert list(err.value.failed) == [1]
    assert "rank 1 did not finish within 5 s and was stopped; its threads were at:" in str(err.value)
    assert "in _wait_forever" in str(err.value)  # where it hung: its stack, dumped before it was stopped
    assert "rank 0" not in str(err.value)  # it returned
    assert _gone(err.value.pids[1])


def _aborts(rank: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as a native crash: no traceback comes back, the pipe just closes


def test_a_rank_killed_by_a_signal_is_named_with_it() -> None:
    with pytest.raises(RanksFailed) as err:
        start_ranks(_aborts, 2, start_method="fork", timeout_s=60)
    assert list(err.value.failed) == [1]
    assert err.value.failed[1] == "exited with code -9"  # SIGKILL, and no report to read


def _collect_and_sum(rank: int, store: str, out: str) -> None:
    gc.collect()  # a full collection, as any child's allocations bring one sooner or later
    _all_reduce(rank, store, out)


def test_ranks_forked_from_a_process_with_an_uncollected_gloo_group_do_not_run_its_destructor(tmp_path: Path) -> None:
    """The parent holds a gloo process group that nothing references but a reference cycle (garbage the
    collector has not reached yet). A forked child that collected it ran its destructor, which joins worker
    threads the child does not have: it hung forever (or aborted with std::system_error). Children freeze what
    they inherit (lightning_loco.testing.fork_safety), so the ranks collect, sum and return."""
    cycle: dict = {}
    cycle["self"] = cycle
    store = dist.FileStore(str(tmp_path / "parent_store"), 1)
    cycle["group"] = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
    cycle["group"].allreduce([torch.ones(2)]).wait()  # its threads have run
    del cycle, store
    gc.disable()  # the cycle stays uncollected in this process until the ranks are forked
    try:
        start_ranks(_collect_and_sum, 2, args=(str(tmp_path / "store"), str(tmp_path)), start_method="fork",
                    timeout_s=120)
    finally:
        gc.enable()
        gc.collect()  # here, where its threads are, the destructor joins them
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"{rank}.pt"), torch.tensor([3.0, 30.0]))


def _threads_at_once_after_a_fork(threads: int) -> bool:
    """In a forked child: ``threads`` threads start together, each with a parallel op; whether all ran it."""
    errors: list = []

    def op() -> None:
        try:
            torch.randn(100_000).sum()
        except RuntimeError as err:  # "Invalid thread pool!"
            errors.append(err)

    started = [threading.Thread(target=op) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    return not errors


@pytest.mark.slow
def test_threads_starting_together_in_a_fresh_fork_find_torchs_thread_pool() -> None:
    """torch replaces the thread pool a forked child inherited at the next set_num_threads, unlocked, and each new
    thread makes that call on its first parallel op: two starting together could both replace it and one found
    none. Without the after-fork renewal (lightning_loco.testing.fork_safety) 4 of 1000 such children failed here,
    2 of 200; with it none of 1000. 200 children: a return of the race fails this test a third to a half of the time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as a forked run's child sets it (fork_call): the threads' first op sets it again
    try:
        torch.randn(100_000).sum()  # the pool exists in this process
        failed = 0
        for _ in range(200):
            pid = os.fork()
            if pid == 0:
                os._exit(0 if _threads_at_once_after_a_fork(8) else 1)
            _, status = os.waitpid(pid, 0)
            failed += os.waitstatus_to_exitcode(status) != 0
    finally:
        torch.set_num_threads(previous)
    assert failed == 0, f"{failed} of 200 children found no thread pool"


def test_bad_arguments_to_start_ranks() -> None:
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        start_ranks(_one_hangs, 0)
    with pytest.raises(ValueError, match="start_method='thread' is not available here"):
        start_ranks(_one_hangs, 2, start_method="thread")


def test_strategy_class_reads_lightnings_registry() -> None:
    assert strategy_class("noloco") is NoLoCoStrategy
    assert strategy_class("gasloc") is GASLoCStrategy
    assert strategy_class("diloco") is DiLoCoStrategy
    with pytest.raises(ValueError, match=r"No strategy is registered as 'nolocoo'; registered: .*'noloco'"):
        strategy_class("nolocoo")


@pytest.mark.slow
def test_a_lighthouse_on_a_free_port_serves_until_closed() -> None:
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    from torchft.coordination import LighthouseClient

    from lightning_loco.testing.elastic import Lighthouse

    with Lighthouse(min_replicas=2) as lighthouse:
        host, port = lighthouse.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        LighthouseClient(f"http://{lighthouse.address}", connect_timeout=timedelta(seconds=10)).heartbeat("probe")
    assert lighthouse.proc.returncode == 0  # it answered SIGTERM by shutting down
    with pytest.raises(RuntimeError, match=r"(?s)ended \(exit code 2\).*min_replicas must be an integer >= 1, got 0"):
        Lighthouse(min_replicas=0)


def _threads_in_a_forked_child() -> None:
    torch.set_num_threads(4)  # as the GPU quality run asks: a forked child must not start OpenMP threads
    x = torch.arange(1_000_000).long() * 2  # a parallel op, which hung in a forked child with more threads
    print(torch.get_num_threads(), int(x[-1]))


def test_a_forked_child_stays_on_one_thread_whatever_it_asks_for(tmp_path: Path) -> None:
    from lightning_loco.testing.launch import finish_forked, fork_call

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.arange(1_000_000).float().sum()  # this process's OpenMP threads exist now
        streams = {1: tmp_path / "out.txt", 2: tmp_path / "err.txt"}
        proc = finish_forked(fork_call(_threads_in_a_forked_child, streams, {}), streams, 60, ["child"])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["1", "1999998"]
        assert torch.get_num_threads() == 2  # the parent's own setting is its own
    finally:
        torch.set_num_threads(before)


_PROBE = """
import sys
print("torchft imported:", "torchft" in sys.modules)
"""

_AFTER_A_LIGHTHOUSE = """
import os, sys, time
from pathlib import Path
from lightning_loco.testing.fork_safety import fork_hazards
from lightning_loco.testing.launch import run_module_forked
import benchmarks.common as common
import torchft.coordination

os.environ[common.FORK_ENV] = "1"
assert fork_hazards() == [] and common.forking(), fork_hazards()  # torchft imported, its runtime not started
before = run_module_forked("fork_probe", [], Path(sys.argv[1]) / "before", {}, 120, Path(sys.argv[1]))
server = torchft.coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
# a new thread takes its name when it first runs: on a loaded machine the server's threads can still be unnamed
deadline = time.monotonic() + 60
while not (hazards := fork_hazards()) and time.monotonic() < deadline:
    time.sleep(0.01)
after = run_module_forked("fork_probe", [], Path(sys.argv[1]) / "after", {}, 120, Path(sys.argv[1]))
server.shutdown()
print(before.returncode, before.stdout.strip(), "|", after.returncode, after.stdout.strip(), "|",
      bool(hazards), all(h.startswith("torchft") for h in hazards), common.forking())
"""


def test_a_process_running_torchfts_threads_starts_a_new_interpreter_instead_of_forking(tmp_path: Path) -> None:
    # A forked child of a process that had served a Lighthouse segfaulted when its own torchft Manager started
    # (B7's smoke run after the elastic group tests in one pytest worker). The check runs in a process of its own
    # so that this one stays safe to fork.
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    import subprocess
    import sys

    (tmp_path / "fork_probe.py").write_text(_PROBE)
    root = Path(__file__).parent.parent
    proc = subprocess.run([sys.executable, "-c", _AFTER_A_LIGHTHOUSE, str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # forked before (torchft already imported in the child), a new interpreter after (nothing imported)
    report = [line for line in proc.stdout.splitlines() if " | " in line]
    assert report == ["0 torchft imported: True | 0 torchft imported: False | True True False"], proc.stdout[-3000:]
