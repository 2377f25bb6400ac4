"""One way to start ranks and replicas for tests, benchmarks and examples.

* :func:`free_port` (from :mod:`lightning_loco.testing.ports`): a free port drawn at random below the
  kernel's ephemeral range, never a fixed one;
* :func:`init_gloo`: joins a gloo process group, through a ``FileStore`` file (no port at all) or a
  TCP port on localhost, with a short timeout so that a hang fails fast; :func:`init_gloo_from_env`
  joins the one that torchrun's variables describe;
* :func:`start_ranks` (from :mod:`lightning_loco.testing.ranks`): runs a function in N rank processes (fork
  where safe, spawn otherwise) and waits for them with a bound; a rank that fails or hangs stops them all and
  is named in the error, a hung one with its threads' stacks;
* :func:`strategy_class`: a strategy's class by its ``Trainer(strategy=...)`` name, from Lightning's
  own registry (where ``import lightning_loco`` registers ours), not from a map of our own;
* :func:`fork_call`, :func:`fork_ranks`, :func:`run_module_forked`: a script's run, or a run's ranks as
  torchrun would start them, in children forked from this process (no new interpreter to start), with
  their own output files and exit status (:func:`finish_forked`); :func:`fork_hazards` (from
  :mod:`lightning_loco.testing.fork_safety`) says when a fork is unsafe (torchft's runtime threads in
  this process), and :func:`run_module_forked` then starts a new interpreter.

Elastic replicas and their Lighthouse, separate processes each, are in :mod:`lightning_loco.testing.elastic`.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

from lightning_loco.testing.fork_safety import fork_hazards
from lightning_loco.testing.fork_safety import fork_is_safe as fork_is_safe  # re-exported: its home is fork_safety.py
from lightning_loco.testing.ports import free_port as free_port  # re-exported: its home is ports.py
from lightning_loco.testing.ranks import RanksFailed as RanksFailed  # re-exported: their home is ranks.py
from lightning_loco.testing.ranks import start_ranks as start_ranks


def init_gloo(
    rank: int,
    world_size: int,
    *,
    port: Optional[int] = None,
    file: Optional[Union[str, Path]] = None,
    timeout_s: float = 30.0,
) -> None:
    """Joins a gloo process group of ``world_size`` ranks as ``rank``.

    Rendezvous through ``file`` (a path every rank shares, which must not exist before the first
    rank starts: a ``FileStore``) or through ``port`` on localhost (``MASTER_ADDR``/``MASTER_PORT``
    are set for the libraries that read them). ``timeout_s`` bounds every collective."""
    import torch.distributed as dist

    if (port is None) == (file is None):
        raise ValueError("init_gloo needs exactly one of port= or file=")
    timeout = timedelta(seconds=timeout_s)
    if file is not None:
        dist.init_process_group("gloo", init_method=f"file://{Path(file).resolve()}", rank=rank,
                                world_size=world_size, timeout=timeout)
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)


def init_gloo_from_env(timeout_s: float = 30.0) -> tuple[int, int]:
    """Joins the gloo process group that torchrun's variables describe (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``: what ``benchmarks.netem.launch`` sets, where node 0 may have an
    address of its own); returns ``(rank, world_size)``. ``timeout_s`` bounds every collective."""
    import torch.distributed as dist

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"init_gloo_from_env needs {missing} in the environment, as torchrun sets them; "
                         "in a single process, call init_gloo(rank, world_size, port=...) instead")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return rank, world_size


def strategy_class(name: str) -> type:
    """The strategy class registered under ``name`` in Lightning's ``StrategyRegistry`` (ours after
    ``import lightning_loco``), or with ``"fabric:"`` before the name in Fabric's registry. Raises
    ``ValueError`` naming the registered names."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_loco  # noqa: F401  (registers noloco, gasloc, diloco with both)

    registry, key = (STRATEGY_REGISTRY, name.split(":", 1)[1]) if name.startswith("fabric:") else (StrategyRegistry,
                                                                                                    name)
    if key not in registry:
        raise ValueError(f"No strategy is registered as {name!r}; registered: {sorted(registry)}")
    return registry[key]["strategy"]


# ---------------------------------------------------------------- a run forked from this process
# A test process has torch and Lightning imported already: a child forked from it runs a script's work
# without a new interpreter's start-up (seconds per run on 2 cores). These run it as a separate process
# would: its own output files, its warnings and log records printed there, its own exit status.


def _one_thread_only(threads: int) -> None:
    """``torch.set_num_threads`` in a forked child: it stays at one (see :func:`fork_call`)."""


def fork_call(run: Callable[[], Any], streams: dict[int, Path], env: dict[str, str]) -> int:
    """Forks a child that calls ``run()`` on one thread, with ``env`` added to its environment and its output in
    ``streams`` (file descriptor → file; see :func:`print_to_files`), and ends with status 0, or 1 after printing
    the traceback of what it raised; it never returns into the caller. Returns the child's process id."""
    import torch

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        # One thread: GNU OpenMP is not fork-safe. A child's parallel region waits at a barrier for the
        # parent's OpenMP threads, which a fork does not copy, and hangs (seen in the GPU quality dry run's
        # first parallel op after this process had run others); with one thread torch starts none. So the
        # child stays on one thread whatever the code it runs asks for (the GPU quality run and B5's
        # processes part ask for two or more, which hung the dry run's child in its first conversion).
        torch.set_num_threads(1)
        torch.set_num_threads = _one_thread_only  # type: ignore[assignment]
        print_to_files(streams)
        os.environ.update(env)
        run()
        status = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def finish_forked(pid: int, streams: dict[int, Path], timeout: float, args: list[str]
                  ) -> subprocess.CompletedProcess:
    """Waits for the forked child ``pid`` (killed after ``timeout`` seconds: ``subprocess.TimeoutExpired``) and
    returns it as a finished process with the output it wrote to ``streams``."""
    deadline = time.monotonic() + timeout
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(args, timeout)
        time.sleep(0.05)
    stdout, stderr = (streams[fd].read_text(errors="replace") for fd in (1, 2))
    return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(wait_status), stdout, stderr)


def run_module_forked(module: str, argv: list[str], out: Path, env: dict[str, str], timeout: float,
                      cwd: Path) -> subprocess.CompletedProcess:
    """``python -m module *argv`` (in ``cwd``, with ``env`` added to the environment) as a child forked from
    this process: the same run without a new interpreter's start-up. Its output goes to ``out``. Where a fork
    is unsafe (:func:`fork_hazards`) it runs in a new interpreter instead, with the same output files."""
    out.mkdir(parents=True, exist_ok=True)
    streams = {1: out / "stdout.txt", 2: out / "stderr.txt"}
    args = [sys.executable, "-m", module, *argv]
    if fork_hazards():
        with open(streams[1], "w") as stdout, open(streams[2], "w") as stderr:
            proc = subprocess.run(args, cwd=cwd, env={**os.environ, **env}, stdout=stdout, stderr=stderr,
                                  timeout=timeout, check=False)
        return subprocess.CompletedProcess(args, proc.returncode, *(streams[fd].read_text(errors="replace")
                                                                    for fd in (1, 2)))
    pid = fork_call(module_runner(module, argv, cwd), streams, env)
    return finish_forked(pid, streams, timeout, args)


def module_runner(module: str, argv: Sequence[str], cwd: Path) -> Callable[[], None]:
    """What a forked child calls to run ``python -m module *argv`` in ``cwd``: the module's top-level package is
    imported afresh, as a new interpreter would (its module-level settings, read from the environment at
    import, see the child's); torch and Lightning stay imported. An exit status of 0 is a normal end."""
    import runpy

    def run() -> None:
        os.chdir(cwd)
        sys.path.insert(0, str(cwd))
        sys.argv = [module, *argv]
        package = module.split(".")[0]
        for name in [name for name in sys.modules if name == package or name.startswith(package + ".")]:
            del sys.modules[name]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise

    return run


RANK_GRACE_S = 30.0  # how long the other ranks of a forked launch have to end on their own after one failed


def fork_ranks(run_rank: Callable[[int], None], world: int, out: Path, timeout: float, args: list[str]
               ) -> subprocess.CompletedProcess:
    """``world`` ranks started as torchrun starts them: one child per rank forked from this process, each
    calling ``run_rank(rank)`` with ``LOCAL_RANK``, ``RANK``, ``NODE_RANK``, ``WORLD_SIZE`` and the
    rendezvous address (a free port of localhost) set, so that Lightning finds its processes created
    outside. Each rank's output goes to files in ``out``; the returned process holds them all (rank 0's
    first) and the first non-zero exit status. When a rank fails the others get ``RANK_GRACE_S`` seconds
    to end on their own (they usually fail the same check), then they are killed, as when ``timeout``
    passes (``subprocess.TimeoutExpired`` when no rank failed)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pids: dict[int, int] = {}
    for rank in range(world):
        env = dict(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        streams = {1: out / f"stdout{rank}.txt", 2: out / f"stderr{rank}.txt"}
        pids[rank] = fork_call(functools.partial(run_rank, rank), streams, env)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < world:
        for rank, pid in pids.items():
            if rank not in codes:
                done, wait_status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(wait_status)
                    if codes[rank] != 0:
                        deadline = min(deadline, time.monotonic() + RANK_GRACE_S)
        if len(codes) < world and time.monotonic() > deadline:
            one_failed = any(code != 0 for code in codes.values())
            for rank, pid in pids.items():
                if rank not in codes:
                    os.kill(pid, signal.SIGKILL)
                    codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if not one_failed:
                raise subprocess.TimeoutExpired(args, timeout)
        time.sleep(0.05)
    stdout, stderr = ("".join((out / f"{name}{r}.txt").read_text(errors="replace") for r in range(world))
                      for name in ("stdout", "stderr"))
    returncode = next((code for _, code in sorted(codes.items()) if code != 0), 0)
    return subprocess.CompletedProcess(args, returncode, stdout, stderr)


def print_to_files(streams: dict[int, Path]) -> None:
    """In a forked child: file descriptors 1 and 2 and ``sys.stdout``/``sys.stderr`` write to the files,
    warnings are printed (not recorded), and the log handlers that printed to the old streams print to the
    new ones (a test runner's own handlers are removed)."""
    import logging
    import warnings

    old = {id(sys.stdout): 1, id(sys.stderr): 2, id(sys.__stdout__): 1, id(sys.__stderr__): 2}
    for fd, path in streams.items():
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    new = {fd: open(fd, "w", buffering=1, closefd=False) for fd in streams}  # the child's, for its life
    loggers = [logging.getLogger()] + [
        one for one in logging.Logger.manager.loggerDict.values() if isinstance(one, logging.Logger)
    ]
    for one in loggers:
        for handler in list(one.handlers):
            if type(handler).__module__.startswith("_pytest"):
                one.removeHandler(handler)
            elif isinstance(handler, logging.StreamHandler) and id(handler.stream) in old:
                handler.setStream(new[old[id(handler.stream)]])
    sys.stdout, sys.stderr = new[1], new[2]

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show
