"""N ranks of a function in processes of their own, waited for with a bound: :func:`start_ranks` (re-exported by
:mod:`lightning_loco.testing.launch`). A rank that raises, dies or hangs stops them all and is named in
:class:`RanksFailed`, with its traceback, or for a rank that hung, where each of its threads was (``faulthandler``
dumps them on ``SIGUSR1`` before the rank is stopped)."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_loco.testing.fork_safety import fork_is_safe

__all__ = ["RanksFailed", "start_ranks"]

_TRACEBACK_CHARS = 8000  # of a failed rank's traceback, its end: well under a pipe's buffer


class RanksFailed(RuntimeError):
    """Raised by :func:`start_ranks` when a rank failed or did not finish in time. ``failed`` maps each
    rank that failed or hung to what happened to it, ``pids`` every rank to its process id; every rank
    has been stopped and reaped by then."""

    def __init__(self, message: str, failed: dict[int, str], pids: dict[int, int]) -> None:
        super().__init__(message)
        self.failed, self.pids = failed, pids


def _run_rank(fn: Callable[..., Any], rank: int, args: Sequence[Any], report: Any, stacks: str) -> None:
    """A rank's process: ``fn(rank, *args)``; an exception's traceback goes back to the parent through
    ``report``, cut to its end so that it fits the pipe's buffer and the child never waits on the parent.
    ``SIGUSR1`` writes every thread's stack to the file ``stacks`` (what :func:`start_ranks` shows of a rank
    that hung)."""
    with open(stacks, "w") as dump:
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
        try:
            fn(rank, *args)
        except Exception:
            report.send(traceback.format_exc()[-_TRACEBACK_CHARS:])
            report.close()
            sys.exit(1)


def start_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    start_method: Optional[str] = None,
    timeout_s: float = 300.0,
) -> None:
    """Runs ``fn(rank, *args)`` in ``world_size`` processes, one per rank, and waits for all of them.

    ``start_method``: ``"fork"`` (fast: nothing is imported again; ``fn`` may be any function),
    ``"spawn"`` or ``"forkserver"`` (``fn`` and ``args`` must pickle: a module-level function); by
    default fork where :func:`fork_is_safe`, spawn otherwise. The ranks rendezvous themselves, e.g.
    with :func:`init_gloo`.

    Returns when every rank has returned. When a rank raises or exits with a non-zero code, the others
    are stopped at once; when ``timeout_s`` passes first, the ranks still running are stopped. Either
    way :class:`RanksFailed` names the ranks (with a failed rank's traceback, and where each thread of a rank
    that hung was: its stacks, dumped by ``faulthandler`` before it was stopped), after every process is
    gone. Processes that a rank started itself are its own to stop."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if start_method is None:
        start_method = "fork" if fork_is_safe() else "spawn"
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start_method={start_method!r} is not available here; choose one of "
                         f"{multiprocessing.get_all_start_methods()}")
    if start_method == "fork" and not fork_is_safe():
        raise ValueError("start_method='fork' is unsafe in this process (CUDA or a default process group is "
                         "initialised here): pass start_method='spawn', or leave it out to choose")
    context = multiprocessing.get_context(start_method)
    procs, reports, stopped = [], [], []
    stacks = Path(tempfile.mkdtemp(prefix="ranks-"))
    try:
        for rank in range(world_size):
            receive, send = context.Pipe(duplex=False)
            proc = context.Process(  # type: ignore[attr-defined]  # every concrete context has Process
                target=_run_rank, args=(fn, rank, tuple(args), send, str(stacks / f"{rank}.txt")),
                name=f"rank {rank}")
            proc.start()
            send.close()  # the child holds the sending end now
            procs.append(proc)
            reports.append(receive)
        failed = _join(procs, reports, timeout_s, stacks)
    finally:
        stopped = [rank for rank, proc in enumerate(procs) if _stop(proc)]
        for receive in reports:
            receive.close()
        shutil.rmtree(stacks, ignore_errors=True)
    if failed:
        lines = "".join(f"\nrank {rank} {what}" for rank, what in sorted(failed.items()))
        others = sorted(set(stopped) - set(failed))
        also = f"\n(ranks {others} were still running and were stopped)" if others else ""
        raise RanksFailed(f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks:{lines}{also}", failed,
                          {rank: proc.pid for rank, proc in enumerate(procs)})


def _join(procs: list[Any], reports: list[Any], timeout_s: float, stacks: Path) -> dict[int, str]:
    """Waits until every rank has exited, one has failed, or ``timeout_s`` has passed; returns what
    happened to each rank that failed, or to each one still running at the deadline (with its threads'
    stacks, from the files in ``stacks``)."""
    deadline = time.monotonic() + timeout_s
    running = dict(enumerate(procs))
    failed: dict[int, str] = {}
    while running and not failed:
        left = deadline - time.monotonic()
        if left <= 0:
            dumps = _dump_stacks(running, stacks)
            return {rank: f"did not finish within {timeout_s:g} s and was stopped; its threads were at:\n{dumps[rank]}"
                    for rank in running}
        ready = multiprocessing.connection.wait([p.sentinel for p in running.values()], timeout=left)
        for rank, proc in list(running.items()):
            if proc.sentinel in ready:
                proc.join()
                del running[rank]
                if proc.exitcode != 0:
                    error = _report(reports[rank])
                    failed[rank] = f"exited with code {proc.exitcode}" + (f":\n{error}" if error else "")
    return failed


def _report(receive: Any) -> str:
    """What a failed rank sent back (its traceback), or nothing where it died before sending (a native abort
    closes the pipe: ``poll`` is then true and ``recv`` finds no message)."""
    try:
        return receive.recv() if receive.poll() else ""
    except EOFError:
        return ""


def _dump_stacks(running: dict[int, Any], stacks: Path, settle_s: float = 5.0) -> dict[int, str]:
    """Asks each running rank for its threads' stacks (``SIGUSR1``, see :func:`_run_rank`) and returns what each
    wrote within ``settle_s`` seconds (its end), or a line saying that nothing came."""
    for proc in running.values():
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    paths = {rank: stacks / f"{rank}.txt" for rank in running}
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and not all(p.exists() and p.stat().st_size for p in paths.values()):
        time.sleep(0.05)
    time.sleep(0.1)  # a dump is written thread by thread: let the last ones end
    texts = {rank: p.read_text(errors="replace") if p.exists() else "" for rank, p in paths.items()}
    return {rank: text[-_TRACEBACK_CHARS:] or "(no stacks came: the process did not answer SIGUSR1)"
            for rank, text in texts.items()}


def _stop(proc: Any) -> bool:
    """Ends a rank's process if it still runs (SIGTERM, then SIGKILL) and reaps it; whether it ran."""
    running = proc.is_alive()
    if running:
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
    proc.join()
    return running
