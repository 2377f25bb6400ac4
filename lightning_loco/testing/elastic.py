"""Elastic replicas on one machine, for tests, benchmarks and examples: a Lighthouse and the replica
processes around it.

* :class:`Lighthouse`: a ``lightning-loco lighthouse`` process on a free port (port 0), with the
  address it printed;
* :class:`Replicas`: replica processes of one script (``examples/elastic/replica.py``), each in its
  own session, with their logs, progress and records, waits bounded by one time limit, kills that
  reach everything a replica started, and a :meth:`Replicas.close` that leaves nothing running. A
  replica of several ranks is k processes started as torchrun starts them
  (:meth:`Replicas.start_ranks`), each of which can be killed alone.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Union

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds this lightning_loco package
_LIGHTHOUSE_FILE = SOURCE_ROOT / "lightning_loco" / "elastic" / "lighthouse.py"

# ``lightning-loco lighthouse ARGS`` in a process that asks first (Linux) for SIGTERM when its launcher
# dies: the Lighthouse serves until stopped, and must not outlive a launcher killed before it could stop it.
# It runs the command's module as a file (it imports torchft, not Lightning: seconds less per start).
_LIGHTHOUSE = """
import ctypes, os, runpy, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(os.environ["LOCO_LAUNCHER_PID"]):  # the launcher died before the call above
        sys.exit(1)
sys.argv = ["lightning-loco lighthouse", *sys.argv[2:]]
runpy.run_path(os.environ["LOCO_LIGHTHOUSE_FILE"], run_name="__main__")
"""


# torch.distributed's rendezvous variables: each replica started here is a world of its own and finds its own
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
               "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def child_env(**extra: str) -> dict[str, str]:
    """This environment with this ``lightning_loco`` first on ``PYTHONPATH`` (children import the same one),
    without the rendezvous variables of a process group this process may have been part of."""
    path = os.environ.get("PYTHONPATH")
    inherited = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    return {**inherited, "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), *([path] if path else [])]), **extra}


def kill_group(proc: subprocess.Popen) -> int:
    """SIGKILL to ``proc``'s process group (``proc`` leads its own session) unless it has ended; its exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.wait()


class Lighthouse:
    """A ``lightning-loco lighthouse`` process on a free port of localhost (``--bind 127.0.0.1:0``):
    :attr:`address` is the ``HOST:PORT`` it printed, for the replicas' ``lighthouse=``.

    Use it as a context manager, or call :meth:`close`. Raises ``RuntimeError`` with the command's own
    error (e.g. torchft missing) if it ends before it prints, or does not print within ``timeout_s``."""

    def __init__(self, min_replicas: int = 2, *, heartbeat_timeout_ms: Optional[int] = None,
                 join_timeout_ms: Optional[int] = None, timeout_s: float = 120.0) -> None:
        args = ["lighthouse", "--min-replicas", str(min_replicas), "--bind", "127.0.0.1:0"]
        if heartbeat_timeout_ms is not None:
            args += ["--heartbeat-timeout-ms", str(heartbeat_timeout_ms)]
        if join_timeout_ms is not None:
            args += ["--join-timeout-ms", str(join_timeout_ms)]
        self._log = tempfile.TemporaryFile()  # torchft logs every quorum there: a file never fills up
        self.proc = subprocess.Popen([sys.executable, "-c", _LIGHTHOUSE, *args], stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True,
                                     env=child_env(LOCO_LAUNCHER_PID=str(os.getpid()),
                                                   LOCO_LIGHTHOUSE_FILE=str(_LIGHTHOUSE_FILE)))
        stdout = self.proc.stdout
        assert stdout is not None  # stdout=PIPE
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        line = stdout.readline() if ready else None
        if line is None or not line.startswith("lighthouse "):
            if line == "":  # its output closed: it is ending
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self._stop()
            code = self.proc.returncode
            what = f"said nothing in {timeout_s:g} s" if line is None else f"ended (exit code {code})"
            self._log.seek(0)
            error = self._log.read().decode(errors="replace")[-3000:]
            self.close()
            raise RuntimeError(f"'lightning-loco {' '.join(args)}' {what} before its address:\n{line or ''}{error}")
        self.address: str = line.split()[1]

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # it answers SIGTERM by shutting down
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)

    def close(self) -> None:
        """Stops the Lighthouse (SIGTERM; SIGKILL if it still runs 10 s later)."""
        self._stop()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> "Lighthouse":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Replicas:
    """Elastic replica processes of one run, started from ``script`` (``examples/elastic/replica.py``
    or one with the same command line: ``--lighthouse``, ``--replica-id``, ``--out``, ``--launched-at``,
    and the flags given here), each in its own session so that a kill reaches all it started.

    ``common`` and :meth:`start`'s keywords become flags: ``max_steps=90`` is ``--max-steps 90``, ``True``
    a bare flag, ``None`` and ``False`` none. Every start logs to ``OUT/ID.K.log`` (K: the id's earlier
    starts). The replica writes ``OUT/ID.progress`` (its step) and ``OUT/ID.json`` (its record). No wait
    goes past ``limit_s`` after the launcher was made; :meth:`close` kills whatever is left."""

    def __init__(self, script: Union[str, Path], out: Union[str, Path], lighthouse: str, *, limit_s: float = 300.0,
                 **common: Any) -> None:
        self.script, self.out, self.lighthouse, self.common = Path(script), Path(out), lighthouse, common
        self.limit_s = limit_s
        self.started = time.monotonic()
        self.procs: dict[str, subprocess.Popen] = {}  # by ID.K, in the order started
        self._starts: dict[str, int] = {}  # by id
        self._logs: list[Any] = []

    def start(self, replica_id: str, **flags: Any) -> subprocess.Popen:
        """Starts one replica (again, under the same id, after it ended: its old progress file goes first)."""
        return self._start(replica_id, flags, [{}])[0]

    def start_ranks(self, replica_id: str, ranks: int, **flags: Any) -> list[subprocess.Popen]:
        """Starts one replica of ``ranks`` processes (``--ranks``), with the variables torchrun gives its
        workers (a rendezvous on a free port of localhost); returns them by rank. Rank r logs to
        ``OUT/ID.K.rR.log``. A launcher restarts the replica as torchrun does: all its ranks, once all ended."""
        from lightning_loco.testing.launch import free_port

        port = str(free_port())
        run = f"{replica_id}-{self._starts.get(replica_id, 0)}"
        envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(ranks), "RANK": str(r),
                 "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "NODE_RANK": "0",
                 "TORCHELASTIC_RUN_ID": run} for r in range(ranks)]
        return self._start(replica_id, {**flags, "ranks": ranks}, envs)

    def _start(self, replica_id: str, flags: dict[str, Any], envs: list[dict[str, str]]) -> list[subprocess.Popen]:
        self.out.mkdir(parents=True, exist_ok=True)
        for old in [self.out / f"{replica_id}.progress", *self.out.glob(f"{replica_id}.rank*.progress"),
                    self.out / f"{replica_id}.held", *self.out.glob(f"{replica_id}.rank*.held")]:
            old.unlink(missing_ok=True)
        cmd = [sys.executable, str(self.script), "--lighthouse", self.lighthouse, "--replica-id", replica_id,
               "--out", str(self.out), "--launched-at", repr(time.time())]
        for key, value in {**self.common, **flags}.items():
            if value is not None and value is not False:
                cmd += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
        name = f"{replica_id}.{self._starts.get(replica_id, 0)}"
        self._starts[replica_id] = self._starts.get(replica_id, 0) + 1
        procs = []
        for r, env in enumerate(envs):
            rank = f"{name}.r{r}" if len(envs) > 1 else name
            log = open(self.out / f"{rank}.log", "w")
            self._logs.append(log)
            self.procs[rank] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                env=child_env(**env))
            procs.append(self.procs[rank])
        return procs

    def progress(self, replica_id: str) -> int:
        """The step the replica last reported (0 before its first)."""
        try:
            return int((self.out / f"{replica_id}.progress").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _left(self) -> float:
        return self.limit_s - (time.monotonic() - self.started)

    def _name(self, proc: subprocess.Popen) -> str:
        return next(name for name, p in self.procs.items() if p is proc)

    def wait_for_step(self, replica_id: str, step: int, proc: subprocess.Popen) -> None:
        """Returns once ``replica_id`` has reported ``step``; raises ``RuntimeError`` (with the logs) if
        ``proc`` ends first or the launcher's time limit passes."""
        while self.progress(replica_id) < step:
            if proc.poll() is not None:
                raise RuntimeError(f"{self._name(proc)} ended (code {proc.returncode}) before step {step}:\n"
                                   f"{self.logs()}")
            if self._left() <= 0:
                raise RuntimeError(f"{replica_id} did not reach step {step} within {self.limit_s:g} s:\n{self.logs()}")
            time.sleep(0.02)

    def wait_until_held(self, replica_id: str, proc: subprocess.Popen) -> None:
        """Returns once ``replica_id`` (started with ``hold_at=N``) waits before step N; raises
        ``RuntimeError`` (with the logs) if ``proc`` ends first or the launcher's time limit passes."""
        while not (self.out / f"{replica_id}.held").exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{self._name(proc)} ended (code {proc.returncode}) before it held:\n{self.logs()}")
            if self._left() <= 0:
                raise RuntimeError(f"{replica_id} did not hold within {self.limit_s:g} s:\n{self.logs()}")
            time.sleep(0.02)

    def release(self, replica_id: str) -> None:
        """Lets ``replica_id`` (every rank, and every later start) go on past its ``hold_at`` step."""
        (self.out / f"{replica_id}.release").touch()

    def wait_for_log(self, log: str, pattern: str, proc: subprocess.Popen) -> None:
        """Returns once the log ``log`` (e.g. ``"A.0.r0"``) holds a line matching the regular expression
        ``pattern``: an event a replica said, not a time that passed. Raises ``RuntimeError`` (with the logs)
        if ``proc`` ends first or the launcher's time limit passes."""
        path, compiled = self.out / f"{log}.log", re.compile(pattern)
        while not (path.exists() and compiled.search(path.read_text(errors="replace"))):
            if proc.poll() is not None:
                raise RuntimeError(f"{self._name(proc)} ended (code {proc.returncode}) before {log} said "
                                   f"{pattern!r}:\n{self.logs()}")
            if self._left() <= 0:
                raise RuntimeError(f"{log} did not say {pattern!r} within {self.limit_s:g} s:\n{self.logs()}")
            time.sleep(0.05)

    def wait(self, proc: subprocess.Popen, timeout_s: Optional[float] = None) -> int:
        """``proc``'s exit code, waiting at most ``timeout_s`` (default: what is left of the time limit);
        raises ``TimeoutError`` (with the logs) and leaves it running when that passes."""
        timeout = max(0.1, self._left() if timeout_s is None else min(timeout_s, self._left()))
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self._name(proc)} still runs after {timeout:.1f} s more:\n{self.logs()}") from None

    def kill(self, proc: subprocess.Popen) -> int:
        """SIGKILL to the replica and all it started; returns its exit code (``-SIGKILL`` if it still ran)."""
        return kill_group(proc)

    def record(self, replica_id: str, rank: int = 0) -> dict[str, Any]:
        """What the replica's last run (its rank ``rank``) wrote when ``fit`` ended (``OUT/ID.json``;
        ``OUT/ID.rankR.json`` for rank R > 0 of a replica of several ranks)."""
        return json.loads((self.out / f"{replica_id}{f'.rank{rank}' if rank else ''}.json").read_text())

    def logs(self) -> str:
        """The end of every replica's log."""
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.out.glob("*.log")))

    def close(self) -> None:
        """Kills every replica still running, and closes the logs."""
        for proc in self.procs.values():
            kill_group(proc)
        for log in self._logs:
            log.close()

    def __enter__(self) -> "Replicas":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
