"""Start one worker process per node on a chosen network and collect what they write.

``mode``: ``"loopback"`` (no emulation), ``"modelled"`` (loopback plus the in-process model,
:mod:`benchmarks.netem.modelled`) or ``"emulated"`` (one network namespace per node, packet-level,
:mod:`benchmarks.netem.tun`; needs root). Workers find each other with torch.distributed's ``env://``
variables, set as torchrun would for ``nnodes = N, nproc_per_node = 1`` (Lightning reads them too).

With ``LOCO_BENCH_FORK_WORKERS=1`` (:mod:`benchmarks.common`) a worker of ``-m module`` on loopback or the
modelled network is a child forked from this process; packet-level emulation always starts new interpreters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from benchmarks.common import ROOT, forking
from benchmarks.netem import links
from benchmarks.netem.links import Network
from lightning_loco.testing.launch import fork_ranks, free_port, module_runner

MODES = ("loopback", "modelled", "emulated")

emulator: dict = {}
"""In emulated mode, how the forwarder kept to the link's timing in the last run
(:meth:`benchmarks.netem.tun.EmulatedNetwork.lateness`); empty otherwise."""


def run_workers(
    mode: str,
    network: Network,
    argv: Callable[[int], Sequence[str]],
    timeout: float = 1800,
    env: Optional[dict[str, str]] = None,
    sysctls: dict[str, str] | None = None,
) -> float:
    """Runs ``argv(i)`` for every node i; returns the wall time. Raises if any worker fails.

    ``sysctls`` (emulated mode only) are set in every node's network namespace, e.g.
    ``{"net.ipv4.tcp_slow_start_after_idle": "0"}``; the namespaces, and with them the settings, are
    deleted afterwards, so the host's own settings are never touched."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if sysctls and mode != "emulated":
        raise ValueError(f"sysctls={sysctls} need mode='emulated' (their own network namespaces), got {mode!r}")
    n = len(network.links)
    emulator.clear()
    base = {
        **(env or {}),
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    with ExitStack() as stack:
        procs = []
        start = time.perf_counter()
        # each worker's output goes to files, not pipes: a worker that writes more than a pipe holds (torchft
        # logs every quorum) would block on it while this process waits for another worker, which waits for it
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loco-workers-")))

        def output(i: int) -> dict:
            return {"stdout": stack.enter_context(open(logs / f"{i}.out", "w")),
                    "stderr": stack.enter_context(open(logs / f"{i}.err", "w"))}

        if mode == "emulated":
            from benchmarks.netem.tun import EmulatedNetwork

            emu = stack.enter_context(EmulatedNetwork(network, sysctls=sysctls))
            for i in range(n):
                node_env = {**base, "RANK": str(i), "GROUP_RANK": str(i), "NODE_RANK": str(i),
                            "MASTER_ADDR": emu.address(0)}
                procs.append(emu.popen(i, [sys.executable, *argv(i)], env=node_env, cwd=ROOT, **output(i)))
        else:
            extra = {links.ENV: links.to_env(network)} if mode == "modelled" else {}
            if forking():
                _fork_workers(n, argv, lambda i: {**base, **extra, "RANK": str(i), "GROUP_RANK": str(i),
                                                  "NODE_RANK": str(i), "MASTER_ADDR": "127.0.0.1"}, timeout)
                return time.perf_counter() - start
            for i in range(n):
                node_env = {**os.environ, **base, **extra, "RANK": str(i), "GROUP_RANK": str(i), "NODE_RANK": str(i),
                            "MASTER_ADDR": "127.0.0.1"}
                procs.append(subprocess.Popen([sys.executable, *argv(i)], env=node_env, cwd=ROOT, **output(i)))
        failures = []
        try:
            # every worker at once: the first that fails ends the run (the others may wait for it forever)
            while True:
                codes = [proc.poll() for proc in procs]
                failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    failures += [f"worker {i} exited with {codes[i]}:\n"
                                 f"{(logs / f'{i}.err').read_text(errors='replace')[-3000:]}" for i in failed]
                    break
                if all(code == 0 for code in codes):
                    break
                if time.perf_counter() - start > timeout:
                    failures.append(f"workers did not finish within {timeout} s")
                    break
                time.sleep(0.1)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if mode == "emulated":
                emulator.update(emu.lateness())
        if failures:
            raise RuntimeError("\n".join(failures))
        return time.perf_counter() - start


def _fork_workers(n: int, argv: Callable[[int], Sequence[str]], env: Callable[[int], dict[str, str]],
                  timeout: float) -> None:
    """The workers as children forked from this process (see the module docstring); raises as the exec'd
    workers' path does when one fails or they outlast ``timeout``."""
    def run_node(i: int) -> None:
        args = list(argv(i))
        if args[:1] != ["-m"]:
            raise ValueError(f"forked workers run '-m module' only, got {args[:2]}")
        os.environ.update(env(i))  # this node's variables over the ones fork_ranks sets for one machine
        module_runner(args[1], args[2:], ROOT)()

    with tempfile.TemporaryDirectory() as out:
        try:
            proc = fork_ranks(run_node, n, Path(out), timeout, [sys.executable, *argv(0)])
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"workers did not finish within {timeout} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"a worker exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
