"""Lightning runs for the benchmarks: a quiet Trainer, strategies by name, and runs of real processes.

* :func:`quiet_trainer`: a ``Trainer`` without logger, checkpoints, progress bar, summary or
  validation, the benchmarks' common case;
* :func:`strategy`: a strategy by its ``Trainer(strategy=...)`` name, from Lightning's registry
  (:func:`lightning_loco.testing.launch.strategy_class`);
* :func:`cluster_environment` and :func:`run_ranks`: ranks that a benchmark starts itself
  (spawned, one node each), joined with a time limit, the ones still running killed;
* :func:`save_weights` and :func:`run_lightning_processes`: one multi-process fit through
  Lightning's own launcher in a fresh Python process, every rank's final weights read back.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import run_python, wait_for_files
from lightning_loco.testing.launch import free_port, strategy_class

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
         "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0}


def quiet_trainer(**kwargs: Any) -> Any:
    """``lightning.Trainer(**kwargs)`` with :data:`QUIET`'s settings unless ``kwargs`` sets them."""
    import lightning as L

    return L.Trainer(**{**QUIET, **kwargs})


def strategy(name: str, **kwargs: Any) -> Any:
    """The strategy registered as ``name`` ("noloco", "gasloc", "diloco"), built with ``kwargs``."""
    return strategy_class(name)(**kwargs)


def cluster_environment(rank: int, world: int) -> Any:
    """Lightning's view of ``world`` ranks that the benchmark started itself: one per node, one
    device each, this process being ``rank``."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    class RanksStartedHere(LightningEnvironment):
        @property
        def creates_processes_externally(self) -> bool:
            return True

        def world_size(self) -> int:
            return world

        def global_rank(self) -> int:
            return rank

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return rank

    return RanksStartedHere()


def run_ranks(target: Callable[..., None], args: Sequence[Sequence[Any]], limit_s: float) -> int:
    """Runs ``target(*args[r])`` in one spawned process per rank and waits for all of them until
    ``limit_s`` seconds after the start; kills the ones still running then. Returns how many were
    killed. Spawned, not forked: fork is unsafe once CUDA is initialised and, on the CPU, once this
    process has trained (a forked child can inherit a lock held by one of torch's threads and hang)."""
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=target, args=tuple(a)) for a in args]
    for proc in procs:
        proc.start()
    deadline = time.perf_counter() + limit_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.perf_counter()))
    hung = [proc for proc in procs if proc.is_alive()]
    for proc in hung:
        proc.kill()
        proc.join(5)
    return len(hung)


def save_weights(out: Path) -> Any:
    """A callback that writes ``out/rank{r}.pt`` at the end of training: ``{"state": the module's
    state dict, "seconds": training time}``."""
    import lightning as L
    import torch

    class SaveWeights(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.started = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            seconds = time.perf_counter() - self.started
            path = out / f"rank{trainer.global_rank}.pt"
            torch.save({"state": pl_module.state_dict(), "seconds": seconds}, path.with_suffix(".part"))
            os.replace(path.with_suffix(".part"), path)  # whole or absent to the reader

    return SaveWeights()


def run_lightning_processes(module: str, config: dict[str, Any], out: Path, ranks: int, what: str = "",
                            timeout_s: float = 3600) -> tuple[list[dict[str, Any]], float]:
    """Runs ``python -m <module> --lightning-run <config as JSON>`` in a fresh process, where
    Lightning's launcher starts the ranks (on a port from :func:`free_port`) and each rank saves its
    weights with :func:`save_weights` into ``out``. Returns what the ``ranks`` ranks saved and the
    wall time; raises with the process's output when it fails (``what`` names the run there)."""
    import torch

    env = {**os.environ, "MASTER_PORT": str(free_port())}
    started = time.perf_counter()
    proc = run_python(["-m", module, "--lightning-run", json.dumps(config)], env=env, timeout=timeout_s)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{what or 'the run of ' + module} with {ranks} processes failed:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    files = [out / f"rank{r}.pt" for r in range(ranks)]
    missing = wait_for_files(files)  # the other ranks may end after rank 0's process
    if missing:
        raise RuntimeError(f"{what or 'the run of ' + module}: {[f.name for f in missing]} not written within "
                           f"120 s of rank 0's end:\n{proc.stderr[-4000:]}")
    return [torch.load(f) for f in files], wall
